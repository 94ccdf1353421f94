// Optimizer steps: argument and hyper-parameter checks (torch's messages' conditions), then dispatch. The kernels live
// in cpu/ and cuda/.

#include <shardline/kernels/dispatcher.h>
#include <shardline/kernels/optim.h>

#include "checks.h"

namespace shardline::kernels {
namespace {

/// The master parameter: float32 (float64 too on the CPU).
void CheckMaster(const Tensor& param, std::string_view op) {
    CheckTensor(param, op, "param");
    if (param.device().is_cpu()) {
        SHARDLINE_CHECK_AS(DTypeError, param.dtype() == DType::kFloat32 || param.dtype() == DType::kFloat64, op,
                           "param must be a float32 or float64 master on the CPU, got {}", param.ToString());
    } else {
        SHARDLINE_CHECK_AS(
            DTypeError, param.dtype() == DType::kFloat32, op,
            "param must be a float32 master on CUDA (keep a bf16/fp16 model copy in model_param), got {}",
            param.ToString());
    }
}

/// A tensor that goes with the master element for element: same shape, dtype and device.
void CheckState(const Tensor& t, std::string_view name, const Tensor& param, std::string_view op) {
    CheckLike(t, name, param, "param", op);
    CheckShape(t, param.shape(), op, name);
}

void CheckModelParam(const Tensor* model_param, const Tensor& param, std::string_view op) {
    if (model_param == nullptr) {
        return;
    }
    CheckTensor(*model_param, op, "model_param");
    CheckDeviceDType(*model_param, op, "model_param");
    CheckSameDevice(*model_param, "model_param", param, "param", op);
    CheckShape(*model_param, param.shape(), op, "model_param");
    SHARDLINE_CHECK(param.numel() == 0 || model_param->dtype() == param.dtype() || model_param->data() != param.data(),
                    op, "model_param {} must not share memory with param {} (another dtype)", model_param->ToString(),
                    param.ToString());
}

} // namespace

void SgdStep(const SgdStepArgs& args) {
    constexpr std::string_view kOp = SgdStepOp::kName;
    CheckMaster(args.param, kOp);
    CheckState(args.grad, "grad", args.param, kOp);
    SHARDLINE_CHECK(args.lr >= 0.0, kOp, "lr must be >= 0, got {}", args.lr);
    SHARDLINE_CHECK(args.momentum >= 0.0, kOp, "momentum must be >= 0, got {}", args.momentum);
    SHARDLINE_CHECK(args.weight_decay >= 0.0, kOp, "weight_decay must be >= 0, got {}", args.weight_decay);
    SHARDLINE_CHECK(!args.nesterov || (args.momentum > 0.0 && args.dampening == 0.0), kOp,
                    "nesterov needs momentum > 0 and dampening == 0, got momentum {} and dampening {}", args.momentum,
                    args.dampening);
    if (args.momentum != 0.0) {
        SHARDLINE_CHECK(args.momentum_buffer != nullptr, kOp, "momentum {} needs a momentum_buffer", args.momentum);
        CheckState(*args.momentum_buffer, "momentum_buffer", args.param, kOp);
    }
    CheckModelParam(args.model_param, args.param, kOp);
    if (args.param.numel() > 0) {
        Dispatch<SgdStepOp>(args.param.device().type, args);
    }
}

void AdamWStep(const AdamWStepArgs& args) {
    constexpr std::string_view kOp = AdamWStepOp::kName;
    CheckMaster(args.param, kOp);
    CheckState(args.grad, "grad", args.param, kOp);
    CheckState(args.exp_avg, "exp_avg", args.param, kOp);
    CheckState(args.exp_avg_sq, "exp_avg_sq", args.param, kOp);
    SHARDLINE_CHECK(args.lr >= 0.0, kOp, "lr must be >= 0, got {}", args.lr);
    SHARDLINE_CHECK(args.eps >= 0.0, kOp, "eps must be >= 0, got {}", args.eps);
    SHARDLINE_CHECK(args.beta1 >= 0.0 && args.beta1 < 1.0, kOp, "beta1 must be in [0, 1), got {}", args.beta1);
    SHARDLINE_CHECK(args.beta2 >= 0.0 && args.beta2 < 1.0, kOp, "beta2 must be in [0, 1), got {}", args.beta2);
    SHARDLINE_CHECK(args.weight_decay >= 0.0, kOp, "weight_decay must be >= 0, got {}", args.weight_decay);
    SHARDLINE_CHECK(args.step >= 1, kOp, "step must be >= 1 (1-based, for the bias corrections), got {}", args.step);
    CheckModelParam(args.model_param, args.param, kOp);
    if (args.param.numel() > 0) {
        Dispatch<AdamWStepOp>(args.param.device().type, args);
    }
}

} // namespace shardline::kernels
