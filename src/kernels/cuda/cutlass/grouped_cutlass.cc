// Which translation unit serves a grouped GEMM: the (element type, config) pair, when this build compiled the CUTLASS
// kernels (SHARDLINE_HAVE_CUTLASS in shardline/config.h, the same switch that adds the sm_90a objects in
// src/kernels/cuda/CMakeLists.txt). A source property set in that subdirectory did not reach this file, which
// shardline_kernels (defined in src/) compiles: every CUTLASS test skipped with "not built" on an H200.

#include "grouped_cutlass.h"

#include <atomic>

#include <shardline/config.h>

namespace shardline::kernels::cuda::cutlass_grouped {

const char *ConfigName(Config config) {
    switch (config) {
    case Config::kCooperative256x128:
        return "cooperative256x128";
    case Config::kCooperative128x128:
        return "cooperative128x128";
    case Config::kPingpong128x128:
        return "pingpong128x128";
    case Config::kPingpong128x64:
        return "pingpong128x64";
    case Config::kCooperative128x256:
        return "cooperative128x256";
    }
    return "unknown";
}

namespace {
std::atomic<std::uint64_t> &Generation() {
    static std::atomic<std::uint64_t> generation{0};
    return generation;
}
std::atomic<std::uint64_t> &Hits() {
    static std::atomic<std::uint64_t> hits{0};
    return hits;
}
std::atomic<std::uint64_t> &Misses() {
    static std::atomic<std::uint64_t> misses{0};
    return misses;
}
} // namespace

CachedParamsStats GetCachedParamsStats() {
    return {.hits = Hits().load(std::memory_order_relaxed), .misses = Misses().load(std::memory_order_relaxed)};
}
void CountCachedParams(bool hit) { (hit ? Hits() : Misses()).fetch_add(1, std::memory_order_relaxed); }

void ForgetCachedParams() { Generation().fetch_add(1, std::memory_order_relaxed); }
std::uint64_t CachedParamsGeneration() { return Generation().load(std::memory_order_relaxed); }

#if SHARDLINE_HAVE_CUTLASS
namespace detail {
int Run_bf16_256x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
int Run_bf16_128x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
int Run_bf16_pingpong128x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
int Run_bf16_pingpong128x64(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
int Run_bf16_128x256(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
int Run_fp16_256x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
int Run_fp16_128x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
int RunDGelu_bf16_256x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
int RunDGelu_fp16_256x128(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed);
} // namespace detail

namespace {
using RunFn = int (*)(const Args &, void *, std::size_t, std::size_t *);

/// The translation unit of (operand type, config); nullptr where this build has none (fp16 has the cooperative 256×128
/// and 128×128).
RunFn Find(Element ab, Config config) {
    switch (ab) {
    case Element::kBFloat16:
        switch (config) {
        case Config::kCooperative256x128:
            return &detail::Run_bf16_256x128;
        case Config::kCooperative128x128:
            return &detail::Run_bf16_128x128;
        case Config::kPingpong128x128:
            return &detail::Run_bf16_pingpong128x128;
        case Config::kPingpong128x64:
            return &detail::Run_bf16_pingpong128x64;
        case Config::kCooperative128x256:
            return &detail::Run_bf16_128x256;
        }
        return nullptr;
    case Element::kFloat16:
        switch (config) {
        case Config::kCooperative256x128:
            return &detail::Run_fp16_256x128;
        case Config::kCooperative128x128:
            return &detail::Run_fp16_128x128;
        case Config::kPingpong128x128:
        case Config::kPingpong128x64:
        case Config::kCooperative128x256:
            return nullptr;
        }
        return nullptr;
    case Element::kFloat32:
        return nullptr;
    }
    return nullptr;
}

/// The dgelu kernels (grouped_cutlass_dgelu.cuh): the cooperative 256x128 config only, for bf16 and fp16.
RunFn FindDGelu(Element ab, Config config) {
    if (config != Config::kCooperative256x128) {
        return nullptr;
    }
    switch (ab) {
    case Element::kBFloat16:
        return &detail::RunDGelu_bf16_256x128;
    case Element::kFloat16:
        return &detail::RunDGelu_fp16_256x128;
    case Element::kFloat32:
        return nullptr;
    }
    return nullptr;
}

int Dispatch(const Args &args, void *scratch, std::size_t scratch_bytes, std::size_t *needed) {
    if (args.groups <= 0 || args.groups > 65535) {
        return kCannotImplement;
    }
    if (args.dgelu) {
        const RunFn run = args.layout == Layout::kNN && args.cd == args.ab ? FindDGelu(args.ab, args.config) : nullptr;
        return run == nullptr ? kNotBuilt : run(args, scratch, scratch_bytes, needed);
    }
    const RunFn run = Find(args.ab, args.config);
    return run == nullptr ? kNotBuilt : run(args, scratch, scratch_bytes, needed);
}
} // namespace

bool Built() { return true; }
bool Built(Element ab, Config config) { return Find(ab, config) != nullptr; }
bool BuiltDGelu(Element ab, Config config) { return FindDGelu(ab, config) != nullptr; }
int ScratchBytes(const Args &args, std::size_t *bytes) { return Dispatch(args, nullptr, 0, bytes); }
int Run(const Args &args, void *scratch, std::size_t scratch_bytes) {
    return Dispatch(args, scratch, scratch_bytes, nullptr);
}
#else
bool Built() { return false; }
bool Built(Element, Config) { return false; }
bool BuiltDGelu(Element, Config) { return false; }
int ScratchBytes(const Args &, std::size_t *bytes) {
    *bytes = 0;
    return kNotBuilt;
}
int Run(const Args &, void *, std::size_t) { return kNotBuilt; }
#endif

} // namespace shardline::kernels::cuda::cutlass_grouped
