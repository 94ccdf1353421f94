// Errors of the functional column/row-parallel Linear: every rank raises the same shardline::Error, naming the op, the
// values and the expectation, before any collective, and the group stays usable afterwards.
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 2/4; SHARDLINE_FUNCTIONAL_TEST_CUDA) build this file, with
// the shared problem, meshes and RunColumn / RunRow of functional_test_util.h.

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <shardline/core/error.h>
#include <shardline/core/tensor.h>
#include <shardline/functional/parallel_linear.h>

#include "functional_test_util.h"

namespace shardline {
namespace {

using namespace functional_test;

// ---- errors: every rank raises the same Error before any collective; the group stays usable
// ----------------------------

/// Runs `call`, which must throw shardline::Error whose message contains every one of `parts`, on every rank, with no
/// collective issued; then a valid call on the same group still works (nothing is left waiting).
template <class F> void ExpectErrorBeforeAnyCollective(const MeshAndDim &m, F &&call, std::vector<std::string> parts) {
    ResetCounts(m);
    try {
        call();
        ADD_FAILURE() << "no error raised; expected one containing '" << parts.front() << "'";
    } catch (const Error &e) {
        for (const std::string &part : parts) {
            EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
                << "message: " << e.what() << "\nexpected to contain: " << part;
        }
    }
    ExpectCalls(m, {}, "after the error");
    RunColumn({.problem = Fp32Problems()[0]});
}

struct Buffers {
    Tensor x, w, b, y;
    /// Column forward arguments viewing every buffer (a case swaps in the one it gets wrong).
    functional::ColumnParallelLinearForwardArgs ColumnArgs() const {
        return {.x = ViewOf(x), .weight = ViewOf(w), .bias = ViewOf(b), .y = ViewOf(y)};
    }
};

/// ColumnParallelLinearForward(options, args) on the tp group raises before any collective, naming the op and `parts`.
void ExpectColumnForwardError(const MeshAndDim &m, const ColumnParallelLinearOptions &options,
                              const functional::ColumnParallelLinearForwardArgs &args, std::vector<std::string> parts) {
    parts.insert(parts.begin(), "ColumnParallelLinearForward");
    ExpectErrorBeforeAnyCollective(m, [&] { ColumnParallelLinearForward(options, args, m.group()); }, std::move(parts));
}

Buffers ColumnBuffers(std::int64_t tp, DType dtype = DType::kFloat32) {
    return {Tensor::Zeros({8, kIn}, dtype, TestDevice()), Tensor::Zeros({kOut / tp, kIn}, dtype, TestDevice()),
            Tensor::Zeros({kOut / tp}, dtype, TestDevice()), Tensor::Zeros({8, kOut / tp}, dtype, TestDevice())};
}

// Uneven sizes are accepted (torch.chunk); a size that leaves a rank without features is not: tp - 1 features (tp 2),
// or tp + 1 for tp >= 3 (2 per rank runs out before the last: tp 4 gives 2, 2, 1, 0).
TEST(FunctionalLinearErrorTest, SizesLeavingARankWithoutFeaturesRaiseNamingSizeAndTp) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    if (tp == 1) {
        GTEST_SKIP() << "tp = 1 gives every size to one rank";
    }
    const Tensor x = Tensor::Zeros({8, kIn}, DType::kFloat32, TestDevice());
    const Tensor w = Tensor::Zeros({1, kIn}, DType::kFloat32, TestDevice());
    const Tensor y = Tensor::Zeros({8, 1}, DType::kFloat32, TestDevice());
    const std::int64_t bad_out = tp >= 3 ? tp + 1 : tp - 1;
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            ColumnParallelLinearForward({.in_features = kIn, .out_features = bad_out, .bias = false},
                                        {.x = ViewOf(x), .weight = ViewOf(w), .y = ViewOf(y)}, m.group());
        },
        {"ColumnParallelLinearForward", fmt::format("out_features ({}) over tp ({})", bad_out, tp),
         "every rank needs at least one"});
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            RowParallelLinearForward({.in_features = bad_out, .out_features = kOut, .input_is_parallel = true},
                                     {.x = ViewOf(x), .weight = ViewOf(w), .y = ViewOf(y)}, m.group());
        },
        {"RowParallelLinearForward", fmt::format("in_features ({}) over tp ({})", bad_out, tp),
         "every rank needs at least one"});
    // A sequence that does not split into tp equal parts under sequence parallelism.
    const std::int64_t s = 2 * tp + 1;
    const Tensor xr = Tensor::Zeros({s, kIn / tp}, DType::kFloat32, TestDevice());
    const Tensor wr = Tensor::Zeros({kOut, kIn / tp}, DType::kFloat32, TestDevice());
    const Tensor yr = Tensor::Zeros({2, kOut}, DType::kFloat32, TestDevice());
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            RowParallelLinearForward({.in_features = kIn,
                                      .out_features = kOut,
                                      .bias = false,
                                      .input_is_parallel = true,
                                      .sequence_parallel = true},
                                     {.x = ViewOf(xr), .weight = ViewOf(wr), .y = ViewOf(yr)}, m.group());
        },
        {"RowParallelLinearForward",
         fmt::format("the sequence length x.shape[0] ({}) must be divisible by tp ({})", s, tp)});
}

TEST(FunctionalLinearErrorTest, ShapeAndDTypeMismatchesRaiseNamingTheTensorAndTheExpectation) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    Buffers t = ColumnBuffers(tp);
    const ColumnParallelLinearOptions options{.in_features = kIn, .out_features = kOut};
    // The full weight where this rank's rows are expected.
    const Tensor w_full = Tensor::Zeros({kOut + tp, kIn}, DType::kFloat32, TestDevice());
    functional::ColumnParallelLinearForwardArgs args = t.ColumnArgs();
    args.weight = ViewOf(w_full);
    ExpectColumnForwardError(m, options, args,
                             {"weight must be [out_features/tp, in_features]",
                              fmt::format("= [{}, {}]", kOut / tp, kIn), fmt::format("got [{}, {}]", kOut + tp, kIn)});
    // A weight of another dtype than x. On the CPU the other dtype is float64, on CUDA bfloat16.
    const DType other = TestDevice().is_cpu() ? DType::kFloat64 : DType::kBFloat16;
    const Tensor w_other = Tensor::Zeros({kOut / tp, kIn}, other, TestDevice());
    args.weight = ViewOf(w_other);
    ExpectColumnForwardError(m, options, args,
                             {fmt::format("weight must have x's dtype float32, got {}", DTypeName(other))});
    // A float32 main grad is for half parameters: float64 ones cannot have one (CPU only: float64 is not a CUDA dtype).
    if (TestDevice().is_cpu()) {
        const Tensor dy = Tensor::Zeros({8, kOut / tp}, DType::kFloat64, TestDevice());
        const Tensor x64 = Tensor::Zeros({8, kIn}, DType::kFloat64, TestDevice());
        const Tensor dw32 = Tensor::Zeros({kOut / tp, kIn}, DType::kFloat32, TestDevice());
        ExpectErrorBeforeAnyCollective(m,
                                       [&] {
                                           ColumnParallelLinearBackward(
                                               options, {.dy = ViewOf(dy), .x = ViewOf(x64), .dweight = ViewOf(dw32)},
                                               m.group());
                                       },
                                       {"ColumnParallelLinearBackward", "dweight must have the compute dtype float64",
                                        "got float32 (GradMode::kOverwrite)"});
    }
    // A half type on a CPU mesh (MPI and the CPU kernels take float32 and float64).
    if (TestDevice().is_cpu()) {
        functional::ColumnParallelLinearForwardArgs half_x = t.ColumnArgs();
        half_x.x.dtype = DType::kBFloat16;
        ExpectColumnForwardError(m, options, half_x, {"a CPU (MPI) mesh takes float32 or float64, got x bfloat16"});
    }
}

TEST(FunctionalLinearErrorTest, NullRequiredPointersRaiseNamingTheTensor) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    Buffers t = ColumnBuffers(tp);
    const ColumnParallelLinearOptions options{.in_features = kIn, .out_features = kOut};
    functional::ColumnParallelLinearForwardArgs null_x = t.ColumnArgs();
    null_x.x.data = nullptr;
    ExpectColumnForwardError(m, options, null_x,
                             {"x is required, got a null data pointer", fmt::format("[8, {}]", kIn)});
    functional::ColumnParallelLinearForwardArgs no_bias = t.ColumnArgs();
    no_bias.bias = {};
    ExpectColumnForwardError(m, options, no_bias, {"bias is required (options.bias is set)"});
    // dx requested without the weight it needs.
    ExpectErrorBeforeAnyCollective(
        m, [&] { ColumnParallelLinearBackward(options, {.dy = ViewOf(t.y), .dx = ViewOf(t.x)}, m.group()); },
        {"ColumnParallelLinearBackward", "weight is required for dx"});
    // dweight without x (or x_total).
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            RowParallelLinearBackward(
                {.in_features = kIn, .out_features = kOut, .input_is_parallel = true},
                {.dy = ViewOf(Tensor::Zeros({8, kOut}, DType::kFloat32, TestDevice())),
                 .dweight = ViewOf(Tensor::Zeros({kOut, kIn / tp}, DType::kFloat32, TestDevice()))},
                m.group());
        },
        {"RowParallelLinearBackward", "x is required for dweight"});
}

TEST(FunctionalLinearErrorTest, AMeshDimOutsideTheMeshRaisesNamingIt) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    Buffers t = ColumnBuffers(m.tp());
    // -1 is TensorParallelGroup::kNoTensorParallel (a group of one rank); other negative dims are errors.
    for (int bad : {1, -2}) {
        ExpectErrorBeforeAnyCollective(
            m,
            [&] {
                ColumnParallelLinearForward({.in_features = kIn, .out_features = kOut}, t.ColumnArgs(),
                                            {.mesh = &m.mesh, .tp_dim = bad});
            },
            {"ColumnParallelLinearForward",
             fmt::format("tp_dim ({}) must name a dim of the mesh [{}]", bad, World().size())});
    }
}

TEST(FunctionalLinearErrorTest, FlagCombinationsMegatronRejectsRaise) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    Buffers t = ColumnBuffers(m.tp());
    ExpectColumnForwardError(
        m, {.in_features = kIn, .out_features = kOut, .gather_output = true, .sequence_parallel = true}, t.ColumnArgs(),
        {"gather_output and sequence_parallel exclude each other"});
    ExpectErrorBeforeAnyCollective(m,
                                   [&] {
                                       RowParallelLinearForward(
                                           {.in_features = kIn, .out_features = kOut, .sequence_parallel = true},
                                           {.x = ViewOf(t.x), .weight = ViewOf(t.w), .y = ViewOf(t.y)}, m.group());
                                   },
                                   {"RowParallelLinearForward", "sequence_parallel needs input_is_parallel"});
    ExpectColumnForwardError(m, {.in_features = kIn, .out_features = kOut, .bias = false}, t.ColumnArgs(),
                             {"bias is given but options.bias is false"});
}

TEST(FunctionalLinearErrorTest, GeluActivationArgumentsAreChecked) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    constexpr auto kGelu = kernels::LinearActivation::kGeluTanh;
    const DType f32 = DType::kFloat32;
    Buffers t = ColumnBuffers(tp);
    const ColumnParallelLinearOptions column{.in_features = kIn, .out_features = kOut};
    const Tensor pre = Tensor::Zeros({8, kOut / tp}, f32, TestDevice());
    const Tensor wrong_pre = Tensor::Zeros({8, kOut / tp + 1}, f32, TestDevice());

    // Column forward: the activation needs the local output and a pre-activation buffer of its shape.
    functional::ColumnParallelLinearForwardArgs args = t.ColumnArgs();
    args.activation = kGelu;
    ExpectColumnForwardError(m, column, args, {"pre_activation is required with activation gelu_tanh"});
    args.pre_activation = ViewOf(wrong_pre);
    ExpectColumnForwardError(m, column, args,
                             {"pre_activation must be [s, ..., out_features/tp]", fmt::format("= [8, {}]", kOut / tp),
                              fmt::format("got [8, {}]", kOut / tp + 1)});
    const Tensor y_full = Tensor::Zeros({8, kOut}, f32, TestDevice());
    functional::ColumnParallelLinearForwardArgs gathered = t.ColumnArgs();
    gathered.y = ViewOf(y_full);
    gathered.activation = kGelu;
    gathered.pre_activation = ViewOf(pre);
    ExpectColumnForwardError(m, {.in_features = kIn, .out_features = kOut, .gather_output = true}, gathered,
                             {"activation gelu_tanh applies to this rank's output features", "not with gather_output"});
    functional::ColumnParallelLinearForwardArgs no_activation = t.ColumnArgs();
    no_activation.pre_activation = ViewOf(pre);
    ExpectColumnForwardError(m, column, no_activation, {"pre_activation is given but activation is none"});

    // Row backward: the activation's gradient needs a parallel input, the pre-activation for dx, and dx for the
    // column layer's bias grad.
    const RowParallelLinearOptions row{.in_features = kIn, .out_features = kOut, .input_is_parallel = true};
    const Tensor dy = Tensor::Zeros({8, kOut}, f32, TestDevice());
    const Tensor w = Tensor::Zeros({kOut, kIn / tp}, f32, TestDevice());
    const Tensor x_pre = Tensor::Zeros({8, kIn / tp}, f32, TestDevice());
    Tensor dx = Tensor::Zeros({8, kIn / tp}, f32, TestDevice());
    Tensor pre_db = Tensor::Zeros({kIn / tp}, f32, TestDevice());
    Tensor wrong_pre_db = Tensor::Zeros({kIn / tp + 1}, f32, TestDevice());
    auto row_backward = [&](const RowParallelLinearOptions &options, functional::RowParallelLinearBackwardArgs a,
                            std::vector<std::string> parts) {
        parts.insert(parts.begin(), "RowParallelLinearBackward");
        ExpectErrorBeforeAnyCollective(m, [&] { RowParallelLinearBackward(options, a, m.group()); }, std::move(parts));
    };
    row_backward(row, {.dy = ViewOf(dy), .weight = ViewOf(w), .dx = ViewOf(dx), .input_activation = kGelu},
                 {"pre_activation is required with input_activation gelu_tanh and dx"});
    row_backward(row,
                 {.dy = ViewOf(dy),
                  .weight = ViewOf(w),
                  .input_activation = kGelu,
                  .pre_activation = ViewOf(x_pre),
                  .pre_activation_dbias = ViewOf(pre_db)},
                 {"pre_activation_dbias is Σ_rows dx: dx must be given too"});
    row_backward(row, {.dy = ViewOf(dy), .weight = ViewOf(w), .dx = ViewOf(dx), .pre_activation_dbias = ViewOf(pre_db)},
                 {"pre_activation_dbias (the column layer's bias grad) needs input_activation = gelu_tanh"});
    row_backward(row,
                 {.dy = ViewOf(dy),
                  .weight = ViewOf(w),
                  .dx = ViewOf(dx),
                  .input_activation = kGelu,
                  .pre_activation = ViewOf(x_pre),
                  .pre_activation_dbias = ViewOf(wrong_pre_db)},
                 {"pre_activation_dbias must be [in_features/tp]", fmt::format("= [{}]", kIn / tp),
                  fmt::format("got [{}]", kIn / tp + 1)});
    // A replicated input: this rank's slice of it is not a GELU's output.
    const Tensor dx_full = Tensor::Zeros({8, kIn}, f32, TestDevice());
    const Tensor pre_full = Tensor::Zeros({8, kIn}, f32, TestDevice());
    row_backward({.in_features = kIn, .out_features = kOut},
                 {.dy = ViewOf(dy),
                  .weight = ViewOf(w),
                  .dx = ViewOf(dx_full),
                  .input_activation = kGelu,
                  .pre_activation = ViewOf(pre_full)},
                 {"input_activation needs input_is_parallel"});
}

// ---- comm_chunks
// ------------------------------------------------------------------------------------------------------

// options.comm_chunks (the chunked pipelines): C < 0, C > the rows the pipelines split (x's leading dims, over tp under
// sequence parallelism), and C > 1 on a grouped layer raise on every rank before any collective.
TEST(FunctionalLinearErrorTest, BadCommChunksRaiseNamingTheCountAndTheRows) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    const MeshAndDim m = GetMesh(MeshKind::kTp);
    const std::int64_t tp = m.tp();
    const Problem p{.lead = {12}, .data = Data::kInteger, .seed = 32};
    const Dense d = MakeDense(p, m);
    const Tensor x = Shard(d.x, 0, m); // sequence parallel: 12 / tp rows per rank
    const Tensor w = Shard(d.w, 0, m);
    const Tensor b = Shard(d.b, 0, m);
    const Tensor y = Poisoned({12, kOut / tp}, p.dtype);
    const auto column_forward = [&](int chunks, bool sp) {
        ColumnParallelLinearForward(
            {.in_features = kIn, .out_features = kOut, .sequence_parallel = sp, .comm_chunks = chunks},
            {.x = ViewOf(sp ? x : d.x), .weight = ViewOf(w), .bias = ViewOf(b), .y = ViewOf(y)}, m.group());
    };
    ExpectErrorBeforeAnyCollective(m, [&] { column_forward(-1, true); },
                                   {"ColumnParallelLinearForward", "comm_chunks must be >= 0", "-1"});
    const std::int64_t rows = 12 / tp;
    ExpectErrorBeforeAnyCollective(m, [&] { column_forward(static_cast<int>(rows) + 1, true); },
                                   {"ColumnParallelLinearForward", fmt::format("comm_chunks ({}) must be <=", rows + 1),
                                    fmt::format("{} (x's leading dims flattened, over tp", rows)});
    ExpectErrorBeforeAnyCollective(m, [&] { column_forward(13, false); },
                                   {"comm_chunks (13) must be <=", "12 (x's leading dims flattened)"});

    // The row backward checks its own rows (dy's whole sequence over tp).
    const Tensor dy = Shard(d.dy, 0, m);
    const Tensor xr = Shard(d.x, 1, m);
    const Tensor wr = Shard(d.w, 1, m);
    Tensor dx = Poisoned(xr.shape(), p.dtype);
    ExpectErrorBeforeAnyCollective(m,
                                   [&] {
                                       RowParallelLinearBackward(
                                           {.in_features = kIn,
                                            .out_features = kOut,
                                            .input_is_parallel = true,
                                            .sequence_parallel = true,
                                            .comm_chunks = static_cast<int>(rows) + 1},
                                           {.dy = ViewOf(dy), .weight = ViewOf(wr), .dx = ViewOf(dx)}, m.group());
                                   },
                                   {"RowParallelLinearBackward", fmt::format("comm_chunks ({}) must be <=", rows + 1)});

    // A grouped layer's rows are grouped by expert: no pipeline.
    const Tensor xg = Tensor::Zeros({4, kIn}, p.dtype, TestDevice());
    const Tensor wg = Tensor::Zeros({2, kOut / tp, kIn}, p.dtype, TestDevice());
    const Tensor yg = Tensor::Zeros({4, kOut / tp}, p.dtype, TestDevice());
    const Tensor sizes = Tensor::FromVector({2, 2}, {2}, DType::kInt64);
    ExpectErrorBeforeAnyCollective(
        m,
        [&] {
            ColumnParallelLinearForward(
                {.in_features = kIn, .out_features = kOut, .bias = false, .num_experts = 2, .comm_chunks = 2},
                {.x = ViewOf(xg), .weight = ViewOf(wg), .y = ViewOf(yg), .group_sizes = ViewOf(sizes)}, m.group());
        },
        {"ColumnParallelLinearForward", "comm_chunks (2) pipelines a Linear's rows", "num_experts 2"});
}

} // namespace
} // namespace shardline
