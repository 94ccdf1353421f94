#pragma once

// Typed kernel dispatcher keyed by (op, device type, provider).
//
// An op is a tag type with a name and a function-pointer type:
//
//     struct GemmOp { static constexpr std::string_view kName = "Gemm"; using Fn = void (*)(const GemmParams&); };
//
// Register<GemmOp>(DeviceType::kCUDA, "legacy", &LegacyGemm) only compiles when LegacyGemm has exactly that
// signature, and Resolve<GemmOp>(...) hands back that same typed pointer: nothing is re-cast from call-site types.
//
// Provider selection for op X (first that applies):
//   1. a per-op override: SetOpProvider("X", p), or SHARDLINE_LINEAR_IMPL=legacy for the Linear* ops;
//   2. for a nested op (Gemm called by Linear/Matmul/Outer): the provider serving the calling op;
//   3. the global provider: SetProvider(p), else SHARDLINE_PROVIDER, else "default".
// If the chosen provider has no kernel for (X, device), "default" serves it. So a provider may register any subset
// of ops, and one that registers only Gemm serves Linear, Matmul and Outer through the default compositions.
// One info line (rank 0; once per process, again only when the selection changes) says which provider serves the ops:
// "kernels: provider 'default' serves all 34 ops". The provider serving each (op, device, provider choice) is logged
// once at debug level.

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <shardline/core/device.h>
#include <shardline/core/error.h>
#include <shardline/core/per_thread.h>

namespace shardline::kernels {

inline constexpr std::string_view kDefaultProvider = "default";
inline constexpr std::string_view kLegacyProvider = "legacy";

/// Global provider (replaces SHARDLINE_PROVIDER for this process).
void SetProvider(std::string_view provider);
/// Provider for one op by name ("LinearForward", "Gemm", ...).
void SetOpProvider(std::string_view op, std::string_view provider);
/// Back to what the environment says (SHARDLINE_PROVIDER, SHARDLINE_LINEAR_IMPL).
void ResetProviderSelection();
/// The provider chosen for an op before falling back to "default" (rules 1 and 3 above).
std::string SelectedProvider(std::string_view op);

/// One registered kernel, for shardline-info and tests.
struct KernelInfo {
    std::string op;
    DeviceType device;
    std::string provider;
};
std::vector<KernelInfo> RegisteredKernels();

/// Registers the built-in kernels (CPU, CUDA where built). Called on first use of the dispatcher; idempotent.
void EnsureBuiltinKernels();

namespace detail {
/// The provider serving the op whose kernel is running on this thread (empty outside any kernel).
std::string_view CurrentProvider();
/// Marks `provider` as serving the running op for the scope's lifetime.
class ProviderScope {
public:
    explicit ProviderScope(std::string_view provider);
    ~ProviderScope();
    ProviderScope(const ProviderScope&) = delete;
    ProviderScope& operator=(const ProviderScope&) = delete;

private:
    std::string_view previous_;
};
/// Bumped by every change of selection or registration; cached resolutions of an older generation are stale.
std::uint64_t SelectionGeneration();
void BumpSelectionGeneration();
void RecordKernel(std::string_view op, DeviceType device, std::string_view provider);
void ForgetProvider(std::string_view provider);
/// Chooses the provider name for `op` per the rules above; `has(p)` says whether provider p has the kernel.
/// Returns the provider that serves the op; `wanted`, when given, receives the provider chosen before the fallback.
std::string ChooseProvider(std::string_view op, DeviceType device, std::string_view caller_provider,
                           const std::function<bool(std::string_view)>& has, std::string* wanted = nullptr);
} // namespace detail

/// The kernel serving an op and the provider it came from.
template <class Op> struct Resolved {
    typename Op::Fn fn = nullptr;
    std::string provider;  ///< the provider whose kernel serves the op (after the fallback to "default")
    std::string requested; ///< the provider chosen for the op (rules 1-3): what the ops it calls inherit
};

template <class Op> class OpTable {
public:
    using Fn = typename Op::Fn;

    static void Register(DeviceType device, std::string_view provider, Fn fn) {
        EnsureBuiltinKernels();
        {
            std::lock_guard lock(Mutex());
            for (Entry& e : Entries()) {
                if (e.device == device && e.provider == provider) {
                    e.fn = fn;
                    detail::BumpSelectionGeneration(); // cached resolutions hold the old pointer
                    return;
                }
            }
            Entries().push_back(Entry{device, std::string(provider), fn});
        }
        detail::RecordKernel(Op::kName, device, provider);
        detail::BumpSelectionGeneration();
    }

    static void Unregister(std::string_view provider) {
        std::lock_guard lock(Mutex());
        std::erase_if(Entries(), [&](const Entry& e) { return e.provider == provider; });
        detail::BumpSelectionGeneration();
    }

    /// The kernel for `device` from the selected provider (see the rules above). `caller_provider` is the provider
    /// serving the op that calls this one, or empty at the top level.
    static Resolved<Op> Resolve(DeviceType device, std::string_view caller_provider = {}) {
        // The hot path: the same (device, caller provider) under an unchanged selection resolves from this thread's
        // cache, without a lock, the selection rules or the log bookkeeping. The generation is read first: a
        // registration or change of selection during the resolution (the built-in kernels' included) makes the entry
        // stale at once.
        const std::uint64_t generation = detail::SelectionGeneration();
        std::vector<CacheEntry>* mine = ThreadCache();
        if (mine != nullptr) {
            for (const CacheEntry& c : *mine) {
                if (c.generation == generation && c.device == device && c.caller == caller_provider) {
                    return c.resolved;
                }
            }
        }
        Resolved<Op> resolved = ResolveShared(device, caller_provider, generation);
        if (mine != nullptr) {
            std::erase_if(*mine, [&](const CacheEntry& c) { return c.generation < generation; });
            mine->push_back(CacheEntry{generation, device, std::string(caller_provider), resolved});
        }
        return resolved;
    }

private:
    /// Resolve under the table's lock, through the process-wide cache (read before the resolution, `generation` makes
    /// a change of selection during it resolve again on the next call).
    static Resolved<Op> ResolveShared(DeviceType device, std::string_view caller_provider, std::uint64_t generation) {
        EnsureBuiltinKernels();
        std::lock_guard lock(Mutex());
        for (const CacheEntry& c : Cache()) {
            if (c.generation == generation && c.device == device && c.caller == caller_provider) {
                return c.resolved;
            }
        }
        std::erase_if(Cache(), [&](const CacheEntry& c) { return c.generation < generation; });
        std::string requested;
        const std::string provider = detail::ChooseProvider(
            Op::kName, device, caller_provider, [&](std::string_view p) { return Find(device, p) != nullptr; },
            &requested);
        Fn fn = Find(device, provider);
        if (fn == nullptr) {
            SHARDLINE_THROW(::shardline::Error, Op::kName, "no kernel registered for device {} (provider {})",
                            DeviceTypeName(device), provider);
        }
        Resolved<Op> resolved{fn, provider, std::move(requested)};
        Cache().push_back(CacheEntry{generation, device, std::string(caller_provider), resolved});
        return resolved;
    }

    struct Entry {
        DeviceType device;
        std::string provider;
        Fn fn;
    };
    static Fn Find(DeviceType device, std::string_view provider) {
        for (const Entry& e : Entries()) {
            if (e.device == device && e.provider == provider) {
                return e.fn;
            }
        }
        return nullptr;
    }
    static std::mutex& Mutex() {
        static std::mutex mutex;
        return mutex;
    }
    static std::vector<Entry>& Entries() {
        static std::vector<Entry> entries;
        return entries;
    }
    struct CacheEntry {
        std::uint64_t generation;
        DeviceType device;
        std::string caller;
        Resolved<Op> resolved;
    };
    static std::vector<CacheEntry>& Cache() {
        static std::vector<CacheEntry> cache;
        return cache;
    }
    /// This thread's resolutions; null once the thread's thread-locals are being destroyed (a dispatch from a
    /// destructor then takes the locked path).
    static std::vector<CacheEntry>* ThreadCache() {
        return ::shardline::detail::PerThread<std::vector<CacheEntry>, OpTable>();
    }
};

template <class Op> void Register(DeviceType device, std::string_view provider, typename Op::Fn fn) {
    OpTable<Op>::Register(device, provider, fn);
}

/// Runs op `Op` on `device` with the selected provider's kernel (nested ops inherit the provider).
template <class Op, class Args> void Dispatch(DeviceType device, const Args& args) {
    const Resolved<Op> resolved = OpTable<Op>::Resolve(device, detail::CurrentProvider());
    // Nested ops inherit the provider chosen for this op, not the one that served it: a provider that supplies only
    // Gemm must still see the Gemm of a Linear op that "default" composes for it.
    detail::ProviderScope scope(resolved.requested);
    resolved.fn(args);
}

/// Removes every kernel of a provider from the given ops (tests use this to clean up).
template <class... Ops> void UnregisterProvider(std::string_view provider) {
    (OpTable<Ops>::Unregister(provider), ...);
    detail::ForgetProvider(provider);
}

} // namespace shardline::kernels
