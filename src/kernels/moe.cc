// Mixture-of-experts routing and permutation ops: argument checks, then dispatch. The kernels live in cpu/moe.cc and
// cuda/moe_kernels.cu.

#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/moe.h>

#include "checks.h"

namespace shardline::kernels {
namespace {

/// CUDA's router kernels keep a row's scores in registers: one warp per token.
constexpr int kCudaMaxExperts = 256;
constexpr int kCudaMaxTopk = 8;
/// CUDA's gather and combine hold a token's slots in the lanes of its warp.
constexpr int kCudaMaxRowTopk = 32;

void CheckCudaRowTopk(const Tensor& row_map, std::string_view op) {
    SHARDLINE_CHECK_AS(ShapeError, row_map.device().is_cpu() || row_map.size(1) <= kCudaMaxRowTopk, op,
                       "the CUDA gather and combine take topk <= {} (row_map's columns), got {}", kCudaMaxRowTopk,
                       row_map.ToString());
}

void CheckRouterConfig(const Tensor& logits, const MoERouterConfig& c, std::string_view op) {
    CheckTensor(logits, op, "logits");
    SHARDLINE_CHECK_AS(ShapeError, logits.rank() == 2, op, "logits must be [tokens, experts], got {}",
                       logits.ToString());
    if (logits.device().is_cpu()) {
        SHARDLINE_CHECK_AS(DTypeError, logits.dtype() == DType::kFloat32 || logits.dtype() == DType::kFloat64, op,
                           "logits must be float32 (float64 on the CPU for references), got {}", logits.ToString());
    } else {
        SHARDLINE_CHECK_AS(DTypeError, logits.dtype() == DType::kFloat32, op, "logits must be float32, got {}",
                           logits.ToString());
    }
    SHARDLINE_CHECK_AS(ShapeError, c.num_experts > 0 && logits.size(1) == c.num_experts, op,
                       "logits must have num_experts ({}) columns, got {}", c.num_experts, logits.ToString());
    SHARDLINE_CHECK_AS(ShapeError, c.topk >= 1 && c.topk <= c.num_experts, op,
                       "topk ({}) must be in [1, num_experts = {}]", c.topk, c.num_experts);
    if (!logits.device().is_cpu()) {
        SHARDLINE_CHECK_AS(ShapeError, c.num_experts <= kCudaMaxExperts && c.topk <= kCudaMaxTopk, op,
                           "the CUDA router takes num_experts <= {} and topk <= {}, got {} and {}", kCudaMaxExperts,
                           kCudaMaxTopk, c.num_experts, c.topk);
    }
    SHARDLINE_CHECK(c.aux_loss_coeff >= 0.0 && c.z_loss_coeff >= 0.0, op,
                    "aux_loss_coeff ({}) and z_loss_coeff ({}) must be >= 0", c.aux_loss_coeff, c.z_loss_coeff);
}

/// An int64 [T, topk] tensor on `device`.
void CheckSlots(const Tensor& t, std::string_view name, std::int64_t tokens, std::int64_t topk, Device device,
                std::string_view op) {
    CheckTensor(t, op, name);
    CheckIndexDType(t, op, name);
    SHARDLINE_CHECK_AS(DeviceError, t.device() == device, op, "{} must be on {}, got {}", name, ToString(device),
                       t.ToString());
    CheckShape(t, Shape{tokens, topk}, op, name);
}

/// A scalar gradient: [] or [1], the logits' dtype and device.
void CheckScalarGrad(const Tensor* g, const Tensor& logits, std::string_view name, std::string_view op) {
    if (g == nullptr) {
        return;
    }
    CheckLike(*g, name, logits, "logits", op);
    SHARDLINE_CHECK_AS(ShapeError, g->numel() == 1 && g->rank() <= 1, op, "{} must be a scalar ([] or [1]), got {}",
                       name, g->ToString());
}

/// Per-copy weights: [T, topk], float32 or `like`'s dtype, on like's device.
void CheckWeights(const Tensor& w, std::string_view name, const Tensor& row_map, const Tensor& like,
                  std::string_view op) {
    CheckTensor(w, op, name);
    CheckSameDevice(w, name, like, "the rows", op);
    SHARDLINE_CHECK_AS(DTypeError, w.dtype() == DType::kFloat32 || w.dtype() == like.dtype(), op,
                       "{} must be float32 or the rows' dtype {}, got {}", name, DTypeName(like.dtype()), w.ToString());
    CheckShape(w, row_map.shape(), op, name);
}

/// A [rows, H] float matrix of a kernel dtype of its device.
void CheckMatrix(const Tensor& t, std::string_view name, std::string_view op) {
    CheckTensor(t, op, name);
    CheckDeviceDType(t, op, name);
    SHARDLINE_CHECK_AS(ShapeError, t.rank() == 2, op, "{} must be [rows, hidden], got {}", name, t.ToString());
}

/// row_map [T, topk] int64 on `device`; on the host its entries are checked to lie in [-1, rows).
void CheckRowMap(const Tensor& row_map, std::int64_t tokens, std::int64_t rows, Device device, std::string_view op) {
    CheckTensor(row_map, op, "row_map");
    CheckIndexDType(row_map, op, "row_map");
    SHARDLINE_CHECK_AS(DeviceError, row_map.device() == device, op, "row_map must be on {}, got {}", ToString(device),
                       row_map.ToString());
    SHARDLINE_CHECK_AS(ShapeError, row_map.rank() == 2 && row_map.size(0) == tokens, op,
                       "row_map must be [tokens = {}, topk], got {}", tokens, row_map.ToString());
    if (row_map.device().is_cpu()) {
        const auto* m = row_map.data_as<std::int64_t>();
        for (std::int64_t i = 0; i < row_map.numel(); ++i) {
            SHARDLINE_CHECK_AS(ShapeError, m[i] >= -1 && m[i] < rows, op,
                               "row_map entries must be in [-1, {}) (rows of the permuted tokens), got {} at {}", rows,
                               m[i], i);
        }
    }
}

} // namespace

void MoERouterForward(const MoERouterForwardArgs& args) {
    constexpr std::string_view kOp = MoERouterForwardOp::kName;
    CheckRouterConfig(args.logits, args.config, kOp);
    const std::int64_t tokens = args.logits.size(0);
    CheckLike(args.weights, "weights", args.logits, "logits", kOp);
    CheckShape(args.weights, Shape{tokens, args.config.topk}, kOp, "weights");
    CheckSlots(args.indices, "indices", tokens, args.config.topk, args.logits.device(), kOp);
    CheckTensor(args.tokens_per_expert, kOp, "tokens_per_expert");
    CheckIndexDType(args.tokens_per_expert, kOp, "tokens_per_expert");
    CheckSameDevice(args.tokens_per_expert, "tokens_per_expert", args.logits, "logits", kOp);
    CheckShape(args.tokens_per_expert, Shape{args.config.num_experts}, kOp, "tokens_per_expert");
    for (const Tensor* loss : {args.aux_loss, args.z_loss}) {
        if (loss != nullptr) {
            CheckLike(*loss, "the loss", args.logits, "logits", kOp);
            SHARDLINE_CHECK_AS(ShapeError, loss->numel() == 1 && loss->rank() <= 1, kOp,
                               "aux_loss / z_loss must be scalars ([] or [1]), got {}", loss->ToString());
        }
    }
    Dispatch<MoERouterForwardOp>(args.logits.device().type, args);
}

void MoERouterBackward(const MoERouterBackwardArgs& args) {
    constexpr std::string_view kOp = MoERouterBackwardOp::kName;
    CheckRouterConfig(args.logits, args.config, kOp);
    const std::int64_t tokens = args.logits.size(0);
    CheckSlots(args.indices, "indices", tokens, args.config.topk, args.logits.device(), kOp);
    CheckTensor(args.tokens_per_expert, kOp, "tokens_per_expert");
    CheckIndexDType(args.tokens_per_expert, kOp, "tokens_per_expert");
    CheckSameDevice(args.tokens_per_expert, "tokens_per_expert", args.logits, "logits", kOp);
    CheckShape(args.tokens_per_expert, Shape{args.config.num_experts}, kOp, "tokens_per_expert");
    if (args.dweights != nullptr) {
        CheckLike(*args.dweights, "dweights", args.logits, "logits", kOp);
        CheckShape(*args.dweights, Shape{tokens, args.config.topk}, kOp, "dweights");
    }
    CheckScalarGrad(args.daux_loss, args.logits, "daux_loss", kOp);
    CheckScalarGrad(args.dz_loss, args.logits, "dz_loss", kOp);
    CheckLike(args.dlogits, "dlogits", args.logits, "logits", kOp);
    CheckShape(args.dlogits, args.logits.shape(), kOp, "dlogits");
    if (tokens == 0) {
        return;
    }
    Dispatch<MoERouterBackwardOp>(args.logits.device().type, args);
}

void MoEPermuteMap(const MoEPermuteMapArgs& args) {
    constexpr std::string_view kOp = MoEPermuteMapOp::kName;
    CheckTensor(args.indices, kOp, "indices");
    CheckIndexDType(args.indices, kOp, "indices");
    SHARDLINE_CHECK_AS(ShapeError, args.indices.rank() == 2 && args.indices.size(1) >= 1, kOp,
                       "indices must be [tokens, topk] with topk >= 1, got {}", args.indices.ToString());
    SHARDLINE_CHECK_AS(ShapeError, args.num_experts > 0, kOp, "num_experts must be > 0, got {}", args.num_experts);
    const Device device = args.indices.device();
    CheckSlots(args.row_map, "row_map", args.indices.size(0), args.indices.size(1), device, kOp);
    CheckTensor(args.group_sizes, kOp, "group_sizes");
    CheckIndexDType(args.group_sizes, kOp, "group_sizes");
    SHARDLINE_CHECK_AS(DeviceError, args.group_sizes.device() == device, kOp, "group_sizes must be on {}, got {}",
                       ToString(device), args.group_sizes.ToString());
    CheckShape(args.group_sizes, Shape{args.num_experts}, kOp, "group_sizes");
    if (device.is_cpu()) {
        const auto* ids = args.indices.data_as<std::int64_t>();
        for (std::int64_t i = 0; i < args.indices.numel(); ++i) {
            SHARDLINE_CHECK_AS(ShapeError, ids[i] >= 0 && ids[i] < args.num_experts, kOp,
                               "indices must be expert ids in [0, num_experts = {}), got {} at (token {}, slot {})",
                               args.num_experts, ids[i], i / args.indices.size(1), i % args.indices.size(1));
        }
    }
    Dispatch<MoEPermuteMapOp>(device.type, args);
}

void MoEPermuteRows(const MoEPermuteRowsArgs& args) {
    constexpr std::string_view kOp = MoEPermuteRowsOp::kName;
    CheckMatrix(args.x, "x", kOp);
    CheckLike(args.out, "out", args.x, "x", kOp);
    SHARDLINE_CHECK_AS(ShapeError, args.out.rank() == 2 && args.out.size(1) == args.x.size(1), kOp,
                       "out must be [rows, {}] (x's hidden), got {}", args.x.size(1), args.out.ToString());
    CheckRowMap(args.row_map, args.x.size(0), args.out.size(0), args.x.device(), kOp);
    CheckCudaRowTopk(args.row_map, kOp);
    if (args.weights != nullptr) {
        CheckWeights(*args.weights, "weights", args.row_map, args.x, kOp);
    }
    if (args.x.numel() == 0 || args.row_map.numel() == 0 || args.out.numel() == 0) {
        return;
    }
    Dispatch<MoEPermuteRowsOp>(args.x.device().type, args);
}

void MoEUnpermuteRows(const MoEUnpermuteRowsArgs& args) {
    constexpr std::string_view kOp = MoEUnpermuteRowsOp::kName;
    CheckMatrix(args.tokens, "tokens", kOp);
    CheckLike(args.y, "y", args.tokens, "tokens", kOp);
    SHARDLINE_CHECK_AS(ShapeError, args.y.rank() == 2 && args.y.size(1) == args.tokens.size(1), kOp,
                       "y must be [tokens, {}] (the permuted tokens' hidden), got {}", args.tokens.size(1),
                       args.y.ToString());
    CheckRowMap(args.row_map, args.y.size(0), args.tokens.size(0), args.tokens.device(), kOp);
    CheckCudaRowTopk(args.row_map, kOp);
    if (args.weights != nullptr) {
        CheckWeights(*args.weights, "weights", args.row_map, args.tokens, kOp);
    }
    if (args.y.numel() == 0) {
        return;
    }
    if (args.row_map.numel() == 0 || args.tokens.numel() == 0) { // no copies: every sum is empty
        args.y.Fill(0.0);
        return;
    }
    Dispatch<MoEUnpermuteRowsOp>(args.y.device().type, args);
}

void MoEUnpermuteWeightsGrad(const MoEUnpermuteWeightsGradArgs& args) {
    constexpr std::string_view kOp = MoEUnpermuteWeightsGradOp::kName;
    CheckMatrix(args.dy, "dy", kOp);
    CheckLike(args.tokens, "tokens", args.dy, "dy", kOp);
    SHARDLINE_CHECK_AS(ShapeError, args.tokens.rank() == 2 && args.tokens.size(1) == args.dy.size(1), kOp,
                       "tokens must be [rows, {}] (dy's hidden), got {}", args.dy.size(1), args.tokens.ToString());
    CheckRowMap(args.row_map, args.dy.size(0), args.tokens.size(0), args.dy.device(), kOp);
    CheckWeights(args.dweights, "dweights", args.row_map, args.dy, kOp);
    if (args.dweights.numel() == 0) {
        return;
    }
    if (args.dy.numel() == 0 || args.tokens.numel() == 0) { // hidden 0 or no rows: every dot product is empty
        args.dweights.Fill(0.0);
        return;
    }
    Dispatch<MoEUnpermuteWeightsGradOp>(args.dy.device().type, args);
}

} // namespace shardline::kernels
