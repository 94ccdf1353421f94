#include "block_copy.h"

#include <cstring>

#include <shardline/config.h>
#if SHARDLINE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include <shardline/core/context.h>
#include <shardline/core/error.h>

namespace shardline::dist::detail {

std::int64_t OuterSize(const Shape &shape, int dim) {
    std::int64_t outer = 1;
    for (int d = 0; d < dim; ++d) {
        outer *= shape[static_cast<std::size_t>(d)];
    }
    return outer;
}

void CopyDimBlock(const Tensor &src, int dim, std::int64_t src_start, Tensor &dst, std::int64_t dst_start,
                  std::int64_t length) {
    constexpr const char *kOp = "DistTensor block copy";
    SHARDLINE_CHECK_AS(ShapeError, src.is_contiguous() && dst.is_contiguous(), kOp,
                       "needs contiguous tensors, got {} and {}", src.ToString(), dst.ToString());
    SHARDLINE_CHECK_AS(ShapeError, src.dtype() == dst.dtype() && src.device() == dst.device(), kOp,
                       "needs one dtype and device, got {} and {}", src.ToString(), dst.ToString());
    SHARDLINE_CHECK_AS(ShapeError, src.rank() == dst.rank() && dim >= 0 && dim < src.rank(), kOp,
                       "dim {} does not fit {} and {}", dim, src.ToString(), dst.ToString());
    for (int d = 0; d < src.rank(); ++d) {
        SHARDLINE_CHECK_AS(ShapeError, d == dim || src.size(d) == dst.size(d), kOp,
                           "{} and {} must agree on every dim but {}", src.ToString(), dst.ToString(), dim);
    }
    SHARDLINE_CHECK_AS(ShapeError,
                       length >= 0 && src_start >= 0 && dst_start >= 0 && src_start + length <= src.size(dim) &&
                           dst_start + length <= dst.size(dim),
                       kOp, "block [{}, {}) of {} into [{}, {}) of {} along dim {} is out of range", src_start,
                       src_start + length, src.ToString(), dst_start, dst_start + length, dst.ToString(), dim);

    std::int64_t inner = static_cast<std::int64_t>(ElementSize(src.dtype()));
    for (int d = dim + 1; d < src.rank(); ++d) {
        inner *= src.size(d);
    }
    const std::int64_t height = OuterSize(src.shape(), dim);
    const std::int64_t width = length * inner;
    const std::int64_t src_pitch = src.size(dim) * inner;
    const std::int64_t dst_pitch = dst.size(dim) * inner;
    if (height == 0 || width == 0) {
        return;
    }
    const char *s = static_cast<const char *>(src.data()) + src_start * inner;
    char *t = static_cast<char *>(dst.data()) + dst_start * inner;
    if (src.device().is_cpu()) {
        if (width == src_pitch && width == dst_pitch) {
            std::memcpy(t, s, static_cast<std::size_t>(width * height));
            return;
        }
        for (std::int64_t row = 0; row < height; ++row) {
            std::memcpy(t + row * dst_pitch, s + row * src_pitch, static_cast<std::size_t>(width));
        }
        return;
    }
#if SHARDLINE_HAVE_CUDA
    cudaStream_t stream = CudaContext::Get(src.device().index).stream();
    if (height == 1 || (width == src_pitch && width == dst_pitch)) {
        SHARDLINE_CHECK_CUDA(
            cudaMemcpyAsync(t, s, static_cast<std::size_t>(width * height), cudaMemcpyDeviceToDevice, stream));
    } else {
        SHARDLINE_CHECK_CUDA(cudaMemcpy2DAsync(t, static_cast<std::size_t>(dst_pitch), s,
                                               static_cast<std::size_t>(src_pitch), static_cast<std::size_t>(width),
                                               static_cast<std::size_t>(height), cudaMemcpyDeviceToDevice, stream));
    }
#else
    SHARDLINE_THROW(DeviceError, kOp, "{} needs a build with CUDA", src.ToString());
#endif
}

Tensor NarrowCopy(const Tensor &src, int dim, std::int64_t start, std::int64_t length) {
    Shape shape = src.shape();
    shape[static_cast<std::size_t>(dim)] = length;
    Tensor out = Tensor::Empty(std::move(shape), src.dtype(), src.device());
    CopyDimBlock(src, dim, start, out, 0, length);
    return out;
}

} // namespace shardline::dist::detail
