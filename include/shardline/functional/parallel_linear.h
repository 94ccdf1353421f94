#pragma once

// Column- and row-parallel Linear layers as functions on caller-owned memory: the functional layer under shardline's
// modules, for a trainer that has its own tensors and its own autograd (docs/functional.md).
//
// Every call takes
//   - the layer's options (global sizes and Megatron's flags),
//   - the tensors as TensorViews of the caller's memory (device memory of the current CUDA device when the mesh moves
//     CUDA tensors over NCCL, host memory when it moves CPU tensors over MPI), each with its *local* shape,
//   - the tensor-parallel group (a DeviceMesh and the mesh dim that is TP, so a dp x tp mesh works), and
//   - on CUDA the stream and the cuBLASLt workspace of the call.
// shardline keeps no pointer after a call returns and frees nothing of the caller's.
//
// The collectives are not written here: each call gives the linear SPMD rule (spmd::InferLinearForward / Grad) the
// layouts of the caller's tensors, and the redistribute planner's plans move them (DESIGN.md §6), with W [out, in]:
//
//   layer                                   forward                          backward
//   column                                  none                             all-reduce dx (none without dx)
//   column, sequence_parallel               all-gather x                     reduce-scatter dx (+ all-gather x
//                                                                            again for dweight unless x_total kept)
//   column, gather_output                   + all-gather y                   + a local slice of dy (no collective)
//   row, input_is_parallel                  all-reduce y, then + bias once   none
//   row, input not parallel                 local slice of x, all-reduce y   all-gather dx (none without dx)
//   row, sequence_parallel                  reduce-scatter y, then + bias    all-gather dy
//
// With comm_chunks = C > 1 (the options below) the row forward's all-reduce / reduce-scatter, the column backward's dx
// all-reduce / reduce-scatter and the sequence-parallel all-gathers of the column forward's x and the row backward's dy
// run as C collectives over chunks of rows, each beside another chunk's GEMM (the same bytes; docs/functional.md).
//
// The rule and its plans are inferred once per configuration (mesh shape, tp dim, shapes, flags, dtype) and cached;
// a steady-state call looks them up and infers nothing (GetPlanCacheStats).
//
// Megatron's MLP (column → GELU → row) may run the GELU in the GEMM epilogues: the column forward with `activation`
// (y = gelu_tanh(x·Wᵀ + b), the pre-activation kept) and the row backward with `input_activation` (dx becomes the
// pre-activation's gradient, and `pre_activation_dbias` the column layer's bias grad), with the pair's collectives.
//
// Uneven sizes: the sharded feature dim (column: out_features, row: in_features) need not divide by tp. It is split as
// torch.chunk splits it (every layout of shardline does): the first ranks take ceil(n/tp) features, the last the rest
// (n = 22 over tp 3: 8, 8, 6); TensorParallelGroup::ShardSize(n) is this rank's part, and the shapes below written
// N/tp or K/tp mean it. Each rank's part must be non-empty (CheckShardsNotEmpty). The collectives then move uneven
// blocks (all-gather-v / reduce-scatter-v, docs/comm.md). Sequence parallelism still needs s divisible by tp.
//
// Mixture-of-experts layers (options.num_experts = E > 0) are the same calls on grouped Linears: weight [E, out, in]
// (sharded on out or in over tp exactly as a Linear's), x [T, in] with its rows grouped by expert (group_sizes), the
// local GEMMs kernels::GroupedLinear*, the same plans and collectives, a row layer's bias [E, out] added per expert
// once after the reduction.
//
// Errors (shape, dtype, a null required pointer, a bad mesh dim, a rank left without features) raise
// shardline::Error naming the function, the values and the expectation, before any collective: when every rank
// passes the same bad configuration, every rank raises and none waits in a collective.

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>

#include <shardline/comm/device_mesh.h>
#include <shardline/core/dtype.h>
#include <shardline/core/tensor.h>
#include <shardline/kernels/linear.h>

// cudaStream_t is `struct CUstream_st*`; declaring the struct keeps this header free of the CUDA headers, so CPU-only
// builds and trainers compiled without CUDA take the same signatures.
struct CUstream_st;

namespace shardline::functional {

/// A CUDA stream (the same type as cudaStream_t).
using CudaStream = CUstream_st *;

inline constexpr int kMaxViewDims = 4;

/// Caller-owned memory holding a row-major contiguous tensor of `shape[0..ndim)` elements of `dtype`. The data of an
/// input is only read. A view with a null `data` is absent (an optional tensor that is not given, a gradient that is
/// not wanted); a required view must have a non-null `data`, even when it has no elements.
struct TensorView {
    void *data = nullptr;
    DType dtype = DType::kFloat32;
    int ndim = 0;
    std::int64_t shape[kMaxViewDims] = {};

    bool present() const { return data != nullptr; }
    std::int64_t numel() const;
};

/// View(ptr, {s, b, h}, DType::kBFloat16). Throws Error for more than kMaxViewDims dims.
TensorView View(void *data, std::initializer_list<std::int64_t> shape, DType dtype);
/// The same for an input (the view is only read).
TensorView View(const void *data, std::initializer_list<std::int64_t> shape, DType dtype);
/// A view of a contiguous shardline Tensor (its shape, dtype and data); an undefined tensor gives an absent view.
/// Throws Error for a strided tensor or more than kMaxViewDims dims.
TensorView View(const Tensor &tensor);

/// The tensor-parallel group: mesh dim `tp_dim` of `*mesh`, of size tp. Collectives run on mesh->group(tp_dim) only.
/// The other mesh dims (e.g. dp) hold independent replicas of the layer, each with its own data; reducing parameter
/// gradients over them stays the caller's job (nn::GradSync does it for the modules). One type for the functional
/// layer, autograd and the nn modules: `{.mesh = &mesh, .tp_dim = 1}` or `TensorParallelGroup::Named(mesh, "tp")`.
/// tp_dim kNoTensorParallel (-1): a group of one rank on every rank — the layer is whole on each rank and runs no
/// collective, every mesh dim being a replica dim (a MoE layer's whole experts at etp 1, docs/moe.md).
struct TensorParallelGroup {
    static constexpr int kNoTensorParallel = -1;
    comm::DeviceMesh *mesh = nullptr;
    int tp_dim = 0;

    /// The group of the mesh dim named `dim_name`; throws Error naming the mesh's dims when there is none.
    static TensorParallelGroup Named(comm::DeviceMesh &mesh, std::string_view dim_name = "tp");
    /// tp, the group's size; throws Error for a null mesh or a tp_dim that is not a dim of the mesh.
    std::int64_t size() const;
    /// This rank's index in the group (its coordinate on tp_dim).
    std::int64_t rank() const;
    /// This rank's part of a dim of `n` split over the group, as every layout of shardline splits (torch.chunk,
    /// spmd::ChunkRange): ranks take ceil(n/tp) in order, the last non-empty one the rest. n = 22 over tp 3: 8, 8, 6.
    std::int64_t ShardSize(std::int64_t n) const;
    /// The global index of this rank's first element of that dim (the sum of the parts before it).
    std::int64_t ShardOffset(std::int64_t n) const;
};

/// The layers' sizes may be uneven (not divisible by tp; torch.chunk parts as above) but every rank's part must hold
/// at least one feature: throws ShapeError naming `op`, `name`, n, tp and the parts otherwise (n < tp, or sizes such as
/// n = 9 over tp 4, whose parts are 3, 3, 3, 0). Depends on n and tp only, so every rank raises alike, before any
/// collective.
void CheckShardsNotEmpty(std::string_view op, std::string_view name, std::int64_t n, std::int64_t tp);

/// Where a call's CUDA work goes (ignored on the CPU). Every kernel and copy of the call is queued on `stream`, and
/// the communicators order their collectives against it with events: no host synchronisation.
struct CudaExecution {
    CudaStream stream = nullptr;     ///< null: the device context's compute stream
    void *workspace = nullptr;       ///< cuBLASLt workspace on the device; null: the context's
    std::size_t workspace_bytes = 0; ///< size of `workspace`
};

/// Whether a backward overwrites the parameter gradients or adds to them.
enum class GradMode : std::uint8_t {
    kOverwrite,  ///< dweight = ..., dbias = ... (the parameter's dtype)
    kAccumulate, ///< dweight += ..., dbias += ... (beta = 1): the parameter's dtype or a float32 main grad
};

/// Which input a forward's caller keeps for the backward.
enum class SavedInput : std::uint8_t {
    kInput,         ///< x, as given to the forward
    kGatheredInput, ///< x_total, filled by the forward (column, sequence_parallel); x is no longer needed
};

/// What a forward did.
struct ForwardInfo {
    SavedInput saved_input = SavedInput::kInput;
    int collectives = 0; ///< issued on the tp group
};

/// What a backward did.
struct BackwardInfo {
    int collectives = 0; ///< issued on the tp group
};

// ---- Column parallel: W is split by rows (out_features); Y = X·Wᵀ + b --------------------------------------------
// Shapes below: s is the sequence (dim 0 of x, Megatron's [s, b, h] layout), "..." further leading dims (up to
// kMaxViewDims dims in all), K = in_features, N = out_features, tp = the group's size.

/// Megatron's ColumnParallelLinear, and its defaults. One options type for the functional layer, autograd and
/// nn::ColumnParallelLinear.
struct ColumnParallelLinearOptions {
    std::int64_t in_features = 0;   ///< K; every rank holds all of it
    std::int64_t out_features = 0;  ///< N (global); split over tp as torch.chunk (uneven allowed, no rank empty)
    bool bias = true;               ///< a bias [N/tp] per rank, fused into the GEMM
    bool gather_output = false;     ///< all-gather y to [s, ..., N] on every rank (not with sequence_parallel)
    bool sequence_parallel = false; ///< x arrives split on dim 0 ([s/tp, ..., K]) and is all-gathered
    /// The layer leaves the bias out and the caller adds it (e.g. fused into the next op): the module returns it, and
    /// the functional calls neither read `bias` nor write `dbias` (both must be absent).
    bool skip_bias_add = false;
    /// Mixture-of-experts expert tensor parallelism: 0 for a Linear; E > 0 makes the layer E experts, a grouped Linear
    /// (kernels/grouped_linear.h): the weight and bias gain a leading experts dim ([E, ...] of the shapes below), x is
    /// [T, in] with its rows grouped by expert as the call's group_sizes say. Not with sequence_parallel or an
    /// activation.
    std::int64_t num_experts = 0;
    /// The backward overlaps dx's collective with the parameter grads (DESIGN.md §10): the dgrad GEMM first, dx's
    /// all-reduce (reduce-scatter under sequence_parallel) issued at once, on CUDA on the communicator's stream ordered
    /// by events, while the wgrad GEMM and the bias grad run, and waited for at the end of the call (on CUDA an event
    /// wait on the caller's stream, no host wait). Under sequence_parallel without x_total, x's all-gather for dweight
    /// is issued before the dgrad GEMM and awaited before the wgrad GEMM. The same kernels, collectives, order and
    /// bytes as the plain order, so bitwise the same results. Off: every collective waited for where it is issued.
    bool overlap_grad_comm = true;
    /// The chunked collective-GEMM pipelines (DESIGN.md §10, docs/functional.md "Chunked pipelines"), C = comm_chunks:
    /// C > 1 splits the rows (x's leading dims flattened) into C chunks, R / C rows each (the first R % C one more).
    /// Forward under sequence_parallel: x is all-gathered in C chunks (rows [c0, c1) of every rank's block each), all
    /// issued at once, and each chunk's GEMMs run as soon as it arrives (one per rank block of output rows). Backward:
    /// the dgrad GEMM runs in C chunks and each chunk's all-reduce of dx (reduce-scatter under sequence_parallel, then
    /// of rows [c0, c1) of every rank's block) is issued as soon as its GEMM is queued. C collectives instead of one
    /// with the same bytes in all (x's extra all-gather for dweight stays one). Bitwise the same results as C <= 1 for
    /// integer-valued operands; otherwise the same up to the GEMMs' rounding (a GEMM of fewer rows may take another
    /// algorithm). 0 or 1: off, the default until measured faster. C < 0, C > the rows it splits (R = the rows, over
    /// tp under sequence_parallel), or C > 1 with num_experts: Error before any collective.
    int comm_chunks = 0;

    /// Whether a call adds the bias (and computes its gradient): bias && !skip_bias_add.
    bool adds_bias() const { return bias && !skip_bias_add; }
};

struct ColumnParallelLinearForwardArgs {
    TensorView x;         ///< [s, ..., K]; sequence_parallel: this rank's [s/tp, ..., K]
    TensorView weight;    ///< [N/tp, K]: this rank's rows of W
    TensorView bias{};    ///< [N/tp]; required when options.adds_bias(), absent otherwise
    TensorView y;         ///< out: [s, ..., N/tp]; gather_output: [s, ..., N]
    TensorView x_total{}; ///< sequence_parallel, optional out: [s, ..., K] receives the all-gathered input, which the
                          ///< backward then reuses instead of gathering it again
    /// kGeluTanh: y = gelu_tanh(x·Wᵀ + b), the GELU in the GEMM's epilogue (Megatron's ParallelMLP fc1; not with
    /// gather_output). The row layer after it takes y as its input and undoes the GELU in its backward
    /// (RowParallelLinearBackwardArgs::input_activation).
    kernels::LinearActivation activation = kernels::LinearActivation::kNone;
    TensorView
        pre_activation{}; ///< out with an activation: [s, ..., N/tp] receives x·Wᵀ + b, which that backward needs
    /// num_experts > 0: int64 [E], the rows of x (and dy) per expert, Σ = T; host memory, or device memory of the
    /// call's device with group_sizes_on_device (read on the host by the loop provider, see kernels/grouped_gemm.h).
    TensorView group_sizes{};
    bool group_sizes_on_device = false;
};

struct ColumnParallelLinearBackwardArgs {
    TensorView dy;        ///< y's shape
    TensorView x{};       ///< the forward's x; required for dweight unless x_total is given
    TensorView x_total{}; ///< sequence_parallel: the forward's x_total (ForwardInfo::saved_input = kGatheredInput)
    TensorView weight{};  ///< the forward's weight; required for dx
    TensorView dx{};      ///< out, x's shape; absent: not computed, and no all-reduce / reduce-scatter is issued
    TensorView dweight{}; ///< out, [N/tp, K]; absent: not computed
    TensorView dbias{};   ///< out, [N/tp] (options.adds_bias() only); absent: not computed
    GradMode param_grads = GradMode::kOverwrite; ///< for dweight and dbias
    /// Optional, x's shape, requires dx: dx += dx_residual, the gradient that reaches x by another path (a residual
    /// connection's pass-through, y = x + f(x); only read, and not with num_experts). Added by the dgrad GEMM (its C,
    /// beta = 1) where dx leaves the GEMM finished (tp 1: no collective moves it); else added after dx's collective.
    TensorView dx_residual{};
    /// num_experts > 0: int64 [E], the rows of x (and dy) per expert, Σ = T; host memory, or device memory of the
    /// call's device with group_sizes_on_device (read on the host by the loop provider, see kernels/grouped_gemm.h).
    TensorView group_sizes{};
    bool group_sizes_on_device = false;
};

/// y = x·weightᵀ + bias (gelu_tanh of it with activation, the pre-activation kept) on this rank's N/tp output features.
/// Communication: sequence_parallel all-gathers x (into x_total when given), gather_output all-gathers y.
ForwardInfo ColumnParallelLinearForward(const ColumnParallelLinearOptions &options,
                                        const ColumnParallelLinearForwardArgs &args, const TensorParallelGroup &group,
                                        const CudaExecution &cuda = {});

/// dx = Σ_tp dy·weight (all-reduced, or reduce-scattered under sequence_parallel) (+ dx_residual); dweight (+)=
/// dyᵀ·x_total; dbias (+)= Σ_rows dy. Computes only the gradients whose views are present.
BackwardInfo ColumnParallelLinearBackward(const ColumnParallelLinearOptions &options,
                                          const ColumnParallelLinearBackwardArgs &args,
                                          const TensorParallelGroup &group, const CudaExecution &cuda = {});

// ---- Row parallel: W is split by columns (in_features); Y = Σ_tp X_r·W_rᵀ + b -------------------------------------

/// Megatron's RowParallelLinear, and its defaults. One options type for the functional layer, autograd and
/// nn::RowParallelLinear.
struct RowParallelLinearOptions {
    std::int64_t in_features = 0;   ///< K (global); split over tp as torch.chunk (uneven allowed, no rank empty)
    std::int64_t out_features = 0;  ///< N; every rank holds all of it
    bool bias = true;               ///< a bias [N], the same on every rank, added once after the reduction
    bool input_is_parallel = false; ///< x arrives split on K ([s, ..., K/tp]); else x is [s, ..., K] and each rank
                                    ///< takes its part locally
    bool sequence_parallel = false; ///< y is reduce-scattered on dim 0 ([s/tp, ..., N]); needs input_is_parallel
    /// The layer leaves the bias out and the caller adds it: the module returns it, and the functional calls neither
    /// read `bias` nor write `dbias` (both must be absent).
    bool skip_bias_add = false;
    /// Mixture-of-experts expert tensor parallelism: 0 for a Linear; E > 0 makes the layer E experts, a grouped Linear
    /// (kernels/grouped_linear.h): the weight and bias gain a leading experts dim ([E, ...] of the shapes below), x is
    /// [T, in] with its rows grouped by expert as the call's group_sizes say. Not with sequence_parallel. The backward
    /// takes input_activation (dx the pre-activation's gradient, the dGELU in the grouped dgrad's epilogue: an expert
    /// MLP's fc1 → GELU → fc2, the forward's GELU run apart by the caller) but not pre_activation_dbias (the column
    /// grouped layer computes its bias grad from that dx).
    std::int64_t num_experts = 0;
    /// The backward overlaps dx's collective (the all-gather of a non-parallel input's dx) with the parameter grads,
    /// as ColumnParallelLinearOptions::overlap_grad_comm does: bitwise the same results, collectives and bytes.
    bool overlap_grad_comm = true;
    /// The chunked pipelines, as ColumnParallelLinearOptions::comm_chunks: C > 1 computes the forward's y in C chunks
    /// of rows and issues each chunk's all-reduce (reduce-scatter under sequence_parallel, of rows [c0, c1) of every
    /// rank's block) as soon as its GEMM is queued, the bias added once after the last; the backward under
    /// sequence_parallel (with dx wanted) all-gathers dy in C chunks and runs each chunk's dgrad as it arrives, then
    /// the parameter grads on the whole gathered dy (and input_activation's pre_activation_dbias as a column sum of
    /// dx). C collectives instead of one, the same bytes; bitwise the same results for integer-valued operands.
    int comm_chunks = 0;

    /// Whether a call adds the bias (and computes its gradient): bias && !skip_bias_add.
    bool adds_bias() const { return bias && !skip_bias_add; }
};

struct RowParallelLinearForwardArgs {
    TensorView x;      ///< input_is_parallel: [s, ..., K/tp]; else [s, ..., K]
    TensorView weight; ///< [N, K/tp]: this rank's columns of W
    TensorView bias{}; ///< [N]; required when options.adds_bias(), absent otherwise
    TensorView y;      ///< out: [s, ..., N]; sequence_parallel: this rank's [s/tp, ..., N]
    /// Optional, y's shape: y += residual, a residual connection's input (x + f(x), f ending in this layer; only read,
    /// and not with num_experts). Added by the local GEMM (its C, beta = 1) where y leaves the GEMM finished (tp 1: no
    /// reduction, the bias in the epilogue); else added after the reduction and the bias, as a separate kernel.
    TensorView residual{};
    /// num_experts > 0: int64 [E], the rows of x (and dy) per expert, Σ = T; host memory, or device memory of the
    /// call's device with group_sizes_on_device (read on the host by the loop provider, see kernels/grouped_gemm.h).
    TensorView group_sizes{};
    bool group_sizes_on_device = false;
};

struct RowParallelLinearBackwardArgs {
    TensorView dy;        ///< y's shape
    TensorView x{};       ///< the forward's x; required for dweight
    TensorView weight{};  ///< the forward's weight; required for dx
    TensorView dx{};      ///< out, x's shape; absent: not computed (and, for a non-parallel input, not all-gathered)
    TensorView dweight{}; ///< out, [N, K/tp]; absent: not computed
    TensorView dbias{};   ///< out, [N] (options.adds_bias() only), the same on every rank; absent: not computed
    GradMode param_grads = GradMode::kOverwrite; ///< for dweight, dbias and pre_activation_dbias
    /// The activation between the column layer before and this one (options.input_is_parallel only): x was
    /// gelu_tanh(pre_activation), so dx is the pre-activation's gradient (dy·W) ⊙ gelu_tanh'(pre_activation), in the
    /// dgrad GEMM's epilogue — the column layer's backward then takes dx as its dy.
    kernels::LinearActivation input_activation = kernels::LinearActivation::kNone;
    TensorView pre_activation{}; ///< x's shape: the column forward's pre_activation; required with dx
    /// out, [K/tp]: Σ_rows dx, the column layer's dbias (in the dgrad epilogue where that measures faster), so that
    /// its backward needs no dbias; requires dx. The compute dtype or a float32 main grad, as param_grads says.
    TensorView pre_activation_dbias{};
    /// num_experts > 0: int64 [E], the rows of x (and dy) per expert, Σ = T; host memory, or device memory of the
    /// call's device with group_sizes_on_device (read on the host by the loop provider, see kernels/grouped_gemm.h).
    TensorView group_sizes{};
    bool group_sizes_on_device = false;
};

/// y = Σ_tp x_r·weight_rᵀ (all-reduced, or reduce-scattered on dim 0 under sequence_parallel), then + bias once
/// (+ residual).
ForwardInfo RowParallelLinearForward(const RowParallelLinearOptions &options, const RowParallelLinearForwardArgs &args,
                                     const TensorParallelGroup &group, const CudaExecution &cuda = {});

/// dx = dy_total·weight (⊙ gelu_tanh'(pre_activation) with input_activation); dweight (+)= dy_totalᵀ·x;
/// dbias (+)= Σ_rows dy_total; pre_activation_dbias (+)= Σ_rows dx, where dy_total is dy (all-gathered on dim 0 under
/// sequence_parallel). A non-parallel input's dx is all-gathered to [s, ..., K].
BackwardInfo RowParallelLinearBackward(const RowParallelLinearOptions &options,
                                       const RowParallelLinearBackwardArgs &args, const TensorParallelGroup &group,
                                       const CudaExecution &cuda = {});

// ---- The per-configuration cache -----------------------------------------------------------------------------------

struct PlanCacheStats {
    std::uint64_t hits = 0;   ///< calls that found their configuration's rule and plans
    std::uint64_t misses = 0; ///< calls that inferred them (the first of each configuration)
    std::size_t size = 0;     ///< configurations held
};
PlanCacheStats GetPlanCacheStats();
/// Drops the cached configurations and zeroes the counters (tests; a trainer never needs it).
void ClearPlanCache();

} // namespace shardline::functional
