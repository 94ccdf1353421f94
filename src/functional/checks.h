#pragma once

// Private to src/functional: the validation of a parallel-Linear call. Every check runs on the calling rank before
// anything is issued, so a configuration that every rank gets wrong raises on every rank and none is left waiting in a
// collective. Each Check* function validates one entry point's options, group, views and stream/workspace, and returns
// what the call runs on: the global shape of x and the compute dtype.

#include <cstdint>
#include <string_view>

#include <shardline/core/dtype.h>
#include <shardline/core/tensor.h>
#include <shardline/functional/parallel_linear.h>

namespace shardline::functional::detail {

/// What a validated call runs on.
struct CheckedCall {
    Shape x_global; ///< [s, ..., in_features], the whole sequence
    DType dtype = DType::kFloat32;
};

CheckedCall CheckColumnForward(const ColumnParallelLinearOptions &options, const ColumnParallelLinearForwardArgs &args,
                               const TensorParallelGroup &group, const CudaExecution &cuda);
CheckedCall CheckColumnBackward(const ColumnParallelLinearOptions &options,
                                const ColumnParallelLinearBackwardArgs &args, const TensorParallelGroup &group,
                                const CudaExecution &cuda);
CheckedCall CheckRowForward(const RowParallelLinearOptions &options, const RowParallelLinearForwardArgs &args,
                            const TensorParallelGroup &group, const CudaExecution &cuda);
CheckedCall CheckRowBackward(const RowParallelLinearOptions &options, const RowParallelLinearBackwardArgs &args,
                             const TensorParallelGroup &group, const CudaExecution &cuda);

/// The view's shape as a Shape.
inline Shape ShapeOf(const TensorView &v) { return Shape(v.shape, v.shape + v.ndim); }

} // namespace shardline::functional::detail
