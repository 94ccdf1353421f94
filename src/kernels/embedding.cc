// Embedding and EmbeddingBag ops: argument checks, the allocating wrapper, dispatch. The kernels live in cpu/ and
// cuda/.

#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/embedding.h>

#include "checks.h"

namespace shardline::kernels {
namespace {

Shape WithTrailingDim(Shape shape, std::int64_t last) {
    shape.push_back(last);
    return shape;
}

void CheckTable(const Tensor& table, std::string_view op, std::string_view name) {
    CheckTensor(table, op, name);
    CheckDeviceDType(table, op, name);
    SHARDLINE_CHECK_AS(ShapeError, table.rank() == 2, op, "{} must be [V_local, H], got {}", name, table.ToString());
}

void CheckIds(const Tensor& ids, const Tensor& table, std::string_view table_name, std::int64_t vocab_start,
              std::string_view op) {
    CheckTensor(ids, op, "ids");
    CheckIndexDType(ids, op, "ids");
    CheckSameDevice(ids, "ids", table, table_name, op);
    SHARDLINE_CHECK(vocab_start >= 0, op, "vocab_start must be >= 0 (the global id of the shard's first row), got {}",
                    vocab_start);
}

/// The bag ids [T, ...]: rank >= 1, checked before their shape is used. Returns the output shape [..., H].
Shape BagOutputShape(const Tensor& ids, std::int64_t hidden, std::string_view op) {
    SHARDLINE_CHECK_AS(ShapeError, ids.rank() >= 1, op, "ids must be [T, ...] with the bag dim first, got {}",
                       ids.ToString());
    return WithTrailingDim(Shape(ids.shape().begin() + 1, ids.shape().end()), hidden);
}

/// The checks the two weight gradients share (dout's shape aside).
void CheckGradient(const Tensor& ids, const Tensor& dout, const Tensor& dweight, std::int64_t vocab_start,
                   std::string_view op) {
    CheckTensor(dweight, op, "dweight");
    SHARDLINE_CHECK_AS(ShapeError, dweight.rank() == 2, op, "dweight must be [V_local, H], got {}", dweight.ToString());
    CheckIds(ids, dweight, "dweight", vocab_start, op);
    CheckTensor(dout, op, "dout");
    CheckDeviceDType(dout, op, "dout");
    CheckSameDevice(dout, "dout", dweight, "dweight", op);
    // A float32 dweight for half (or float64) dout is a main grad, overwritten or accumulated into.
    SHARDLINE_CHECK_AS(DTypeError, dweight.dtype() == dout.dtype() || dweight.dtype() == DType::kFloat32, op,
                       "dweight must have dout's dtype {} or be a float32 main grad, got {}", DTypeName(dout.dtype()),
                       dweight.ToString());
}

} // namespace

void EmbeddingForward(const EmbeddingForwardArgs& args) {
    constexpr std::string_view kOp = EmbeddingForwardOp::kName;
    CheckTable(args.weight, kOp, "weight");
    CheckIds(args.ids, args.weight, "weight", args.vocab_start, kOp);
    CheckLike(args.out, "out", args.weight, "weight", kOp);
    CheckShape(args.out, WithTrailingDim(args.ids.shape(), args.weight.size(1)), kOp, "out");
    if (args.out.numel() > 0) {
        Dispatch<EmbeddingForwardOp>(args.out.device().type, args);
    }
}

Tensor EmbeddingForward(const Tensor& ids, const Tensor& weight, std::int64_t vocab_start) {
    CheckTable(weight, EmbeddingForwardOp::kName, "weight");
    CheckTensor(ids, EmbeddingForwardOp::kName, "ids");
    Tensor out = Tensor::Empty(WithTrailingDim(ids.shape(), weight.size(1)), weight.dtype(), weight.device());
    EmbeddingForward(EmbeddingForwardArgs{.ids = ids, .weight = weight, .out = out, .vocab_start = vocab_start});
    return out;
}

void EmbeddingBackward(const EmbeddingBackwardArgs& args) {
    constexpr std::string_view kOp = EmbeddingBackwardOp::kName;
    CheckGradient(args.ids, args.dout, args.dweight, args.vocab_start, kOp);
    CheckShape(args.dout, WithTrailingDim(args.ids.shape(), args.dweight.size(1)), kOp, "dout");
    if (args.dweight.numel() == 0) {
        return;
    }
    if (args.dout.numel() == 0) { // no ids: the sum over nothing
        if (!args.accumulate) {
            args.dweight.Fill(0.0);
        }
        return;
    }
    Dispatch<EmbeddingBackwardOp>(args.dweight.device().type, args);
}

void EmbeddingBagForward(const EmbeddingBagForwardArgs& args) {
    constexpr std::string_view kOp = EmbeddingBagForwardOp::kName;
    CheckTable(args.weight, kOp, "weight");
    CheckIds(args.ids, args.weight, "weight", args.vocab_start, kOp);
    CheckLike(args.out, "out", args.weight, "weight", kOp);
    CheckShape(args.out, BagOutputShape(args.ids, args.weight.size(1), kOp), kOp, "out");
    if (args.out.numel() == 0) {
        return;
    }
    if (args.ids.numel() == 0) { // T = 0: every bag is empty, its sum zero
        args.out.Fill(0.0);
        return;
    }
    Dispatch<EmbeddingBagForwardOp>(args.out.device().type, args);
}

Tensor EmbeddingBagForward(const Tensor& ids, const Tensor& weight, std::int64_t vocab_start) {
    constexpr std::string_view kOp = EmbeddingBagForwardOp::kName;
    CheckTable(weight, kOp, "weight");
    CheckTensor(ids, kOp, "ids");
    Tensor out = Tensor::Empty(BagOutputShape(ids, weight.size(1), kOp), weight.dtype(), weight.device());
    EmbeddingBagForward(EmbeddingBagForwardArgs{.ids = ids, .weight = weight, .out = out, .vocab_start = vocab_start});
    return out;
}

void EmbeddingBagBackward(const EmbeddingBagBackwardArgs& args) {
    constexpr std::string_view kOp = EmbeddingBagBackwardOp::kName;
    CheckGradient(args.ids, args.dout, args.dweight, args.vocab_start, kOp);
    CheckShape(args.dout, BagOutputShape(args.ids, args.dweight.size(1), kOp), kOp, "dout");
    if (args.dweight.numel() == 0) {
        return;
    }
    if (args.ids.numel() == 0) { // T = 0 or N = 0: the sum over no positions
        if (!args.accumulate) {
            args.dweight.Fill(0.0);
        }
        return;
    }
    Dispatch<EmbeddingBagBackwardOp>(args.dweight.device().type, args);
}

} // namespace shardline::kernels
