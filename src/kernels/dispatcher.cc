#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <tuple>

#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>
#include <shardline/kernels/dispatcher.h>

#include "register.h"

namespace shardline::kernels {
namespace {

// Provider selection, guarded by one mutex. Read on every dispatch; written rarely.
struct Selection {
    std::mutex mutex;
    std::string global; // empty: "default"
    std::map<std::string, std::string, std::less<>> per_op;
    std::set<std::string, std::less<>> logged; // "op|device|wanted|serving" debug lines already logged
    std::vector<KernelInfo> kernels;
    std::uint64_t summary_generation = 0; // the selection generation the summary below was checked at
    std::string summary;                  // the last summary line logged
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

// The provider rules 1 and 3 choose for a top-level call of `op`, before the fallback (caller holds s.mutex).
std::string WantedProvider(const Selection& s, std::string_view op) {
    if (auto it = s.per_op.find(op); it != s.per_op.end()) {
        return it->second;
    }
    return s.global.empty() ? std::string(kDefaultProvider) : s.global;
}

// One line for every registered op under the current selection (caller holds s.mutex):
//   "kernels: provider 'default' serves all 34 ops", or
//   "kernels: provider 'default' serves 30 of 34 ops; 'legacy' serves LinearForward[cuda], LinearBackwardBias[cuda]"
// An op appears under another provider by name when that provider serves it on every device it has kernels for, else
// as op[device] for the devices it serves. Top-level calls only: an op called by another one inherits its caller's
// provider (rule 2), which the per-op debug lines show.
std::string SelectionSummary(const Selection& s) {
    std::vector<std::string> ops; // in registration order
    std::map<std::string, std::vector<DeviceType>, std::less<>> devices;
    std::set<std::tuple<std::string_view, DeviceType, std::string_view>> registered;
    for (const KernelInfo& k : s.kernels) {
        auto& op_devices = devices[k.op];
        if (op_devices.empty()) {
            ops.push_back(k.op);
        }
        if (std::find(op_devices.begin(), op_devices.end(), k.device) == op_devices.end()) {
            op_devices.push_back(k.device);
        }
        registered.emplace(k.op, k.device, k.provider);
    }
    // provider -> the ops (or op[device]) it serves, in registration order of the providers' first op.
    std::vector<std::pair<std::string, std::vector<std::string>>> served;
    auto entry = [&](const std::string& provider) -> std::vector<std::string>& {
        for (auto& [name, labels] : served) {
            if (name == provider) {
                return labels;
            }
        }
        return served.emplace_back(provider, std::vector<std::string>{}).second;
    };
    for (const std::string& op : ops) {
        const std::string wanted = WantedProvider(s, op);
        std::vector<std::pair<DeviceType, std::string>> serving;
        for (DeviceType device : devices[op]) {
            const bool has = registered.contains({op, device, wanted});
            serving.emplace_back(device, has ? wanted : std::string(kDefaultProvider));
        }
        const bool one = std::all_of(serving.begin(), serving.end(),
                                     [&](const auto& d) { return d.second == serving.front().second; });
        if (one) {
            entry(serving.front().second).push_back(op);
        } else {
            for (const auto& [device, provider] : serving) {
                entry(provider).push_back(fmt::format("{}[{}]", op, DeviceTypeName(device)));
            }
        }
    }
    if (served.empty()) {
        return "kernels: no kernels registered";
    }
    // The main provider serves the most ops; its op[device] entries are implied by the others'.
    auto main = std::max_element(served.begin(), served.end(), [](const auto& a, const auto& b) {
        return a.second.size() < b.second.size() || (a.second.size() == b.second.size() && b.first == kDefaultProvider);
    });
    if (served.size() == 1) {
        return fmt::format("kernels: provider '{}' serves all {} ops", main->first, ops.size());
    }
    const auto whole = std::count_if(main->second.begin(), main->second.end(),
                                     [](const std::string& label) { return !label.ends_with(']'); });
    std::string line = fmt::format("kernels: provider '{}' serves {} of {} ops", main->first, whole, ops.size());
    for (const auto& [provider, labels] : served) {
        if (&provider != &main->first) {
            line += fmt::format("; '{}' serves {}", provider, fmt::join(labels, ", "));
        }
    }
    return line;
}

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
    // Lines read "op|device|wanted|serving": forget those that name the provider as either.
    std::erase_if(s.logged, [&](const std::string& line) {
        const std::string_view text = line;
        const std::size_t serving_at = text.rfind('|');
        const std::size_t wanted_at = text.rfind('|', serving_at - 1);
        return text.substr(serving_at + 1) == provider ||
               text.substr(wanted_at + 1, serving_at - wanted_at - 1) == provider;
    });
    s.summary.clear(); // the next summary is logged even when it reads as the last one did
}

std::string ChooseProvider(std::string_view op, DeviceType device, std::string_view caller_provider,
                           const std::function<bool(std::string_view)>& has, std::string* wanted_out) {
    Selection& s = TheSelection();
    std::string wanted;
    {
        std::lock_guard lock(s.mutex);
        if (s.per_op.find(op) == s.per_op.end() && !caller_provider.empty()) {
            wanted = std::string(caller_provider);
        } else {
            wanted = WantedProvider(s, op);
        }
    }
    const std::string serving = has(wanted) ? wanted : std::string(kDefaultProvider);
    const std::string line = fmt::format("{}|{}|{}|{}", op, DeviceTypeName(device), wanted, serving);
    bool first = false;
    std::string summary; // non-empty: a new summary to log
    {
        std::lock_guard lock(s.mutex);
        first = s.logged.insert(line).second;
        const std::uint64_t generation = SelectionGeneration();
        if (s.summary_generation != generation) {
            s.summary_generation = generation;
            std::string now = SelectionSummary(s);
            if (now != s.summary) {
                s.summary = now;
                summary = std::move(now);
            }
        }
    }
    // One info line per process (per selection) says who serves the ops; rank 0 alone prints it at info level, the
    // other ranks at debug. The per-op resolution is debug detail.
    if (!summary.empty()) {
        if (ProcessRank() == 0) {
            SHARDLINE_LOG_INFO("{}", summary);
        } else {
            SHARDLINE_LOG_DEBUG("{}", summary);
        }
    }
    if (first) {
        if (serving == wanted) {
            SHARDLINE_LOG_DEBUG("kernel {} on {}: provider '{}'", op, DeviceTypeName(device), serving);
        } else {
            SHARDLINE_LOG_DEBUG("kernel {} on {}: provider '{}' has none, '{}' serves it", op, DeviceTypeName(device),
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
