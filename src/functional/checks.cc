#include "checks.h"

#include <algorithm>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/comm/device_mesh.h>
#include <shardline/core/error.h>

#include "linear_plan.h"
#include "pipeline.h"

namespace shardline::functional::detail {
namespace {

/// "[s, b, h]" of a view, for messages.
std::string Dims(const TensorView &v) { return ShapeToString(ShapeOf(v)); }

Shape WithLast(Shape shape, std::int64_t last) {
    shape.push_back(last);
    return shape;
}

/// The layer's sizes and flags, appended to shape errors ("in_features 16, out_features 24, tp 4,
/// sequence_parallel"); formatted only when a check fails.
struct LayerSizes {
    std::int64_t in = 0;
    std::int64_t out = 0;
    std::int64_t tp = 1;
    std::string_view flag1; ///< column: sequence_parallel; row: input_is_parallel (empty when off)
    std::string_view flag2; ///< column: gather_output; row: sequence_parallel
};

LayerSizes SizesOf(const ColumnParallelLinearOptions &o, std::int64_t tp) {
    return {.in = o.in_features,
            .out = o.out_features,
            .tp = tp,
            .flag1 = o.sequence_parallel ? ", sequence_parallel" : "",
            .flag2 = o.gather_output ? ", gather_output" : ""};
}

LayerSizes SizesOf(const RowParallelLinearOptions &o, std::int64_t tp) {
    return {.in = o.in_features,
            .out = o.out_features,
            .tp = tp,
            .flag1 = o.input_is_parallel ? ", input_is_parallel" : "",
            .flag2 = o.sequence_parallel ? ", sequence_parallel" : ""};
}

class Checker {
public:
    explicit Checker(std::string_view op) : op_(op) {}

    void SetSizes(const LayerSizes &sizes) { sizes_ = sizes; }

    /// The group's tp size; the mesh must be given and the mesh dim must exist.
    std::int64_t TpSize(const TensorParallelGroup &group) const {
        SHARDLINE_CHECK(group.mesh != nullptr, op_, "the tensor-parallel group needs a mesh, got a null mesh");
        const comm::DeviceMesh &mesh = *group.mesh;
        SHARDLINE_CHECK(mesh.ndim() <= kMaxMeshDims, op_, "the mesh may have at most {} dims, got [{}]", kMaxMeshDims,
                        fmt::join(mesh.shape(), ", "));
        if (group.tp_dim == TensorParallelGroup::kNoTensorParallel) {
            return 1;
        }
        SHARDLINE_CHECK(group.tp_dim >= 0 && group.tp_dim < mesh.ndim(), op_,
                        "tp_dim ({}) must name a dim of the mesh [{}] (0 to {}) or be kNoTensorParallel (-1)",
                        group.tp_dim, fmt::join(mesh.shape(), ", "), mesh.ndim() - 1);
        return mesh.shape()[static_cast<std::size_t>(group.tp_dim)];
    }

    void Positive(std::int64_t value, std::string_view name) const {
        SHARDLINE_CHECK_AS(ShapeError, value > 0, op_, "{} must be > 0, got {}", name, value);
    }

    void Divisible(std::int64_t value, std::string_view name, std::int64_t tp) const {
        SHARDLINE_CHECK_AS(ShapeError, value % tp == 0, op_, "{} ({}) must be divisible by tp ({})", name, value, tp);
    }

    /// A view that must be given: a non-null pointer, 1..kMaxViewDims dims (at least `min_ndim`), no negative extent.
    void Required(const TensorView &v, std::string_view name, int min_ndim, std::string_view why = {}) const {
        SHARDLINE_CHECK(v.present(), op_, "{} is required{}, got a null data pointer (shape [{}])", name, why,
                        fmt::join(v.shape, v.shape + std::clamp(v.ndim, 0, kMaxViewDims), ", "));
        CheckDims(v, name, min_ndim);
    }

    /// A view that may be absent; when given, the same checks as Required.
    bool Optional(const TensorView &v, std::string_view name, int min_ndim) const {
        if (!v.present()) {
            return false;
        }
        CheckDims(v, name, min_ndim);
        return true;
    }

    /// The view's shape must be `expected`, which `formula` spells in the layer's terms.
    void Shaped(const TensorView &v, std::string_view name, const Shape &expected, std::string_view formula) const {
        const bool same =
            v.ndim == static_cast<int>(expected.size()) && std::equal(expected.begin(), expected.end(), v.shape);
        SHARDLINE_CHECK_AS(ShapeError, same, op_, "{} must be {} = {} ({}), got {}", name, formula,
                           ShapeToString(expected), Sizes(), Dims(v));
    }

    void SameDType(const TensorView &v, std::string_view name, DType dtype, std::string_view reference) const {
        SHARDLINE_CHECK_AS(DTypeError, v.dtype == dtype, op_, "{} must have {}'s dtype {}, got {}", name, reference,
                           DTypeName(dtype), DTypeName(v.dtype));
    }

    /// A parameter gradient: the compute dtype, or a float32 main grad (overwritten or accumulated into) for half
    /// operands (the GEMMs take no float64 operands with a float32 result).
    void GradDType(const TensorView &v, std::string_view name, DType dtype, GradMode mode) const {
        const bool main_grad = v.dtype == DType::kFloat32 && dtype != DType::kFloat64;
        SHARDLINE_CHECK_AS(DTypeError, v.dtype == dtype || main_grad, op_,
                           "{} must have the compute dtype {} (or be a float32 main grad of half operands), got {} "
                           "(GradMode::{})",
                           name, DTypeName(dtype), DTypeName(v.dtype),
                           mode == GradMode::kOverwrite ? "kOverwrite" : "kAccumulate");
    }

    /// The dtypes the mesh's backend and kernels move: CPU/MPI float32, float64; CUDA/NCCL float32, float16, bfloat16.
    void DeviceDType(DType dtype, DeviceType device, std::string_view name) const {
        if (device == DeviceType::kCPU) {
            SHARDLINE_CHECK_AS(DTypeError, dtype == DType::kFloat32 || dtype == DType::kFloat64, op_,
                               "a CPU (MPI) mesh takes float32 or float64, got {} {} (half types run on CUDA only)",
                               name, DTypeName(dtype));
        } else {
            SHARDLINE_CHECK_AS(
                DTypeError, dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16, op_,
                "a CUDA (NCCL) mesh takes float32, float16 or bfloat16, got {} {}", name, DTypeName(dtype));
        }
    }

    void Cuda(const CudaExecution &cuda) const {
        SHARDLINE_CHECK(
            (cuda.workspace == nullptr) == (cuda.workspace_bytes == 0), op_,
            "a cuBLASLt workspace needs both a pointer and a size (or neither, for the context's), got {} and {} bytes",
            cuda.workspace, cuda.workspace_bytes);
    }

    /// The bias view when the layer adds none: absent, with the reason in the message.
    void NoBias(const TensorView &v, std::string_view name, bool skip_bias_add) const {
        SHARDLINE_CHECK(!v.present(), op_, "{} is given but {}", name,
                        skip_bias_add ? "options.skip_bias_add leaves the bias to the caller"
                                      : "options.bias is false");
    }

    std::string_view op() const { return op_; }

private:
    std::string Sizes() const {
        return fmt::format("in_features {}, out_features {}, tp {}{}{}", sizes_.in, sizes_.out, sizes_.tp, sizes_.flag1,
                           sizes_.flag2);
    }

    void CheckDims(const TensorView &v, std::string_view name, int min_ndim) const {
        SHARDLINE_CHECK_AS(ShapeError, v.ndim >= min_ndim && v.ndim <= kMaxViewDims, op_,
                           "{} must have {} to {} dims, got ndim {}", name, min_ndim, kMaxViewDims, v.ndim);
        for (int d = 0; d < v.ndim; ++d) {
            SHARDLINE_CHECK_AS(ShapeError, v.shape[d] >= 0, op_, "{} has a negative extent: {}", name, Dims(v));
        }
    }

    std::string_view op_;
    LayerSizes sizes_;
};

/// A grouped layer (num_experts > 0): no sequence parallelism (its rows are grouped by expert, not a sequence).
void CheckExperts(const Checker &check, std::int64_t experts, bool sequence_parallel) {
    SHARDLINE_CHECK_AS(ShapeError, experts >= 0, check.op(), "num_experts must be >= 0 (0: a Linear), got {}", experts);
    SHARDLINE_CHECK(experts == 0 || !sequence_parallel, check.op(),
                    "a grouped layer (num_experts {}) takes no sequence_parallel: its rows are grouped by expert",
                    experts);
}

/// The group sizes of a call: int64 [E] exactly when the layer is grouped, which also needs x (`rows`, the view whose
/// dim 0 is the grouped rows) 2-D.
template <class Args>
void CheckGroupSizes(const Checker &check, std::int64_t experts, const Args &args, const TensorView &rows) {
    if (experts == 0) {
        SHARDLINE_CHECK(!args.group_sizes.present(), check.op(),
                        "group_sizes is given but options.num_experts is 0 (a Linear, not a grouped layer)");
        return;
    }
    check.Required(args.group_sizes, "group_sizes", 1, " (options.num_experts > 0)");
    SHARDLINE_CHECK_AS(DTypeError, args.group_sizes.dtype == DType::kInt64, check.op(),
                       "group_sizes must be int64, got {}", DTypeName(args.group_sizes.dtype));
    check.Shaped(args.group_sizes, "group_sizes", {experts}, "[experts]");
    SHARDLINE_CHECK_AS(ShapeError, rows.ndim == 2, check.op(),
                       "a grouped layer takes 2-D rows [tokens, features] grouped by expert, got ndim {}", rows.ndim);
}

/// Checks shared by a layer's forward and backward: sizes, flags, the group and the stream/workspace. Returns tp.
std::int64_t CheckLayer(Checker &check, const ColumnParallelLinearOptions &o, const TensorParallelGroup &group,
                        const CudaExecution &cuda) {
    const std::int64_t tp = check.TpSize(group);
    check.SetSizes(SizesOf(o, tp));
    CheckExperts(check, o.num_experts, o.sequence_parallel);
    check.Positive(o.in_features, "in_features");
    check.Positive(o.out_features, "out_features");
    CheckShardsNotEmpty(check.op(), "out_features", o.out_features, tp);
    SHARDLINE_CHECK(!(o.gather_output && o.sequence_parallel), check.op(),
                    "gather_output and sequence_parallel exclude each other (a sequence-parallel column layer's output "
                    "stays split on out_features for the row-parallel layer that follows)");
    check.Cuda(cuda);
    return tp;
}

std::int64_t CheckLayer(Checker &check, const RowParallelLinearOptions &o, const TensorParallelGroup &group,
                        const CudaExecution &cuda) {
    const std::int64_t tp = check.TpSize(group);
    check.SetSizes(SizesOf(o, tp));
    CheckExperts(check, o.num_experts, o.sequence_parallel);
    check.Positive(o.in_features, "in_features");
    check.Positive(o.out_features, "out_features");
    CheckShardsNotEmpty(check.op(), "in_features", o.in_features, tp);
    SHARDLINE_CHECK(!o.sequence_parallel || o.input_is_parallel, check.op(),
                    "sequence_parallel needs input_is_parallel (Megatron: the input of a sequence-parallel row layer "
                    "comes split on in_features from a column layer)");
    check.Cuda(cuda);
    return tp;
}

/// A layer's local weight and bias shapes, with their formulas for messages. `part` is this rank's part of the sharded
/// feature dim (TensorParallelGroup::ShardSize: out_features/tp or in_features/tp, uneven as torch.chunk).
struct ParamShapes {
    Shape weight;
    std::string_view weight_formula;
    Shape bias;
    std::string_view bias_formula;
};

/// A grouped layer's parameters: the experts dim in front.
ParamShapes Grouped(ParamShapes shapes, std::int64_t experts, std::string_view weight_formula,
                    std::string_view bias_formula) {
    shapes.weight.insert(shapes.weight.begin(), experts);
    shapes.bias.insert(shapes.bias.begin(), experts);
    shapes.weight_formula = weight_formula;
    shapes.bias_formula = bias_formula;
    return shapes;
}

/// `part`: this rank's share of the sharded feature dim (torch.chunk).
ParamShapes LocalParams(const ColumnParallelLinearOptions &o, std::int64_t part) {
    if (o.num_experts > 0) {
        ColumnParallelLinearOptions linear = o;
        linear.num_experts = 0;
        return Grouped(LocalParams(linear, part), o.num_experts, "[experts, out_features/tp, in_features]",
                       "[experts, out_features/tp]");
    }
    return {.weight = {part, o.in_features},
            .weight_formula = "[out_features/tp, in_features]",
            .bias = {part},
            .bias_formula = "[out_features/tp]"};
}

ParamShapes LocalParams(const RowParallelLinearOptions &o, std::int64_t part) {
    if (o.num_experts > 0) {
        RowParallelLinearOptions linear = o;
        linear.num_experts = 0;
        return Grouped(LocalParams(linear, part), o.num_experts, "[experts, out_features, in_features/tp]",
                       "[experts, out_features]");
    }
    return {.weight = {o.out_features, part},
            .weight_formula = "[out_features, in_features/tp]",
            .bias = {o.out_features},
            .bias_formula = "[out_features]"};
}

/// The checks both forwards share: the weight, then the bias (given exactly when the options add one).
template <class Options>
void CheckForwardParams(const Checker &check, const Options &o, std::int64_t part, const TensorView &weight,
                        const TensorView &bias, DType dtype) {
    const ParamShapes shapes = LocalParams(o, part);
    check.Shaped(weight, "weight", shapes.weight, shapes.weight_formula);
    check.SameDType(weight, "weight", dtype, "x");
    if (o.adds_bias()) {
        check.Required(bias, "bias", 1, " (options.bias is set)");
        check.Shaped(bias, "bias", shapes.bias, shapes.bias_formula);
        check.SameDType(bias, "bias", dtype, "x");
    } else {
        check.NoBias(bias, "bias", o.skip_bias_add);
    }
}

/// The checks both backwards share: x, weight and the wanted gradients (present views) against their local shapes
/// (x and dx: `x_shape`, described by `x_formula`).
template <class Options, class Args>
void CheckBackwardOperands(const Checker &check, const Options &o, std::int64_t part, const Args &args, DType dtype,
                           const Shape &x_shape, std::string_view x_formula) {
    const ParamShapes shapes = LocalParams(o, part);
    if (args.x.present()) {
        check.Optional(args.x, "x", 2);
        check.Shaped(args.x, "x", x_shape, x_formula);
        check.SameDType(args.x, "x", dtype, "dy");
    }
    if (args.dx.present()) {
        check.Required(args.weight, "weight", 2, " for dx");
        check.Shaped(args.dx, "dx", x_shape, x_formula);
        check.SameDType(args.dx, "dx", dtype, "dy");
    }
    if (args.weight.present()) {
        check.Optional(args.weight, "weight", 2);
        check.Shaped(args.weight, "weight", shapes.weight, shapes.weight_formula);
        check.SameDType(args.weight, "weight", dtype, "dy");
    }
    if (args.dweight.present()) {
        check.Shaped(args.dweight, "dweight", shapes.weight, shapes.weight_formula);
        check.GradDType(args.dweight, "dweight", dtype, args.param_grads);
    }
    if (args.dbias.present()) {
        SHARDLINE_CHECK(o.adds_bias(), check.op(), "dbias is requested but {}",
                        o.skip_bias_add ? "options.skip_bias_add leaves the bias to the caller"
                                        : "options.bias is false");
        check.Shaped(args.dbias, "dbias", shapes.bias, shapes.bias_formula);
        check.GradDType(args.dbias, "dbias", dtype, args.param_grads);
    }
}

/// What the call runs on, once the options' comm_chunks passed against its rows (`global`: x's leading dims).
template <class Options>
CheckedCall Checked(const Checker &check, const Options &o, const Shape &global, DType dtype, std::int64_t tp) {
    CheckCommChunks(check.op(), o.comm_chunks, o.num_experts, Numel(global) / (o.sequence_parallel ? tp : 1),
                    o.sequence_parallel);
    return {.x_global = WithLast(global, o.in_features), .dtype = dtype};
}

} // namespace

CheckedCall CheckColumnForward(const ColumnParallelLinearOptions &options, const ColumnParallelLinearForwardArgs &args,
                               const TensorParallelGroup &group, const CudaExecution &cuda) {
    Checker check("ColumnParallelLinearForward");
    const std::int64_t tp = CheckLayer(check, options, group, cuda);
    const std::int64_t k = options.in_features;
    const std::int64_t n = options.out_features;
    const std::int64_t n_part = group.ShardSize(n); // this rank's output features (torch.chunk)
    const bool sp = options.sequence_parallel;

    check.Required(args.x, "x", 2);
    check.Required(args.weight, "weight", 2);
    check.Required(args.y, "y", 2);
    const DType dtype = args.x.dtype;
    check.DeviceDType(dtype, group.mesh->world().device_type(), "x");
    Shape lead = ShapeOf(args.x);
    lead.pop_back();
    check.Shaped(args.x, "x", WithLast(lead, k), sp ? "[s/tp, ..., in_features]" : "[s, ..., in_features]");
    Shape global = lead;
    if (sp) {
        global[0] *= tp;
    }
    CheckForwardParams(check, options, n_part, args.weight, args.bias, dtype);
    check.Shaped(args.y, "y", WithLast(global, options.gather_output ? n : n_part),
                 options.gather_output ? "[s, ..., out_features]" : "[s, ..., out_features/tp]");
    check.SameDType(args.y, "y", dtype, "x");
    if (check.Optional(args.x_total, "x_total", 2)) {
        SHARDLINE_CHECK(sp, check.op(),
                        "x_total is given but options.sequence_parallel is false (x itself is the whole input)");
        check.Shaped(args.x_total, "x_total", WithLast(global, k), "[s, ..., in_features]");
        check.SameDType(args.x_total, "x_total", dtype, "x");
    }
    CheckGroupSizes(check, options.num_experts, args, args.x);
    if (args.activation != kernels::LinearActivation::kNone) {
        SHARDLINE_CHECK(options.num_experts == 0, check.op(), "a grouped layer takes no activation");
        SHARDLINE_CHECK(!options.gather_output, check.op(),
                        "activation gelu_tanh applies to this rank's output features (the row layer's parallel "
                        "input): not with gather_output");
        check.Required(args.pre_activation, "pre_activation", 2, " with activation gelu_tanh");
        check.Shaped(args.pre_activation, "pre_activation", WithLast(global, n_part), "[s, ..., out_features/tp]");
        check.SameDType(args.pre_activation, "pre_activation", dtype, "x");
    } else {
        SHARDLINE_CHECK(!args.pre_activation.present(), check.op(),
                        "pre_activation is given but activation is none (set activation = gelu_tanh)");
    }
    return Checked(check, options, global, dtype, tp);
}

CheckedCall CheckColumnBackward(const ColumnParallelLinearOptions &options,
                                const ColumnParallelLinearBackwardArgs &args, const TensorParallelGroup &group,
                                const CudaExecution &cuda) {
    Checker check("ColumnParallelLinearBackward");
    const std::int64_t tp = CheckLayer(check, options, group, cuda);
    const std::int64_t k = options.in_features;
    const std::int64_t n = options.out_features;
    const std::int64_t n_part = group.ShardSize(n);
    const bool sp = options.sequence_parallel;

    check.Required(args.dy, "dy", 2);
    const DType dtype = args.dy.dtype;
    check.DeviceDType(dtype, group.mesh->world().device_type(), "dy");
    Shape global = ShapeOf(args.dy);
    global.pop_back();
    check.Shaped(args.dy, "dy", WithLast(global, options.gather_output ? n : n_part),
                 options.gather_output ? "[s, ..., out_features]" : "[s, ..., out_features/tp]");
    Shape lead = global;
    if (sp) {
        check.Divisible(global[0], "the sequence length dy.shape[0]", tp);
        lead[0] /= tp;
    }
    const std::string_view x_formula = sp ? "[s/tp, ..., in_features]" : "[s, ..., in_features]";
    check.Optional(args.dx, "dx", 2);
    check.Optional(args.dbias, "dbias", 1);
    const bool want_dw = check.Optional(args.dweight, "dweight", 2);
    const bool have_total = check.Optional(args.x_total, "x_total", 2);
    if (have_total) {
        SHARDLINE_CHECK(sp, check.op(),
                        "x_total is given but options.sequence_parallel is false (x itself is the whole input)");
        check.Shaped(args.x_total, "x_total", WithLast(global, k), "[s, ..., in_features]");
        check.SameDType(args.x_total, "x_total", dtype, "dy");
    }
    if (want_dw && !have_total) {
        check.Required(args.x, "x", 2, sp ? " for dweight (or x_total)" : " for dweight");
    }
    CheckBackwardOperands(check, options, n_part, args, dtype, WithLast(lead, k), x_formula);
    CheckGroupSizes(check, options.num_experts, args, args.dy);
    if (check.Optional(args.dx_residual, "dx_residual", 2)) {
        SHARDLINE_CHECK(args.dx.present(), check.op(), "dx_residual is added to dx: it needs dx");
        SHARDLINE_CHECK(options.num_experts == 0, check.op(), "a grouped layer takes no dx_residual");
        check.Shaped(args.dx_residual, "dx_residual", WithLast(lead, k), x_formula);
        check.SameDType(args.dx_residual, "dx_residual", dtype, "dy");
    }
    return Checked(check, options, global, dtype, tp);
}

CheckedCall CheckRowForward(const RowParallelLinearOptions &options, const RowParallelLinearForwardArgs &args,
                            const TensorParallelGroup &group, const CudaExecution &cuda) {
    Checker check("RowParallelLinearForward");
    const std::int64_t tp = CheckLayer(check, options, group, cuda);
    const std::int64_t k = options.in_features;
    const std::int64_t n = options.out_features;
    const std::int64_t k_part = group.ShardSize(k); // this rank's input features (torch.chunk)
    const std::int64_t k_local = options.input_is_parallel ? k_part : k;

    check.Required(args.x, "x", 2);
    check.Required(args.weight, "weight", 2);
    check.Required(args.y, "y", 2);
    const DType dtype = args.x.dtype;
    check.DeviceDType(dtype, group.mesh->world().device_type(), "x");
    Shape global = ShapeOf(args.x);
    global.pop_back();
    check.Shaped(args.x, "x", WithLast(global, k_local),
                 options.input_is_parallel ? "[s, ..., in_features/tp]" : "[s, ..., in_features]");
    CheckForwardParams(check, options, k_part, args.weight, args.bias, dtype);
    Shape y_lead = global;
    if (options.sequence_parallel) {
        check.Divisible(global[0], "the sequence length x.shape[0]", tp);
        y_lead[0] /= tp;
    }
    check.Shaped(args.y, "y", WithLast(y_lead, n),
                 options.sequence_parallel ? "[s/tp, ..., out_features]" : "[s, ..., out_features]");
    check.SameDType(args.y, "y", dtype, "x");
    CheckGroupSizes(check, options.num_experts, args, args.x);
    if (check.Optional(args.residual, "residual", 2)) {
        SHARDLINE_CHECK(options.num_experts == 0, check.op(), "a grouped layer takes no residual");
        check.Shaped(args.residual, "residual", WithLast(y_lead, n),
                     options.sequence_parallel ? "[s/tp, ..., out_features]" : "[s, ..., out_features]");
        check.SameDType(args.residual, "residual", dtype, "x");
    }
    return Checked(check, options, global, dtype, tp);
}

CheckedCall CheckRowBackward(const RowParallelLinearOptions &options, const RowParallelLinearBackwardArgs &args,
                             const TensorParallelGroup &group, const CudaExecution &cuda) {
    Checker check("RowParallelLinearBackward");
    const std::int64_t tp = CheckLayer(check, options, group, cuda);
    const std::int64_t k = options.in_features;
    const std::int64_t n = options.out_features;
    const std::int64_t k_part = group.ShardSize(k); // this rank's input features (torch.chunk)
    const std::int64_t k_local = options.input_is_parallel ? k_part : k;

    check.Required(args.dy, "dy", 2);
    const DType dtype = args.dy.dtype;
    check.DeviceDType(dtype, group.mesh->world().device_type(), "dy");
    Shape global = ShapeOf(args.dy);
    global.pop_back();
    check.Shaped(args.dy, "dy", WithLast(global, n),
                 options.sequence_parallel ? "[s/tp, ..., out_features]" : "[s, ..., out_features]");
    if (options.sequence_parallel) {
        global[0] *= tp;
    }
    const std::string_view x_formula = options.input_is_parallel ? "[s, ..., in_features/tp]" : "[s, ..., in_features]";
    check.Optional(args.dx, "dx", 2);
    check.Optional(args.dbias, "dbias", 1);
    if (check.Optional(args.dweight, "dweight", 2)) {
        check.Required(args.x, "x", 2, " for dweight");
    }
    CheckBackwardOperands(check, options, k_part, args, dtype, WithLast(global, k_local), x_formula);
    CheckGroupSizes(check, options.num_experts, args, args.dy);
    if (args.input_activation != kernels::LinearActivation::kNone) {
        SHARDLINE_CHECK(options.num_experts == 0 || !args.pre_activation_dbias.present(), check.op(),
                        "a grouped layer (num_experts {}) takes no pre_activation_dbias: the column grouped layer's "
                        "backward computes its [experts, out] bias grad from dx",
                        options.num_experts);
        SHARDLINE_CHECK(options.input_is_parallel, check.op(),
                        "input_activation needs input_is_parallel (the activation's output, this layer's input, is "
                        "the column layer's output split on in_features)");
        if (args.dx.present()) {
            check.Required(args.pre_activation, "pre_activation", 2, " with input_activation gelu_tanh and dx");
        }
        if (check.Optional(args.pre_activation, "pre_activation", 2)) {
            check.Shaped(args.pre_activation, "pre_activation", WithLast(global, k_local), x_formula);
            check.SameDType(args.pre_activation, "pre_activation", dtype, "dy");
        }
    } else {
        SHARDLINE_CHECK(!args.pre_activation.present(), check.op(),
                        "pre_activation is given but input_activation is none (set input_activation = gelu_tanh)");
        SHARDLINE_CHECK(!args.pre_activation_dbias.present(), check.op(),
                        "pre_activation_dbias (the column layer's bias grad) needs input_activation = gelu_tanh");
    }
    if (check.Optional(args.pre_activation_dbias, "pre_activation_dbias", 1)) {
        SHARDLINE_CHECK(args.dx.present(), check.op(), "pre_activation_dbias is Σ_rows dx: dx must be given too");
        check.Shaped(args.pre_activation_dbias, "pre_activation_dbias", {k_local}, "[in_features/tp]");
        check.GradDType(args.pre_activation_dbias, "pre_activation_dbias", dtype, args.param_grads);
    }
    return Checked(check, options, global, dtype, tp);
}

} // namespace shardline::functional::detail
