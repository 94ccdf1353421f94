#pragma once

// Helpers of the CUDA grouped GEMM tests (kernels_grouped_gemm_test.cc, kernels_grouped_tuning_test.cc): group sizes,
// the float64 per-expert reference, a scoped GroupedGemmChoice, the forward problem for GroupedGemmPath, and whether
// the CUTLASS path must run on this machine.

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include <shardline/config.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/grouped_gemm.h>

#include "helpers.h"
#include "reference.h"

namespace shardline::testing::grouped {

/// Whether the CUTLASS path must run here: this build has it and the device is an sm_90. Then a problem it declines is
/// a failure, not a skip (a skip hid a build that compiled the kernels but never linked them in).
inline bool CutlassExpected() {
    int device = 0;
    cudaDeviceProp prop{};
    return SHARDLINE_HAVE_CUTLASS && cudaGetDevice(&device) == cudaSuccess &&
           cudaGetDeviceProperties(&prop, device) == cudaSuccess && prop.major == 9 && prop.minor == 0;
}

inline std::int64_t Total(const std::vector<std::int64_t> &sizes) {
    std::int64_t t = 0;
    for (std::int64_t s : sizes) {
        t += s;
    }
    return t;
}

inline Tensor HostSizes(const std::vector<std::int64_t> &sizes) {
    return Tensor::FromVector(std::vector<double>(sizes.begin(), sizes.end()),
                              Shape{static_cast<std::int64_t>(sizes.size())}, DType::kInt64);
}

struct Refs {
    Values y, dx, dw, db;
};
/// Per expert e: y_e = x_e·W_eᵀ, dx_e = dy_e·W_e, dW_e = dy_eᵀ·x_e (0 for an empty expert), db_e = Σ rows of dy_e.
inline Refs Reference(const Values &x, const Values &w, const Values &dy, const std::vector<std::int64_t> &sizes,
                      std::int64_t out, std::int64_t in) {
    auto rows = [](const Values &v, std::int64_t first, std::int64_t count, std::int64_t cols) {
        return Values(v.begin() + first * cols, v.begin() + (first + count) * cols);
    };
    auto append = [](Values &to, const Values &from) { to.insert(to.end(), from.begin(), from.end()); };
    Refs r;
    std::int64_t first = 0;
    for (std::size_t e = 0; e < sizes.size(); ++e) {
        const std::int64_t m = sizes[e];
        const auto ei = static_cast<std::int64_t>(e);
        const Values we(w.begin() + ei * out * in, w.begin() + (ei + 1) * out * in);
        const Values xe = rows(x, first, m, in);
        const Values dye = rows(dy, first, m, out);
        append(r.y, RefLinearForward(xe, we, nullptr, m, out, in));
        append(r.dx, RefLinearBackwardInput(dye, we, m, out, in));
        append(r.dw, m > 0 ? RefLinearBackwardWeight(dye, xe, m, out, in) : Values(out * in, 0.0));
        append(r.db, m > 0 ? RefColumnSum(dye, m, out) : Values(out, 0.0));
        first += m;
    }
    return r;
}

/// The choice of one test, restored after it.
class ScopedChoice {
public:
    explicit ScopedChoice(kernels::GroupedGemmChoice c) : saved_(kernels::GetGroupedGemmChoice()) {
        kernels::SetGroupedGemmChoice(c);
    }
    ~ScopedChoice() { kernels::SetGroupedGemmChoice(saved_); }
    ScopedChoice(const ScopedChoice &) = delete;
    ScopedChoice &operator=(const ScopedChoice &) = delete;

private:
    kernels::GroupedGemmChoice saved_;
};

/// The forward problem (y = x·Wᵀ per group, W [E, out, in]) for GroupedGemmPath.
inline kernels::GroupedGemmParams ForwardProblem(const Tensor &x, const Tensor &w, const Tensor &y,
                                                 const Tensor &sizes) {
    const std::int64_t out = w.size(1);
    const std::int64_t in = w.size(2);
    kernels::GroupedGemmParams p;
    p.trans_a = true;
    p.m = out;
    p.k = in;
    p.group_count = sizes.numel();
    p.sizes = sizes.data_as<std::int64_t>();
    p.sizes_device = sizes.device();
    p.total = x.size(0);
    p.a = {.data = w.data(), .ld = in, .group_stride = out * in};
    p.a_type = w.dtype();
    p.b = {.data = x.data(), .ld = in, .row_stride = in};
    p.b_type = x.dtype();
    p.c = {.data = y.data(), .ld = out, .row_stride = out};
    p.c_type = y.dtype();
    p.device = y.device();
    return p;
}

/// The config names of GroupedGemmPath and the tuning ("cooperative256x128", ...), per forced tile; " along-n" follows
/// with the raster along n.
inline std::string ConfigName(kernels::GroupedGemmTile tile,
                              kernels::GroupedGemmRaster raster = kernels::GroupedGemmRaster::kAuto) {
    const std::string along = raster == kernels::GroupedGemmRaster::kAlongN ? " along-n" : "";
    switch (tile) {
    case kernels::GroupedGemmTile::k256x128:
        return "cooperative256x128" + along;
    case kernels::GroupedGemmTile::k128x128:
        return "cooperative128x128" + along;
    case kernels::GroupedGemmTile::kPingpong128x128:
        return "pingpong128x128" + along;
    case kernels::GroupedGemmTile::kPingpong128x64:
        return "pingpong128x64" + along;
    case kernels::GroupedGemmTile::k128x256:
        return "cooperative128x256" + along;
    case kernels::GroupedGemmTile::kAuto:
        break;
    }
    return "auto";
}

} // namespace shardline::testing::grouped
