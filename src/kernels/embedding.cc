// Embedding and EmbeddingBag ops: argument checks, the allocating wrapper, dispatch. The kernels live in cpu/ and
// cuda/.

#include <atomic>
#include <cstdint>
#include <string>

#include <fmt/format.h>

#include <shardline/core/env.h>
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

// ---------------------------------------------------------------------------------------------------------------------
// The CUDA bag ops' implementation choice (host logic, no CUDA: testable anywhere).

namespace {

// The cost model's constants, in one place. Estimates for an H100 until measured (bench/embedding prints both paths'
// times next to these): the gather's rate is the measured 1 GiB of L2 reads in 0.21 ms (the char-LM forward); the
// GEMM rates are what cuBLASLt reaches on large bf16/fp16 problems (~60 % of the 989 TFLOP/s dense peak) and on true
// fp32 (no tensor cores); writing the count matrix runs at about the HBM write rate.
constexpr double kGatherBytesPerSecond = 5e12;
constexpr double kHalfGemmFlopsPerSecond = 600e12;
constexpr double kFloat32GemmFlopsPerSecond = 50e12;
constexpr double kCountWriteBytesPerSecond = 3e12;

/// The largest integer n such that every integer 0..n is exact in the dtype (2^(mantissa bits + 1)), 0 when CUDA does
/// not take the dtype.
std::int64_t ExactIntegerLimit(DType dtype) {
    switch (dtype) {
    case DType::kBFloat16:
        return std::int64_t{1} << 8;
    case DType::kFloat16:
        return std::int64_t{1} << 11;
    case DType::kFloat32:
        return std::int64_t{1} << 24;
    case DType::kFloat64:
    case DType::kInt64:
        break;
    }
    return 0;
}

EmbeddingBagImpl InitialEmbeddingBagImpl() {
    const std::string impl = env::GetChoice("SHARDLINE_EMBEDDING_BAG", "auto", {"auto", "gemm", "gather"});
    return impl == "gemm" ? EmbeddingBagImpl::kGemm
                          : (impl == "gather" ? EmbeddingBagImpl::kGather : EmbeddingBagImpl::kAuto);
}

std::atomic<EmbeddingBagImpl>& ImplWord() {
    static std::atomic<EmbeddingBagImpl> word{InitialEmbeddingBagImpl()};
    return word;
}

std::string ProblemString(const EmbeddingBagProblem& p) {
    return fmt::format("ids [T={}, N={}] over a [{}, {}] {} shard", p.bag, p.count, p.rows, p.hidden,
                       DTypeName(p.dtype));
}

} // namespace

std::string_view EmbeddingBagImplName(EmbeddingBagImpl impl) {
    switch (impl) {
    case EmbeddingBagImpl::kAuto:
        return "auto";
    case EmbeddingBagImpl::kGemm:
        return "gemm";
    case EmbeddingBagImpl::kGather:
        return "gather";
    }
    return "unknown";
}

EmbeddingBagImpl GetEmbeddingBagImpl() { return ImplWord().load(std::memory_order_relaxed); }

void SetEmbeddingBagImpl(EmbeddingBagImpl impl) { ImplWord().store(impl, std::memory_order_relaxed); }

std::string CountGemmIneligibility(const EmbeddingBagProblem& problem) {
    const std::int64_t limit = ExactIntegerLimit(problem.dtype);
    if (limit == 0) {
        return fmt::format("the CUDA kernels take float32, float16 or bfloat16, got {}", DTypeName(problem.dtype));
    }
    if (problem.bag > limit) {
        return fmt::format("a count can reach T = {}, above {}, the largest integer up to which {} is exact",
                           problem.bag, limit, DTypeName(problem.dtype));
    }
    if (problem.dtype == DType::kFloat32 && problem.tf32) {
        return "float32 with TF32 allowed (SHARDLINE_ALLOW_TF32) would round the table or the gradient to TF32";
    }
    if (problem.half_accumulate) {
        return "accumulating into a float16/bfloat16 gradient lost up to 30 ulps on the GEMM path (measured on an "
               "H100); accumulate into a float32 main grad instead";
    }
    return {};
}

EmbeddingBagCostEstimate EstimateEmbeddingBagCost(const EmbeddingBagProblem& problem) {
    const auto elem = static_cast<double>(ElementSize(problem.dtype));
    const auto n = static_cast<double>(problem.count);
    const auto h = static_cast<double>(problem.hidden);
    const double flops = 2.0 * n * static_cast<double>(problem.rows) * h;
    const double rate = problem.dtype == DType::kFloat32 ? kFloat32GemmFlopsPerSecond : kHalfGemmFlopsPerSecond;
    return {.gather_s = static_cast<double>(problem.bag) * n * h * elem / kGatherBytesPerSecond,
            .count_gemm_s = flops / rate + n * static_cast<double>(problem.rows) * elem / kCountWriteBytesPerSecond};
}

EmbeddingBagImpl ChooseEmbeddingBagImpl(const EmbeddingBagProblem& problem, EmbeddingBagImpl choice,
                                        std::string_view op) {
    if (choice == EmbeddingBagImpl::kGather || problem.rows == 0) {
        return EmbeddingBagImpl::kGather;
    }
    const std::string why_not = CountGemmIneligibility(problem);
    if (choice == EmbeddingBagImpl::kGemm) {
        SHARDLINE_CHECK(why_not.empty(), op,
                        "SHARDLINE_EMBEDDING_BAG=gemm (or SetEmbeddingBagImpl(kGemm)) needs counts exact in the "
                        "dtype; {}: {} (use auto or gather)",
                        ProblemString(problem), why_not);
        return EmbeddingBagImpl::kGemm;
    }
    if (!why_not.empty()) {
        return EmbeddingBagImpl::kGather;
    }
    const EmbeddingBagCostEstimate cost = EstimateEmbeddingBagCost(problem);
    return cost.count_gemm_s < cost.gather_s ? EmbeddingBagImpl::kGemm : EmbeddingBagImpl::kGather;
}

} // namespace shardline::kernels
