// Embedding ops: argument checks, the allocating wrapper, dispatch. The kernels live in cpu/ and cuda/.

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
    CheckTensor(args.dweight, kOp, "dweight");
    SHARDLINE_CHECK_AS(ShapeError, args.dweight.rank() == 2, kOp, "dweight must be [V_local, H], got {}",
                       args.dweight.ToString());
    CheckIds(args.ids, args.dweight, "dweight", args.vocab_start, kOp);
    CheckTensor(args.dout, kOp, "dout");
    CheckDeviceDType(args.dout, kOp, "dout");
    CheckSameDevice(args.dout, "dout", args.dweight, "dweight", kOp);
    SHARDLINE_CHECK_AS(DTypeError,
                       args.dweight.dtype() == args.dout.dtype() ||
                           (args.accumulate && args.dweight.dtype() == DType::kFloat32),
                       kOp, "dweight must have dout's dtype {} (or be a float32 main grad with accumulate), got {}",
                       DTypeName(args.dout.dtype()), args.dweight.ToString());
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

} // namespace shardline::kernels
