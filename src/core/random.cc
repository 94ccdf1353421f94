#include <shardline/core/error.h>
#include <shardline/core/random.h>

#include "cuda_backend.h"
#include "host_convert.h"
#include "philox.h"

namespace shardline {

std::uint64_t HashName(std::string_view name) {
    std::uint64_t h = 0xcbf29ce484222325ULL;
    for (const char c : name) {
        h ^= static_cast<unsigned char>(c);
        h *= 0x100000001b3ULL;
    }
    return h;
}

void FillRandomShard(Tensor& tensor, const RandomSpec& spec, const Shape& global_shape, const Shape& global_offset) {
    constexpr std::string_view kOp = "FillRandom";
    SHARDLINE_CHECK(tensor.defined(), kOp, "tensor '{}' is undefined", spec.name);
    SHARDLINE_CHECK_AS(ShapeError, tensor.is_contiguous(), kOp, "tensor '{}' must be contiguous, got {}", spec.name,
                       tensor.ToString());
    const int rank = tensor.rank();
    SHARDLINE_CHECK_AS(ShapeError, rank <= detail::kMaxRandomRank, kOp, "supports rank <= {}, got {}",
                       detail::kMaxRandomRank, rank);
    SHARDLINE_CHECK_AS(ShapeError,
                       static_cast<int>(global_shape.size()) == rank && static_cast<int>(global_offset.size()) == rank,
                       kOp, "global shape {} and offset {} must have the tensor's rank {}", ShapeToString(global_shape),
                       ShapeToString(global_offset), rank);
    for (int d = 0; d < rank; ++d) {
        SHARDLINE_CHECK_AS(ShapeError, global_offset[d] >= 0 && global_offset[d] + tensor.shape()[d] <= global_shape[d],
                           kOp, "shard {} at offset {} does not fit global shape {} (dim {})",
                           ShapeToString(tensor.shape()), ShapeToString(global_offset), ShapeToString(global_shape), d);
    }
    if (spec.distribution == RandomDistribution::kInteger) {
        SHARDLINE_CHECK(spec.a <= spec.b && spec.a == static_cast<double>(static_cast<std::int64_t>(spec.a)) &&
                            spec.b == static_cast<double>(static_cast<std::int64_t>(spec.b)),
                        kOp, "integer bounds must be integers with a <= b, got [{}, {}]", spec.a, spec.b);
    }

    detail::RandomKernelArgs args{};
    const std::uint64_t key = HashName(spec.name) ^ (spec.seed * 0x9E3779B97F4A7C15ULL);
    args.key[0] = static_cast<std::uint32_t>(key);
    args.key[1] = static_cast<std::uint32_t>(key >> 32);
    args.distribution = spec.distribution;
    args.a = spec.a;
    args.b = spec.b;
    args.rank = rank;
    const Shape global_strides = ContiguousStrides(global_shape);
    for (int d = 0; d < rank; ++d) {
        args.local_shape[d] = tensor.shape()[d];
        args.global_stride[d] = global_strides[d];
        args.global_offset[d] = global_offset[d];
    }

    const std::int64_t n = tensor.numel();
    if (n == 0) {
        return;
    }
    if (tensor.device().is_cpu()) {
        for (std::int64_t i = 0; i < n; ++i) {
            detail::StoreFromDouble(tensor.data(), tensor.dtype(), i,
                                    detail::RandomValueAt(args, detail::GlobalIndexOf(args, i)));
        }
    } else {
#if SHARDLINE_HAVE_CUDA
        detail::CudaFillRandom(tensor.data(), tensor.dtype(), n, args, tensor.device().index);
#endif
    }
}

void FillRandom(Tensor& tensor, const RandomSpec& spec) {
    FillRandomShard(tensor, spec, tensor.shape(), Shape(tensor.shape().size(), 0));
}

} // namespace shardline
