// Whether this build has CUTLASS's GEMV, and the checks every launch makes before reaching the kernel (gemv_cutlass.cu,
// compiled only with SHARDLINE_HAVE_CUTLASS, like the grouped GEMM's units).

#include "gemv_cutlass.h"

#include <cstdint>

#include <shardline/config.h>

namespace shardline::kernels::cuda::cutlass_gemv {

const char* Unsupported(const Args& args) {
    const auto aligned16 = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
    if (args.rows <= 0 || args.cols <= 0 || args.a == nullptr || args.x == nullptr || args.d == nullptr ||
        (args.beta != 0.0f && args.c == nullptr)) {
        return "empty sizes or a missing operand";
    }
    if (args.cols % 8 != 0 || !aligned16(args.a) || !aligned16(args.x)) {
        return "k not a multiple of 8, or A or x not 16-byte aligned";
    }
    if (args.rows * args.cols >= (std::int64_t{1} << 31)) {
        return "m·k ≥ 2^31 (the kernel's row offsets are int)";
    }
    return nullptr;
}

#if SHARDLINE_HAVE_CUTLASS
namespace detail {
cudaError_t RunBFloat16(const Args& args);
cudaError_t RunFloat16(const Args& args);
} // namespace detail

bool Built() { return true; }

cudaError_t Run(const Args& args) {
    if (Unsupported(args) != nullptr) {
        return cudaErrorInvalidValue;
    }
    return args.element == Element::kBFloat16 ? detail::RunBFloat16(args) : detail::RunFloat16(args);
}
#else
bool Built() { return false; }
cudaError_t Run(const Args&) { return cudaErrorNotSupported; }
#endif

} // namespace shardline::kernels::cuda::cutlass_gemv
