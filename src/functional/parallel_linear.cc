// Column- and row-parallel Linear on caller-owned memory (TensorView and the group: views.cc). Each entry point
// validates everything (before any collective), finds its configuration's rule answer and plans (linear_plan.h), wraps
// the caller's memory in tensors (Tensor::FromBlob) and runs one shared sequence: move the inputs as the rule's input
// plans say, run the local kernels, move the outputs as the rule's output plans say (DistTensor::Redistribute), add a
// bias the rule puts after a reduction. No collective is chosen here.

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/tensor.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/functional/parallel_linear.h>
#include <shardline/kernels/elementwise.h>
#include <shardline/kernels/grouped_linear.h>
#include <shardline/kernels/linear.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>

#include "call.h"
#include "checks.h"
#include "linear_plan.h"
#include "pipeline.h"

namespace shardline::functional {

namespace {

using detail::Call;
using detail::ChunkedStep;
using detail::Deliver;
using detail::LinearConfig;
using detail::LinearKind;
using detail::LinearPlan;
using detail::OutputBuffer;
using detail::RowsOf;

using detail::ShapeOf;

/// The plan key of a call: the mesh, tp dim, global input shape and dtype, and the layer's flags.
template <class Options>
LinearConfig MakeConfig(const TensorParallelGroup &group, const detail::CheckedCall &checked, const Options &o) {
    LinearConfig c;
    c.dtype = checked.dtype;
    c.tp_dim = group.tp_dim;
    const comm::DeviceMesh &mesh = *group.mesh;
    c.mesh_ndim = mesh.ndim();
    for (int d = 0; d < c.mesh_ndim; ++d) {
        c.mesh_shape[static_cast<std::size_t>(d)] = mesh.shape()[static_cast<std::size_t>(d)];
    }
    c.x_ndim = static_cast<int>(checked.x_global.size());
    for (int d = 0; d < c.x_ndim; ++d) {
        c.x_shape[static_cast<std::size_t>(d)] = checked.x_global[static_cast<std::size_t>(d)];
    }
    c.out_features = o.out_features;
    c.bias = o.adds_bias();
    c.sequence_parallel = o.sequence_parallel;
    if constexpr (std::is_same_v<Options, ColumnParallelLinearOptions>) {
        c.kind = LinearKind::kColumn;
        c.gather_output = o.gather_output;
    } else {
        c.kind = LinearKind::kRow;
        c.input_is_parallel = o.input_is_parallel;
    }
    return c;
}

// ---------------------------------------------------------------------------------------------------------------------
// Execution.

/// y[r, :] += bias for every row r: the bias the rule adds once, after the reduction of a Partial output.
void AddBiasRows(const Tensor &y, const Tensor &bias) {
    Tensor out = y;
    kernels::BiasAdd(kernels::BiasAddArgs{.x = y, .bias = bias, .out = out});
}

struct ForwardTensors {
    Tensor x{};
    Tensor weight{};
    Tensor bias{}; ///< undefined without a bias
    Tensor y{};
    Tensor x_total{}; ///< undefined unless the caller keeps the gathered input
    kernels::LinearActivation activation = kernels::LinearActivation::kNone; ///< column, without gather_output
    Tensor pre_activation{};                                                 ///< with an activation
    Tensor group_sizes{}; ///< a grouped layer's (options.num_experts > 0); undefined for a Linear
    int chunks = 0;       ///< the options' comm_chunks
    Tensor residual{};    ///< row: y += residual; undefined: none
};

/// out += addend: a residual (or its gradient) added after a collective, where the GEMM could not take it as its C.
void AddInPlace(const Tensor &out, const Tensor &addend) {
    Tensor sum = out;
    kernels::Add(kernels::AddArgs{.a = out, .b = addend, .out = sum});
}

ForwardInfo RunForward(Call &call, const LinearPlan &plan, const ForwardTensors &t) {
    const spmd::CachedRule &rule = *plan.forward;
    ForwardInfo info;
    // x into the layout of the local GEMM: all-gathered (column, sequence parallel), sliced locally (row, input not
    // parallel), or as given.
    const spmd::RedistributePlan &x_plan = rule.input_plans[static_cast<std::size_t>(plan.forward_x)];

    // The local GEMM gives y in the rule's layout (row parallel: Partial); the bias rides in its epilogue unless the
    // rule adds it after the reduction.
    const spmd::TensorSpec &y_rule = rule.info.outputs[0];
    const spmd::RedistributePlan &y_plan = rule.output_plans[0];
    const bool bias_after = t.bias.defined() && rule.info.bias_after_reduction;
    const bool activation = t.activation != kernels::LinearActivation::kNone;
    // The activation reads the finished local output (its bias added, nothing left to move): checked per call, as the
    // column layer without gather_output always gives it.
    SHARDLINE_CHECK(!activation || (!bias_after && y_plan.steps.empty()), "ColumnParallelLinearForward",
                    "an activation needs the local output with its bias (internal: the rule moves y or adds the bias "
                    "after a reduction)");
    const Tensor *local_bias = t.bias.defined() && !bias_after ? &t.bias : nullptr;
    // A residual rides in the GEMM (its C, beta = 1) where y leaves the GEMM finished: nothing moves it, the bias (if
    // any) is in the epilogue, and the whole of y is one GEMM (no chunks). Else it is added at the end.
    const Tensor *gemm_residual = nullptr;
    // The local GEMM on rows of x into the same rows of y: all of them, or one chunk's of a pipeline.
    auto gemm = [&](const Tensor &x_rows, Tensor y_rows, Tensor pre_activation) {
        if (t.group_sizes.defined()) {
            kernels::GroupedLinearForward(kernels::GroupedLinearForwardArgs{
                .x = x_rows, .weight = t.weight, .bias = local_bias, .group_sizes = t.group_sizes, .y = y_rows});
        } else {
            kernels::LinearForward(kernels::LinearForwardArgs{.x = x_rows,
                                                              .weight = t.weight,
                                                              .bias = local_bias,
                                                              .y = y_rows,
                                                              .activation = t.activation,
                                                              .pre_activation = activation ? &pre_activation : nullptr,
                                                              .residual = gemm_residual});
        }
    };

    // The chunked pipelines (options.comm_chunks, pipeline.h): x gathered in chunks, each chunk's GEMMs run as it
    // arrives (column, sequence parallel: nothing moves y); or y computed in chunks, each chunk's all-reduce or
    // reduce-scatter issued as soon as its GEMM is queued (row). Else the plain order.
    const auto gather = ChunkedStep(x_plan, call.mesh(), t.chunks);
    const auto reduce = ChunkedStep(y_plan, call.mesh(), t.chunks);
    if (gather && y_plan.steps.empty()) {
        call.Count(detail::GatherThenGemm(
            *gather, t.x, t.x_total, [&](std::int64_t begin, std::int64_t count, const Tensor &x_rows) {
                gemm(x_rows, RowsOf(t.y, begin, count), activation ? RowsOf(t.pre_activation, begin, count) : Tensor());
            }));
    } else {
        const Tensor x_used = call.Move(t.x, plan.x_shape, plan.x_layout, x_plan);
        if (t.x_total.defined()) {
            Deliver(x_used, t.x_total);
        }
        if (reduce && !activation) {
            // An all-reduce runs in place on the (caller's) output; a reduce-scatter writes into the caller's y.
            const Tensor y_local = reduce->kind == spmd::Collective::kAllReduce
                                       ? OutputBuffer(t.y, call.LocalShape(plan.y_shape, y_rule.layout))
                                       : t.y;
            detail::PendingChunks pending = detail::GemmThenReduce(
                *reduce, y_local, [&](std::int64_t begin, std::int64_t count, const Tensor &y_rows) {
                    gemm(RowsOf(x_used, begin, count), y_rows, Tensor());
                });
            call.Count(pending.collectives());
            pending.Wait();
            Deliver(y_local, t.y);
        } else {
            const Tensor y_local =
                y_plan.steps.empty() ? t.y : OutputBuffer(t.y, call.LocalShape(plan.y_shape, y_rule.layout));
            if (t.residual.defined() && y_plan.steps.empty() && !bias_after && !activation &&
                !t.group_sizes.defined()) {
                gemm_residual = &t.residual;
            }
            gemm(x_used, y_local, t.pre_activation);
            // y to the caller's layout: all-reduced or reduce-scattered (row), all-gathered (column, gather_output).
            Deliver(call.Move(y_local, plan.y_shape, y_rule.layout, y_plan, /*output=*/true), t.y);
        }
    }
    if (t.x_total.defined()) {
        info.saved_input = SavedInput::kGatheredInput;
    }
    if (bias_after) {
        if (t.group_sizes.defined()) {
            kernels::GroupedBiasAdd(t.y, t.bias, t.group_sizes); // each expert's bias on its rows
        } else {
            AddBiasRows(t.y, t.bias);
        }
    }
    if (t.residual.defined() && gemm_residual == nullptr) {
        AddInPlace(t.y, t.residual); // after the reduction and the bias
    }
    info.collectives = call.collectives();
    return info;
}

struct BackwardTensors {
    Tensor dy{};
    Tensor x{};       ///< undefined when not needed
    Tensor x_total{}; ///< column, sequence parallel: the forward's gathered input, if kept
    Tensor weight{};  ///< undefined when not needed
    Tensor dx{};      ///< undefined: not wanted
    Tensor dweight{};
    Tensor dbias{};
    GradMode mode = GradMode::kOverwrite;
    kernels::LinearActivation input_activation = kernels::LinearActivation::kNone; ///< row, input_is_parallel
    Tensor pre_activation{};                                                       ///< with dx and an activation
    Tensor pre_activation_dbias{};                                                 ///< undefined: not wanted
    Tensor group_sizes{}; ///< a grouped layer's (options.num_experts > 0); undefined for a Linear
    bool overlap = true;  ///< the options' overlap_grad_comm
    int chunks = 0;       ///< the options' comm_chunks
    Tensor dx_residual{}; ///< column: dx += dx_residual in the dgrad GEMM (RunBackward's plain order only)
};

/// A grouped layer's dgrad (when dx is wanted).
/// With an input activation (row, input_is_parallel) dx is the pre-activation's gradient, the dGELU in the dgrad's
/// epilogue.
void RunGroupedInputKernel(const BackwardTensors &t, const Tensor &dy, Tensor &dx) {
    if (t.dx.defined()) {
        const bool activation = t.input_activation != kernels::LinearActivation::kNone;
        kernels::GroupedLinearBackwardInput(
            kernels::GroupedLinearBackwardInputArgs{.dy = dy,
                                                    .weight = t.weight,
                                                    .group_sizes = t.group_sizes,
                                                    .dx = dx,
                                                    .input_activation = t.input_activation,
                                                    .pre_activation = activation ? &t.pre_activation : nullptr});
    }
}

/// A grouped layer's parameter gradients: the split grouped kernels for exactly the wanted ones (the bias grad rides
/// with the weight grad when both are in one dtype).
void RunGroupedParamKernels(const BackwardTensors &t, const Tensor &dy, const Tensor &x, bool accumulate) {
    Tensor dweight = t.dweight;
    Tensor dbias = t.dbias;
    const bool bias_with_weight = t.dweight.defined() && t.dbias.defined() && t.dbias.dtype() == t.dweight.dtype();
    if (t.dweight.defined()) {
        kernels::GroupedLinearBackwardWeight(
            kernels::GroupedLinearBackwardWeightArgs{.dy = dy,
                                                     .x = x,
                                                     .group_sizes = t.group_sizes,
                                                     .dweight = dweight,
                                                     .dbias = bias_with_weight ? &dbias : nullptr,
                                                     .accumulate = accumulate});
    }
    if (t.dbias.defined() && !bias_with_weight) {
        kernels::GroupedLinearBackwardBias(kernels::GroupedLinearBackwardBiasArgs{
            .dy = dy, .group_sizes = t.group_sizes, .dbias = dbias, .accumulate = accumulate});
    }
}

/// A grouped layer's wanted gradients in one GroupedLinearBackward (the plain order: nothing runs between the dgrad
/// and the parameter grads, so on CUDA the parameter grads run beside the dgrad).
void RunGroupedKernels(const BackwardTensors &t, const Tensor &dy, const Tensor &x, Tensor &dx, bool accumulate) {
    Tensor dweight = t.dweight;
    Tensor dbias = t.dbias;
    const bool activation = t.dx.defined() && t.input_activation != kernels::LinearActivation::kNone;
    kernels::GroupedLinearBackward(kernels::GroupedLinearBackwardArgs{
        .dy = dy,
        .x = t.dweight.defined() ? &x : nullptr,
        .weight = t.dx.defined() ? &t.weight : nullptr,
        .group_sizes = t.group_sizes,
        .dx = t.dx.defined() ? &dx : nullptr,
        .dweight = t.dweight.defined() ? &dweight : nullptr,
        .dbias = t.dbias.defined() ? &dbias : nullptr,
        .accumulate = accumulate,
        .input_activation = activation ? t.input_activation : kernels::LinearActivation::kNone,
        .pre_activation = activation ? &t.pre_activation : nullptr});
}

/// The local kernels of a backward for the gradients given (nullptr: not computed now): one LinearBackward, so the
/// kernels decide per shape whether the bias grad rides in the wgrad GEMM or runs beside it; dbias apart (its own
/// column sum) when its dtype differs from dweight's (a float32 main grad for one and not the other), as the kernel
/// takes dbias in dweight's dtype only.
void RunLinearKernels(const BackwardTensors &t, const Tensor &dy, const Tensor *x, Tensor *dx, Tensor *dweight,
                      Tensor *dbias, Tensor *pre_dbias, const Tensor *dx_residual = nullptr) {
    const bool accumulate = t.mode == GradMode::kAccumulate;
    const bool activation = dx != nullptr && t.input_activation != kernels::LinearActivation::kNone;
    const bool bias_apart = dbias != nullptr && dweight != nullptr && dbias->dtype() != dweight->dtype();
    kernels::LinearBackward(kernels::LinearBackwardArgs{
        .dy = dy,
        .x = dweight != nullptr ? x : nullptr,
        .weight = dx != nullptr ? &t.weight : nullptr,
        .dx = dx,
        .dweight = dweight,
        .dbias = bias_apart ? nullptr : dbias,
        .accumulate = accumulate,
        .input_activation = activation ? t.input_activation : kernels::LinearActivation::kNone,
        .pre_activation = activation ? &t.pre_activation : nullptr,
        .pre_activation_dbias = dx != nullptr ? pre_dbias : nullptr,
        .dx_residual = dx != nullptr ? dx_residual : nullptr});
    if (bias_apart) {
        kernels::LinearBackwardBias(
            kernels::LinearBackwardBiasArgs{.dy = dy, .dbias = *dbias, .accumulate = accumulate});
    }
}

/// Row parallel under sequence parallelism with dx wanted and comm_chunks > 1 (pipeline.h): dy is all-gathered in
/// chunks and each chunk's dgrad GEMMs run as it arrives. The parameter grads then run once on the whole gathered dy
/// (assembled as the chunks arrive), as the plain order runs them; the column layer's bias grad of an input activation
/// (Σ_rows dx) is one column sum of the finished dx, as the dgrad kernel computes it where it does not fuse it.
BackwardInfo RunGatheredBackward(Call &call, const LinearPlan &plan, const BackwardTensors &t,
                                 const detail::ChunkedCollective &gather) {
    const spmd::CachedRule &rule = *plan.grad;
    const bool params = t.dweight.defined() || t.dbias.defined();
    const Tensor dy_total = params ? Tensor::Empty(plan.y_shape, t.dy.dtype(), call.device()) : Tensor();
    BackwardTensors rows = t; // the pre-activation's rows of each block
    call.Count(detail::GatherThenGemm(gather, t.dy, dy_total,
                                      [&](std::int64_t begin, std::int64_t count, const Tensor &dy_rows) {
                                          Tensor dx_rows = RowsOf(t.dx, begin, count);
                                          if (t.input_activation != kernels::LinearActivation::kNone) {
                                              rows.pre_activation = RowsOf(t.pre_activation, begin, count);
                                          }
                                          RunLinearKernels(rows, dy_rows, nullptr, &dx_rows, nullptr, nullptr, nullptr);
                                      }));
    if (t.pre_activation_dbias.defined()) {
        Tensor pre_dbias = t.pre_activation_dbias;
        kernels::LinearBackwardBias(kernels::LinearBackwardBiasArgs{
            .dy = t.dx, .dbias = pre_dbias, .accumulate = t.mode == GradMode::kAccumulate});
    }
    if (params) {
        const Tensor x_used = t.dweight.defined() ? call.Move(t.x, plan.x_shape, plan.x_layout,
                                                              rule.input_plans[static_cast<std::size_t>(plan.grad_x)])
                                                  : Tensor();
        Tensor dweight = t.dweight;
        Tensor dbias = t.dbias;
        RunLinearKernels(t, dy_total, &x_used, nullptr, t.dweight.defined() ? &dweight : nullptr,
                         t.dbias.defined() ? &dbias : nullptr, nullptr);
    }
    return BackwardInfo{.collectives = call.collectives()};
}

BackwardInfo RunBackward(Call &call, const LinearPlan &plan, const BackwardTensors &t) {
    const spmd::CachedRule &rule = *plan.grad;
    const bool want_dx = t.dx.defined();
    const bool want_dw = t.dweight.defined();
    const bool want_db = t.dbias.defined();
    const bool want_pre_db = t.pre_activation_dbias.defined(); // checked: only with dx
    if (!want_dx && !want_dw && !want_db) {
        return {};
    }
    const bool grouped = t.group_sizes.defined();
    const bool accumulate = t.mode == GradMode::kAccumulate;
    // dy into the layout the rule wants: a local slice (column, gather_output), all-gathered (row, sequence
    // parallel; in chunks, each feeding its dgrad GEMMs, with comm_chunks), or as given.
    const spmd::RedistributePlan &dy_plan = rule.input_plans[static_cast<std::size_t>(plan.grad_out_grad)];
    if (const auto gather = want_dx ? ChunkedStep(dy_plan, call.mesh(), t.chunks) : std::nullopt) {
        return RunGatheredBackward(call, plan, t, *gather);
    }
    const Tensor dy_used = call.Move(t.dy, plan.y_shape, plan.y_layout, dy_plan);

    // dx = dy·W comes out in the grad rule's layout (column: Partial over tp) and goes back to x's layout after the
    // kernels: an all-reduce, a reduce-scatter (sequence parallel) or an all-gather (row, input not parallel).
    const auto o = static_cast<std::size_t>(plan.grad_x_grad);
    const spmd::TensorSpec &dx_rule = rule.info.outputs[o];
    const spmd::RedistributePlan &dx_plan = rule.output_plans[o];
    // x into the layout of the wgrad GEMM: the forward's gathered input when kept, else all-gathered again (column,
    // sequence parallel), sliced locally (row, input not parallel), or as given.
    const spmd::RedistributePlan &x_plan = rule.input_plans[static_cast<std::size_t>(plan.grad_x)];
    const bool gather_x = want_dw && !t.x_total.defined();

    // Overlap (DESIGN.md §10): when dx has a collective and parameter grads are wanted, the dgrad GEMM runs first, dx's
    // collective goes out on the communication stream (NCCL orders it after the GEMM by an event) while the wgrad GEMM
    // and the bias grad run, and the call waits for it at its end (NCCL: the caller's stream waits on an event; no
    // host wait). x's all-gather for dweight, when the forward did not keep it, is issued first and awaited only
    // before the wgrad GEMM, so it overlaps the dgrad GEMM. The same kernels on the same operands, and the same
    // collectives in the same order (x's before dx's): bitwise the results and counts of the plain order.
    const bool overlap = t.overlap && want_dx && (want_dw || want_db) && dx_plan.NumCollectives() > 0;
    // With comm_chunks (pipeline.h) the dgrad runs in chunks of rows, each chunk's all-reduce (reduce-scatter) issued
    // as soon as its GEMM is queued; with the overlap the parameter grads run while the last chunks are in flight.
    const auto dx_chunks = want_dx ? ChunkedStep(dx_plan, call.mesh(), t.chunks) : std::nullopt;

    dist::PendingRedistribute x_pending;
    Tensor x_used;
    if (want_dw) {
        if (!gather_x) {
            x_used = t.x_total;
        } else if (overlap) {
            x_pending = call.Start(t.x, plan.x_shape, plan.x_layout, x_plan);
        } else {
            x_used = call.Move(t.x, plan.x_shape, plan.x_layout, x_plan);
        }
    }
    Tensor dx_local; // a chunked reduce-scatter writes into the caller's dx
    if (want_dx && !(dx_chunks && dx_chunks->kind == spmd::Collective::kReduceScatter)) {
        dx_local = dx_plan.steps.empty() ? t.dx : OutputBuffer(t.dx, call.LocalShape(plan.x_shape, dx_rule.layout));
    }
    // The activation's gradient applies to the finished local dx (input_is_parallel: nothing moves it).
    const bool activation = want_dx && t.input_activation != kernels::LinearActivation::kNone;
    SHARDLINE_CHECK(!activation || dx_plan.steps.empty(), "RowParallelLinearBackward",
                    "an input activation needs dx in the input's layout (internal: the rule moves dx)");

    // Parameter gradients stay in their parameters' layouts (checked when the plan was built): no collective, and
    // they accumulate straight into the caller's (main) grads.
    Tensor dweight = t.dweight;
    Tensor dbias = t.dbias;
    Tensor pre_dbias = t.pre_activation_dbias;
    if (overlap || dx_chunks) {
        dist::PendingRedistribute dx_pending;
        detail::PendingChunks dx_chunked;
        if (dx_chunks) {
            dx_chunked = detail::GemmThenReduce(*dx_chunks, dx_local.defined() ? dx_local : t.dx,
                                                [&](std::int64_t begin, std::int64_t count, Tensor &dx_rows) {
                                                    RunLinearKernels(t, RowsOf(dy_used, begin, count), nullptr,
                                                                     &dx_rows, nullptr, nullptr, nullptr);
                                                });
            call.Count(dx_chunked.collectives());
            if (!overlap) {
                dx_chunked.Wait(); // the plain order: dx's collectives finished before the parameter grads
            }
        } else {
            if (grouped) {
                RunGroupedInputKernel(t, dy_used, dx_local);
            } else {
                RunLinearKernels(t, dy_used, nullptr, &dx_local, nullptr, nullptr, want_pre_db ? &pre_dbias : nullptr);
            }
            dx_pending = call.Start(dx_local, plan.x_shape, dx_rule.layout, dx_plan, /*output=*/true);
        }
        if (x_pending.valid()) {
            x_used = Call::Finish(x_pending);
        }
        if (grouped) {
            RunGroupedParamKernels(t, dy_used, x_used, accumulate);
        } else if (want_dw || want_db) {
            RunLinearKernels(t, dy_used, &x_used, nullptr, want_dw ? &dweight : nullptr, want_db ? &dbias : nullptr,
                             nullptr);
        }
        // Waited here, at the end of the layer's backward, rather than left to dx's consumer: the call's contract is
        // that dx is in the caller's buffer (stream-ordered) when it returns, and the op before this layer consumes
        // dx at once; on NCCL the wait is an event on the caller's stream, so the host does not block.
        if (dx_chunks) {
            dx_chunked.Wait();
            if (dx_local.defined()) {
                Deliver(dx_local, t.dx);
            }
        } else {
            Deliver(Call::Finish(dx_pending), t.dx);
        }
        return BackwardInfo{.collectives = call.collectives()};
    }

    if (grouped) {
        RunGroupedKernels(t, dy_used, x_used, dx_local, accumulate);
    } else {
        RunLinearKernels(t, dy_used, &x_used, want_dx ? &dx_local : nullptr, want_dw ? &dweight : nullptr,
                         want_db ? &dbias : nullptr, want_pre_db ? &pre_dbias : nullptr,
                         t.dx_residual.defined() ? &t.dx_residual : nullptr);
    }
    if (want_dx) {
        Deliver(call.Move(dx_local, plan.x_shape, dx_rule.layout, dx_plan, /*output=*/true), t.dx);
    }
    return BackwardInfo{.collectives = call.collectives()};
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------------
// The entry points: validate (checks.cc), find the configuration's plan, run.

ForwardInfo ColumnParallelLinearForward(const ColumnParallelLinearOptions &options,
                                        const ColumnParallelLinearForwardArgs &args, const TensorParallelGroup &group,
                                        const CudaExecution &cuda) {
    const detail::CheckedCall checked = detail::CheckColumnForward(options, args, group, cuda);
    const auto plan = detail::GetLinearPlan(MakeConfig(group, checked, options), "ColumnParallelLinearForward");
    Call call(*group.mesh, cuda);
    return RunForward(call, *plan,
                      ForwardTensors{.x = call.Wrap(args.x),
                                     .weight = call.Wrap(args.weight),
                                     .bias = call.Wrap(args.bias),
                                     .y = call.Wrap(args.y),
                                     .x_total = call.Wrap(args.x_total),
                                     .activation = args.activation,
                                     .pre_activation = call.Wrap(args.pre_activation),
                                     .group_sizes = call.WrapSizes(args.group_sizes, args.group_sizes_on_device),
                                     .chunks = options.comm_chunks});
}

BackwardInfo ColumnParallelLinearBackward(const ColumnParallelLinearOptions &options,
                                          const ColumnParallelLinearBackwardArgs &args,
                                          const TensorParallelGroup &group, const CudaExecution &cuda) {
    const detail::CheckedCall checked = detail::CheckColumnBackward(options, args, group, cuda);
    const auto plan = detail::GetLinearPlan(MakeConfig(group, checked, options), "ColumnParallelLinearBackward");
    const bool want_dx = args.dx.present();
    const bool want_dw = args.dweight.present();
    const bool have_total = args.x_total.present();
    Call call(*group.mesh, cuda);
    // dx_residual rides in the dgrad GEMM (its C, beta = 1) where dx leaves the GEMM finished: no collective moves it
    // (then RunBackward takes its plain order: no overlap, no chunks). Else it is added after dx's collective.
    const Tensor dx_residual = call.Wrap(args.dx_residual);
    const bool residual_in_gemm =
        dx_residual.defined() && plan->grad->output_plans[static_cast<std::size_t>(plan->grad_x_grad)].steps.empty();
    const BackwardInfo info =
        RunBackward(call, *plan,
                    BackwardTensors{.dy = call.Wrap(args.dy),
                                    .x = want_dw && !have_total ? call.Wrap(args.x) : Tensor(),
                                    .x_total = want_dw && have_total ? call.Wrap(args.x_total) : Tensor(),
                                    .weight = want_dx ? call.Wrap(args.weight) : Tensor(),
                                    .dx = call.Wrap(args.dx),
                                    .dweight = call.Wrap(args.dweight),
                                    .dbias = call.Wrap(args.dbias),
                                    .mode = args.param_grads,
                                    .group_sizes = call.WrapSizes(args.group_sizes, args.group_sizes_on_device),
                                    .overlap = options.overlap_grad_comm,
                                    .chunks = options.comm_chunks,
                                    .dx_residual = residual_in_gemm ? dx_residual : Tensor()});
    if (dx_residual.defined() && !residual_in_gemm) {
        AddInPlace(call.Wrap(args.dx), dx_residual);
    }
    return info;
}

ForwardInfo RowParallelLinearForward(const RowParallelLinearOptions &options, const RowParallelLinearForwardArgs &args,
                                     const TensorParallelGroup &group, const CudaExecution &cuda) {
    const detail::CheckedCall checked = detail::CheckRowForward(options, args, group, cuda);
    const auto plan = detail::GetLinearPlan(MakeConfig(group, checked, options), "RowParallelLinearForward");
    Call call(*group.mesh, cuda);
    return RunForward(call, *plan,
                      ForwardTensors{.x = call.Wrap(args.x),
                                     .weight = call.Wrap(args.weight),
                                     .bias = call.Wrap(args.bias),
                                     .y = call.Wrap(args.y),
                                     .group_sizes = call.WrapSizes(args.group_sizes, args.group_sizes_on_device),
                                     .chunks = options.comm_chunks,
                                     .residual = call.Wrap(args.residual)});
}

BackwardInfo RowParallelLinearBackward(const RowParallelLinearOptions &options,
                                       const RowParallelLinearBackwardArgs &args, const TensorParallelGroup &group,
                                       const CudaExecution &cuda) {
    const detail::CheckedCall checked = detail::CheckRowBackward(options, args, group, cuda);
    const auto plan = detail::GetLinearPlan(MakeConfig(group, checked, options), "RowParallelLinearBackward");
    Call call(*group.mesh, cuda);
    return RunBackward(call, *plan,
                       BackwardTensors{.dy = call.Wrap(args.dy),
                                       .x = args.dweight.present() ? call.Wrap(args.x) : Tensor(),
                                       .weight = args.dx.present() ? call.Wrap(args.weight) : Tensor(),
                                       .dx = call.Wrap(args.dx),
                                       .dweight = call.Wrap(args.dweight),
                                       .dbias = call.Wrap(args.dbias),
                                       .mode = args.param_grads,
                                       .input_activation = args.input_activation,
                                       .pre_activation = args.dx.present() ? call.Wrap(args.pre_activation) : Tensor(),
                                       .pre_activation_dbias = call.Wrap(args.pre_activation_dbias),
                                       .group_sizes = call.WrapSizes(args.group_sizes, args.group_sizes_on_device),
                                       .overlap = options.overlap_grad_comm,
                                       .chunks = options.comm_chunks});
}

} // namespace shardline::functional
