#include <shardline/kernels/dispatcher.h>

#include <shardline/core/env.h>

#include <cstdlib>
#include <map>
#include <set>
#include <tuple>

#include <shardline/core/logging.h>

#include "register.h"

namespace shardline::kernels {
namespace {

// Provider selection, guarded by one mutex. Read on every dispatch; written rarely.
struct Selection {
    std::mutex mutex;
    std::string global;                         // empty: "default"
    std::map<std::string, std::string, std::less<>> per_op;
    std::set<std::string, std::less<>> logged;  // "op|device|provider" lines already logged
    std::vector<KernelInfo> kernels;
};

Selection& TheSelection() {
    static Selection selection;
    return selection;
}

constexpr std::string_view kLinearOps[] = {"LinearForward", "LinearBackwardInput", "LinearBackwardWeight",
                                           "LinearBackwardBias", "LinearBackward"};

// The environment's choice: SHARDLINE_PROVIDER (global) and SHARDLINE_LINEAR_IMPL=legacy (the Linear ops).
void LoadEnvironment(Selection& s) {
    s.global.clear();
    s.per_op.clear();
    if (const auto provider = env::Get("SHARDLINE_PROVIDER")) {
        s.global = *provider;
    }
    if (const auto impl = env::Get("SHARDLINE_LINEAR_IMPL")) {
        if (env::ParseChoice("SHARDLINE_LINEAR_IMPL", *impl, {"default", "fused", "legacy"}) == "legacy") {
            for (std::string_view op : kLinearOps) {
                s.per_op[std::string(op)] = std::string(kLegacyProvider);
            }
        }
    }
}

thread_local std::string_view t_current_provider;
std::atomic<std::uint64_t> g_selection_generation{1};

} // namespace

void EnsureBuiltinKernels() {
    static std::atomic<bool> done{false};
    if (done.load(std::memory_order_acquire)) {
        return;
    }
    static std::recursive_mutex mutex;
    static bool in_progress = false;
    std::lock_guard lock(mutex);
    if (done.load(std::memory_order_relaxed) || in_progress) {
        return; // registration in progress on this thread: Register() calls back here
    }
    in_progress = true;
    try {
        {
            Selection& s = TheSelection();
            std::lock_guard slock(s.mutex);
            LoadEnvironment(s);
        }
        detail::RegisterCompositeKernels();
        detail::RegisterCpuKernels();
#if SHARDLINE_HAVE_CUDA
        detail::RegisterCudaKernels();
#endif
    } catch (...) {
        // E.g. a bad SHARDLINE_LINEAR_IMPL: report it, and let the next call retry instead of finding no kernels.
        in_progress = false;
        throw;
    }
    in_progress = false;
    done.store(true, std::memory_order_release);
}

void SetProvider(std::string_view provider) {
    EnsureBuiltinKernels();
    Selection& s = TheSelection();
    std::lock_guard lock(s.mutex);
    s.global = std::string(provider);
    detail::BumpSelectionGeneration();
}

void SetOpProvider(std::string_view op, std::string_view provider) {
    EnsureBuiltinKernels();
    Selection& s = TheSelection();
    std::lock_guard lock(s.mutex);
    s.per_op[std::string(op)] = std::string(provider);
    detail::BumpSelectionGeneration();
}

void ResetProviderSelection() {
    EnsureBuiltinKernels();
    Selection& s = TheSelection();
    std::lock_guard lock(s.mutex);
    LoadEnvironment(s);
    detail::BumpSelectionGeneration();
}

std::string SelectedProvider(std::string_view op) {
    EnsureBuiltinKernels();
    Selection& s = TheSelection();
    std::lock_guard lock(s.mutex);
    if (auto it = s.per_op.find(op); it != s.per_op.end()) {
        return it->second;
    }
    return s.global.empty() ? std::string(kDefaultProvider) : s.global;
}

std::vector<KernelInfo> RegisteredKernels() {
    EnsureBuiltinKernels();
    Selection& s = TheSelection();
    std::lock_guard lock(s.mutex);
    return s.kernels;
}

namespace detail {

std::string_view CurrentProvider() { return t_current_provider; }

std::uint64_t SelectionGeneration() { return g_selection_generation.load(std::memory_order_acquire); }
void BumpSelectionGeneration() { g_selection_generation.fetch_add(1, std::memory_order_acq_rel); }

ProviderScope::ProviderScope(std::string_view provider) : previous_(t_current_provider) {
    t_current_provider = provider;
}
ProviderScope::~ProviderScope() { t_current_provider = previous_; }

void RecordKernel(std::string_view op, DeviceType device, std::string_view provider) {
    Selection& s = TheSelection();
    std::lock_guard lock(s.mutex);
    for (const KernelInfo& k : s.kernels) {
        if (k.op == op && k.device == device && k.provider == provider) {
            return;
        }
    }
    s.kernels.push_back(KernelInfo{std::string(op), device, std::string(provider)});
}

void ForgetProvider(std::string_view provider) {
    Selection& s = TheSelection();
    std::lock_guard lock(s.mutex);
    std::erase_if(s.kernels, [&](const KernelInfo& k) { return k.provider == provider; });
    std::erase_if(s.logged, [&](const std::string& line) {
        return line.size() > provider.size() && line.ends_with(provider) &&
               line[line.size() - provider.size() - 1] == '|';
    });
}

std::string ChooseProvider(std::string_view op, DeviceType device, std::string_view caller_provider,
                           const std::function<bool(std::string_view)>& has, std::string* wanted_out) {
    Selection& s = TheSelection();
    std::string wanted;
    {
        std::lock_guard lock(s.mutex);
        if (auto it = s.per_op.find(op); it != s.per_op.end()) {
            wanted = it->second;
        } else if (!caller_provider.empty()) {
            wanted = std::string(caller_provider);
        } else {
            wanted = s.global.empty() ? std::string(kDefaultProvider) : s.global;
        }
    }
    const std::string serving = has(wanted) ? wanted : std::string(kDefaultProvider);
    const std::string line = fmt::format("{}|{}|{}|{}", op, DeviceTypeName(device), wanted, serving);
    bool first = false;
    {
        std::lock_guard lock(s.mutex);
        first = s.logged.insert(line).second;
    }
    if (first) {
        if (serving == wanted) {
            SHARDLINE_LOG_INFO("kernel {} on {}: provider '{}'", op, DeviceTypeName(device), serving);
        } else {
            SHARDLINE_LOG_INFO("kernel {} on {}: provider '{}' has none, '{}' serves it", op, DeviceTypeName(device),
                               wanted, serving);
        }
    }
    if (wanted_out != nullptr) {
        *wanted_out = wanted;
    }
    return serving;
}

} // namespace detail
} // namespace shardline::kernels
