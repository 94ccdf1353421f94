// Optimizer steps: argument and hyper-parameter checks (torch's messages' conditions), then dispatch. The kernels live
// in cpu/ and cuda/. The Multi ops check each entry as the single-tensor op checks its arguments, naming the entry
// ("tensors[3].exp_avg"), and that the entries share one device and no memory.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/optim.h>

#include "checks.h"

namespace shardline::kernels {
namespace {

/// The names of one entry's arguments in messages: "param" for a single-tensor op, "tensors[3].param" for a Multi one.
class Names {
public:
    Names() = default;
    explicit Names(std::size_t index) : prefix_("tensors[" + std::to_string(index) + "].") {}
    std::string operator()(std::string_view field) const { return prefix_ + std::string(field); }

private:
    std::string prefix_;
};

/// The master parameter: float32 (float64 too on the CPU).
void CheckMaster(const Tensor& param, std::string_view name, std::string_view op) {
    CheckTensor(param, op, name);
    if (param.device().is_cpu()) {
        SHARDLINE_CHECK_AS(DTypeError, param.dtype() == DType::kFloat32 || param.dtype() == DType::kFloat64, op,
                           "{} must be a float32 or float64 master on the CPU, got {}", name, param.ToString());
    } else {
        SHARDLINE_CHECK_AS(DTypeError, param.dtype() == DType::kFloat32, op,
                           "{} must be a float32 master on CUDA (keep a bf16/fp16 model copy in model_param), got {}",
                           name, param.ToString());
    }
}

/// A tensor that goes with the master element for element: same shape, dtype and device.
void CheckState(const Tensor& t, std::string_view name, const Tensor& param, std::string_view param_name,
                std::string_view op) {
    CheckLike(t, name, param, param_name, op);
    CheckShape(t, param.shape(), op, name);
}

void CheckModelParam(const Tensor* model_param, const Tensor& param, const Names& names, std::string_view op) {
    if (model_param == nullptr) {
        return;
    }
    const std::string name = names("model_param");
    CheckTensor(*model_param, op, name);
    CheckDeviceDType(*model_param, op, name);
    CheckSameDevice(*model_param, name, param, names("param"), op);
    CheckShape(*model_param, param.shape(), op, name);
    SHARDLINE_CHECK(param.numel() == 0 || model_param->dtype() == param.dtype() || model_param->data() != param.data(),
                    op, "{} {} must not share memory with {} {} (another dtype)", name, model_param->ToString(),
                    names("param"), param.ToString());
}

/// SgdStep's per-tensor checks (momentum_buffer only when momentum != 0).
void CheckSgdTensors(const Tensor& param, const Tensor& grad, const Tensor* momentum_buffer, const Tensor* model_param,
                     double momentum, const Names& names, std::string_view op) {
    const std::string param_name = names("param");
    CheckMaster(param, param_name, op);
    CheckState(grad, names("grad"), param, param_name, op);
    if (momentum != 0.0) {
        SHARDLINE_CHECK(momentum_buffer != nullptr, op, "momentum {} needs a {}", momentum, names("momentum_buffer"));
        CheckState(*momentum_buffer, names("momentum_buffer"), param, param_name, op);
    }
    CheckModelParam(model_param, param, names, op);
}

void CheckSgdHyper(double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                   std::string_view op) {
    SHARDLINE_CHECK(lr >= 0.0, op, "lr must be >= 0, got {}", lr);
    SHARDLINE_CHECK(momentum >= 0.0, op, "momentum must be >= 0, got {}", momentum);
    SHARDLINE_CHECK(weight_decay >= 0.0, op, "weight_decay must be >= 0, got {}", weight_decay);
    SHARDLINE_CHECK(!nesterov || (momentum > 0.0 && dampening == 0.0), op,
                    "nesterov needs momentum > 0 and dampening == 0, got momentum {} and dampening {}", momentum,
                    dampening);
}

/// AdamWStep's per-tensor checks.
void CheckAdamWTensors(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                       const Tensor* model_param, std::int64_t step, const Names& names, std::string_view op) {
    const std::string param_name = names("param");
    CheckMaster(param, param_name, op);
    CheckState(grad, names("grad"), param, param_name, op);
    CheckState(exp_avg, names("exp_avg"), param, param_name, op);
    CheckState(exp_avg_sq, names("exp_avg_sq"), param, param_name, op);
    SHARDLINE_CHECK(step >= 1, op, "{} must be >= 1 (1-based, for the bias corrections), got {}", names("step"), step);
    CheckModelParam(model_param, param, names, op);
}

void CheckAdamWHyper(double lr, double beta1, double beta2, double eps, double weight_decay, std::string_view op) {
    SHARDLINE_CHECK(lr >= 0.0, op, "lr must be >= 0, got {}", lr);
    SHARDLINE_CHECK(eps >= 0.0, op, "eps must be >= 0, got {}", eps);
    SHARDLINE_CHECK(beta1 >= 0.0 && beta1 < 1.0, op, "beta1 must be in [0, 1), got {}", beta1);
    SHARDLINE_CHECK(beta2 >= 0.0 && beta2 < 1.0, op, "beta2 must be in [0, 1), got {}", beta2);
    SHARDLINE_CHECK(weight_decay >= 0.0, op, "weight_decay must be >= 0, got {}", weight_decay);
}

/// The memory of one tensor of one entry, for the overlap check.
struct Span {
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;
    std::size_t entry = 0;
    std::string_view field;
    const Tensor* tensor = nullptr;
};

void AddSpan(std::vector<Span>& spans, const Tensor* t, std::size_t entry, std::string_view field) {
    if (t != nullptr && t->numel() > 0) {
        const auto begin = reinterpret_cast<std::uintptr_t>(t->data());
        spans.push_back({.begin = begin, .end = begin + t->nbytes(), .entry = entry, .field = field, .tensor = t});
    }
}

/// No two entries share memory: the Multi ops update the entries in any order (in parallel on CUDA), so an overlap
/// would give another result than the single-tensor op run entry after entry. Tensors of one entry may overlap as
/// the single-tensor op allows.
void CheckDisjointEntries(std::vector<Span> spans, std::string_view op) {
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
    // Sweep in address order keeping the span that reaches furthest: the first span to overlap another entry's
    // overlaps that one (were it another, the two earlier spans of different entries would have overlapped first).
    const Span* furthest = nullptr;
    for (const Span& s : spans) {
        SHARDLINE_CHECK(furthest == nullptr || s.begin >= furthest->end || s.entry == furthest->entry, op,
                        "tensors[{}].{} {} and tensors[{}].{} {} share memory; the entries must not overlap",
                        furthest->entry, furthest->field, furthest->tensor->ToString(), s.entry, s.field,
                        s.tensor->ToString());
        if (furthest == nullptr || s.end > furthest->end) {
            furthest = &s;
        }
    }
}

/// At least one entry, all on the first entry's device.
template <class Entry> void CheckEntryList(std::span<const Entry> tensors, std::string_view op) {
    SHARDLINE_CHECK(!tensors.empty(), op, "tensors must hold at least one entry, got an empty list");
    for (std::size_t i = 1; i < tensors.size(); ++i) {
        CheckSameDevice(tensors[i].param, Names(i)("param"), tensors[0].param, "tensors[0].param", op);
    }
}

template <class Entry> bool AnyElements(std::span<const Entry> tensors) {
    return std::any_of(tensors.begin(), tensors.end(), [](const Entry& e) { return e.param.numel() > 0; });
}

} // namespace

void SgdStep(const SgdStepArgs& args) {
    constexpr std::string_view kOp = SgdStepOp::kName;
    CheckSgdTensors(args.param, args.grad, args.momentum_buffer, args.model_param, args.momentum, Names(), kOp);
    CheckSgdHyper(args.lr, args.momentum, args.dampening, args.weight_decay, args.nesterov, kOp);
    if (args.param.numel() > 0) {
        Dispatch<SgdStepOp>(args.param.device().type, args);
    }
}

void SgdStepMulti(const SgdStepMultiArgs& args) {
    constexpr std::string_view kOp = SgdStepMultiOp::kName;
    CheckSgdHyper(args.lr, args.momentum, args.dampening, args.weight_decay, args.nesterov, kOp);
    CheckEntryList(args.tensors, kOp);
    const bool use_momentum = args.momentum != 0.0;
    std::vector<Span> spans;
    for (std::size_t i = 0; i < args.tensors.size(); ++i) {
        const SgdStepTensor& t = args.tensors[i];
        CheckSgdTensors(t.param, t.grad, t.momentum_buffer, t.model_param, args.momentum, Names(i), kOp);
        AddSpan(spans, &t.param, i, "param");
        AddSpan(spans, &t.grad, i, "grad");
        AddSpan(spans, use_momentum ? t.momentum_buffer : nullptr, i, "momentum_buffer");
        AddSpan(spans, t.model_param, i, "model_param");
    }
    CheckDisjointEntries(std::move(spans), kOp);
    if (AnyElements(args.tensors)) {
        Dispatch<SgdStepMultiOp>(args.tensors[0].param.device().type, args);
    }
}

void AdamWStep(const AdamWStepArgs& args) {
    constexpr std::string_view kOp = AdamWStepOp::kName;
    CheckAdamWTensors(args.param, args.grad, args.exp_avg, args.exp_avg_sq, args.model_param, args.step, Names(), kOp);
    CheckAdamWHyper(args.lr, args.beta1, args.beta2, args.eps, args.weight_decay, kOp);
    if (args.param.numel() > 0) {
        Dispatch<AdamWStepOp>(args.param.device().type, args);
    }
}

void AdamWStepMulti(const AdamWStepMultiArgs& args) {
    constexpr std::string_view kOp = AdamWStepMultiOp::kName;
    CheckAdamWHyper(args.lr, args.beta1, args.beta2, args.eps, args.weight_decay, kOp);
    CheckEntryList(args.tensors, kOp);
    std::vector<Span> spans;
    for (std::size_t i = 0; i < args.tensors.size(); ++i) {
        const AdamWStepTensor& t = args.tensors[i];
        CheckAdamWTensors(t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.model_param, t.step, Names(i), kOp);
        AddSpan(spans, &t.param, i, "param");
        AddSpan(spans, &t.grad, i, "grad");
        AddSpan(spans, &t.exp_avg, i, "exp_avg");
        AddSpan(spans, &t.exp_avg_sq, i, "exp_avg_sq");
        AddSpan(spans, t.model_param, i, "model_param");
    }
    CheckDisjointEntries(std::move(spans), kOp);
    if (AnyElements(args.tensors)) {
        Dispatch<AdamWStepMultiOp>(args.tensors[0].param.device().type, args);
    }
}

} // namespace shardline::kernels
