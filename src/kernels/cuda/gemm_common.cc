#include "gemm_common.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include <shardline/core/error.h>
#include <shardline/core/tensor.h>

#include "epilogue_kernels.h"

namespace shardline::kernels::cuda {
namespace {

const char *Offset(const void *base, std::int64_t elements, DType dtype) {
    if (base == nullptr) {
        return nullptr;
    }
    return static_cast<const char *>(base) + elements * static_cast<std::int64_t>(ElementSize(dtype));
}
char *Offset(void *base, std::int64_t elements, DType dtype) {
    if (base == nullptr) {
        return nullptr;
    }
    return static_cast<char *>(base) + elements * static_cast<std::int64_t>(ElementSize(dtype));
}

} // namespace

cudaDataType_t CudaDataType(DType dtype, std::string_view op) {
    switch (dtype) {
    case DType::kFloat32:
        return CUDA_R_32F;
    case DType::kFloat16:
        return CUDA_R_16F;
    case DType::kBFloat16:
        return CUDA_R_16BF;
    case DType::kFloat64:
    case DType::kInt64:
        break;
    }
    SHARDLINE_THROW(DTypeError, op, "CUDA kernels take float32, float16 or bfloat16, got {}", DTypeName(dtype));
}

cublasComputeType_t GemmComputeType(const GemmParams &p, const CudaContext &ctx) {
    // fp32 is true fp32 unless TF32 was opted into (SHARDLINE_ALLOW_TF32=1), as in PyTorch; half types always
    // accumulate in fp32.
    if (p.a_type == DType::kFloat32 && ctx.allow_tf32()) {
        return CUBLAS_COMPUTE_32F_FAST_TF32;
    }
    return CUBLAS_COMPUTE_32F;
}

void CheckCudaGemm(const GemmParams &p, std::string_view op) {
    SHARDLINE_CHECK_AS(DeviceError, p.device.is_cuda(), op, "the CUDA Gemm got a {} problem", ToString(p.device));
    SHARDLINE_CHECK_AS(DTypeError, p.compute != GemmCompute::kFloat64, op,
                       "float64 compute is not supported on CUDA (m={} n={} k={})", p.m, p.n, p.k);
    (void)CudaDataType(p.a_type, op);
    (void)CudaDataType(p.b_type, op);
    (void)CudaDataType(p.c_type, op);
    const bool has_bias_vector = GemmUsesBias(p);
    if (has_bias_vector) {
        (void)CudaDataType(p.bias_type, op);
    }
    SHARDLINE_CHECK_AS(ShapeError, p.batch_count == 1 || p.stride_c != 0 || p.m == 0 || p.n == 0, op,
                       "a batched GEMM needs stride_c > 0 (a broadcast output would race), got batch={} stride_c=0",
                       p.batch_count);
}

void ColumnSum(CudaContext &ctx, const void *x, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t ld,
               void *out, DType out_dtype, bool accumulate, ReduceImpl impl) {
    ColumnSumOn(ctx, ctx.stream(), x, dtype, rows, cols, ld, out, out_dtype, accumulate, impl);
}

void BiasGradColumnSum(const LinearBackwardBiasArgs &args, ReduceImpl impl) {
    const std::int64_t cols = args.dbias.numel();
    const std::int64_t rows = cols == 0 ? 0 : args.dy.numel() / cols;
    ColumnSum(CudaContext::Get(args.dy.device().index), args.dy.data(), args.dy.dtype(), rows, cols, cols,
              args.dbias.data(), args.dbias.dtype(), args.accumulate, impl);
}

void ColumnSumOn(CudaContext &ctx, cudaStream_t stream, const void *x, DType dtype, std::int64_t rows,
                 std::int64_t cols, std::int64_t ld, void *out, DType out_dtype, bool accumulate, ReduceImpl impl) {
    if (cols <= 0) {
        return;
    }
    const ColumnSumPlan plan =
        PlanColumnSum(x, dtype, rows, cols, ld, ctx.multiprocessors(), impl == ReduceImpl::kVectorized);
    float *partials = nullptr;
    Tensor fallback;
    if (plan.partial_elems > 0) {
        partials = ReduceScratch(ctx, stream, static_cast<std::size_t>(plan.partial_elems));
        if (partials == nullptr) {
            // The stream is being captured and its scratch is too small to grow now: a stream-ordered allocation,
            // which the graph records as its own allocation node. (Its release is a cudaFreeAsync queued on the
            // context stream after the kernels; here that stream is the one being captured.)
            fallback = Tensor::Empty(Shape{plan.partial_elems}, DType::kFloat32, Device::CUDA(ctx.device()));
            partials = static_cast<float *>(fallback.data());
        }
    }
    SHARDLINE_CHECK_CUDA(LaunchColumnSum(plan, x, dtype, rows, cols, ld, out, out_dtype, accumulate, partials, stream));
}

float *ReduceScratch(CudaContext &ctx, cudaStream_t stream, std::size_t floats) {
    // One grow-only buffer per (device, stream): the kernels using it are ordered by their stream, so consecutive
    // reductions on one stream may share it, and a side stream gets its own. A steady-state step therefore allocates
    // nothing per call (the pool's cudaMallocAsync would cost host time on every bias grad). Growing frees the old
    // buffer with cudaFree, which waits for the device: it happens once per larger shape, never while capturing.
    struct Entry {
        int device;
        cudaStream_t stream;
        float *data;
        std::size_t floats;
    };
    static std::mutex mutex;
    static std::vector<Entry> *entries = new std::vector<Entry>(); // never destroyed (static teardown vs the runtime)
    std::lock_guard lock(mutex);
    Entry *entry = nullptr;
    for (Entry &e : *entries) {
        if (e.device == ctx.device() && e.stream == stream) {
            entry = &e;
            break;
        }
    }
    if (entry != nullptr && entry->floats >= floats) {
        return entry->data;
    }
    // cudaMalloc/cudaFree are not allowed while this thread captures (the compute stream, or the side stream that
    // joined its capture).
    for (const cudaStream_t s : {stream, ctx.stream()}) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        SHARDLINE_CHECK_CUDA(cudaStreamIsCapturing(s, &capture));
        if (capture != cudaStreamCaptureStatusNone) {
            return nullptr;
        }
    }
    // At least 1 MiB, and 1.5x the request, so that a few growing shapes settle quickly.
    const std::size_t want = std::max<std::size_t>(floats + floats / 2, std::size_t{1} << 18);
    float *data = nullptr;
    SHARDLINE_CHECK_CUDA(cudaMalloc(reinterpret_cast<void **>(&data), want * sizeof(float)));
    if (entry == nullptr) {
        entries->push_back(Entry{ctx.device(), stream, data, want});
    } else {
        SHARDLINE_CHECK_CUDA(cudaFree(entry->data));
        entry->data = data;
        entry->floats = want;
    }
    return data;
}

void RowSum(CudaContext &ctx, const void *x, DType dtype, std::int64_t rows, std::int64_t cols, std::int64_t ld,
            void *out, DType out_dtype, bool accumulate) {
    SHARDLINE_CHECK_CUDA(LaunchRowSum(x, dtype, rows, cols, ld, out, out_dtype, accumulate, ctx.stream()));
}

void RunUnfusedEpilogue(const GemmParams &p, CudaContext &ctx, ReduceImpl impl) {
    if (p.epilogue == GemmEpilogue::kNone) {
        return;
    }
    const cudaStream_t stream = ctx.stream();
    for (std::int64_t b = 0; b < p.batch_count; ++b) {
        const bool first = b == 0;
        char *d = Offset(p.c, b * p.stride_c, p.c_type);
        switch (p.epilogue) {
        case GemmEpilogue::kNone:
            return;
        case GemmEpilogue::kBias:
            SHARDLINE_CHECK_CUDA(LaunchBiasAdd(d, p.c_type, p.m, p.n, p.ldc, p.bias, p.bias_type, stream));
            break;
        case GemmEpilogue::kGeluAuxBias: {
            char *aux = Offset(p.aux, b * p.ldaux * p.n, p.c_type);
            SHARDLINE_CHECK_CUDA(LaunchBiasGeluAux(d, p.c_type, p.m, p.n, p.ldc, p.bias,
                                                   p.bias != nullptr ? p.bias_type : p.c_type, aux, p.ldaux, stream));
            break;
        }
        case GemmEpilogue::kBGradB: {
            // bias[j] = Σ_kk op(B)[kk, j]. With trans_b, B is stored n×k column-major, op(B)[kk, j] = B[j + kk·ldb]:
            // a row-major k×n view (ld ldb) summed down its columns. Without, B is stored k×n, op(B)[kk, j] =
            // B[kk + j·ldb]: a row-major n×k view summed along its rows.
            const char *bm = Offset(p.b, b * p.stride_b, p.b_type);
            if (p.trans_b) {
                ColumnSum(ctx, bm, p.b_type, p.k, p.n, p.ldb, p.bias, p.bias_type, !first, impl);
            } else {
                RowSum(ctx, bm, p.b_type, p.n, p.k, p.ldb, p.bias, p.bias_type, !first);
            }
            break;
        }
        case GemmEpilogue::kDGeluBGrad: {
            // D = D ⊙ gelu'(aux), then bias[i] = Σ_j D(i, j): column-major D m×n is a row-major n×m view (ld ldc)
            // summed down its columns.
            const char *aux = Offset(static_cast<const void *>(p.aux), b * p.ldaux * p.n, p.c_type);
            SHARDLINE_CHECK_CUDA(LaunchDGelu(d, p.c_type, p.m, p.n, p.ldc, aux, p.ldaux, stream));
            ColumnSum(ctx, d, p.c_type, p.n, p.m, p.ldc, p.bias, p.bias_type, !first, impl);
            break;
        }
        case GemmEpilogue::kDGelu: {
            const char *aux = Offset(static_cast<const void *>(p.aux), b * p.ldaux * p.n, p.c_type);
            SHARDLINE_CHECK_CUDA(LaunchDGelu(d, p.c_type, p.m, p.n, p.ldc, aux, p.ldaux, stream));
            break;
        }
        }
    }
}

GemmParams ApartGemmParams(const GemmParams &p) {
    GemmParams apart = p;
    apart.aux = nullptr;
    apart.ldaux = 0;
    switch (p.epilogue) {
    case GemmEpilogue::kGeluAuxBias:
        // The bias GEMM writes the pre-activation straight into aux; GELU then reads it.
        apart.epilogue = p.bias != nullptr ? GemmEpilogue::kBias : GemmEpilogue::kNone;
        apart.c = p.aux;
        apart.ldc = p.ldaux;
        return apart;
    case GemmEpilogue::kDGeluBGrad:
        // The dgrad with its GELU grad (fused or apart, as kDGelu's own plan measured), then the column sum of D.
        apart.epilogue = GemmEpilogue::kDGelu;
        apart.aux = p.aux;
        apart.ldaux = p.ldaux;
        apart.bias = nullptr;
        return apart;
    case GemmEpilogue::kNone:
    case GemmEpilogue::kBias:
    case GemmEpilogue::kBGradB:
    case GemmEpilogue::kDGelu:
        break;
    }
    apart.epilogue = GemmEpilogue::kNone;
    apart.bias = nullptr;
    return apart;
}

void RunApartEpilogue(const GemmParams &p, CudaContext &ctx, ReduceImpl impl) {
    const cudaStream_t stream = ctx.stream();
    switch (p.epilogue) {
    case GemmEpilogue::kGeluAuxBias:
        SHARDLINE_CHECK_CUDA(LaunchGeluFromAux(p.c, p.c_type, p.m, p.n, p.ldc, p.aux, p.ldaux, stream));
        return;
    case GemmEpilogue::kDGeluBGrad:
        // D already holds the GELU grad: bias[i] = Σ_j D(i, j), a row-major n×m view summed down its columns.
        ColumnSum(ctx, p.c, p.c_type, p.n, p.m, p.ldc, p.bias, p.bias_type, false, impl);
        return;
    case GemmEpilogue::kNone:
    case GemmEpilogue::kBias:
    case GemmEpilogue::kBGradB:
    case GemmEpilogue::kDGelu:
        RunUnfusedEpilogue(p, ctx, impl);
        return;
    }
}

GemmParams InPlaceC(const GemmParams &p, CudaContext &ctx) {
    if (!GemmHasSeparateC(p)) {
        return p;
    }
    const auto elem = static_cast<std::size_t>(ElementSize(p.c_type));
    if (p.m > 0 && p.n > 0) {
        for (std::int64_t b = 0; b < p.batch_count; ++b) {
            // Column-major m×n: n columns of m elements, ldc_in / ldc elements apart.
            SHARDLINE_CHECK_CUDA(
                cudaMemcpy2DAsync(Offset(p.c, b * p.stride_c, p.c_type), static_cast<std::size_t>(p.ldc) * elem,
                                  Offset(p.c_in, b * p.stride_c_in, p.c_type),
                                  static_cast<std::size_t>(p.ldc_in) * elem, static_cast<std::size_t>(p.m) * elem,
                                  static_cast<std::size_t>(p.n), cudaMemcpyDeviceToDevice, ctx.stream()));
        }
    }
    GemmParams in_place = p;
    in_place.c_in = nullptr;
    in_place.ldc_in = 0;
    in_place.stride_c_in = 0;
    return in_place;
}

void RunDegenerateGemm(const GemmParams &params, CudaContext &ctx, ReduceImpl impl) {
    const GemmParams p = InPlaceC(params, ctx);
    if (p.m > 0 && p.n > 0) {
        // k == 0: the product is empty, D = beta·C (beta == 0 writes zeros without reading C).
        for (std::int64_t b = 0; b < p.batch_count; ++b) {
            SHARDLINE_CHECK_CUDA(LaunchScaleMatrix(Offset(p.c, b * p.stride_c, p.c_type), p.c_type, p.m, p.n, p.ldc,
                                                   static_cast<float>(p.beta), ctx.stream()));
        }
    }
    RunUnfusedEpilogue(p, ctx, impl);
}

void CublasGemmPlain(const GemmParams &params, CudaContext &ctx) {
    const GemmParams p = InPlaceC(params, ctx); // cublasGemmEx writes D over C
    static std::mutex mutex; // one cuBLAS handle per device, shared by threads: keep its calls serial
    const float alpha = static_cast<float>(p.alpha);
    const float beta = static_cast<float>(p.beta);
    cublasHandle_t handle = ctx.cublas_handle();
    std::lock_guard lock(mutex);
    SHARDLINE_CHECK_CUBLAS(cublasGemmStridedBatchedEx_64(
        handle, p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, p.m, p.n, p.k, &alpha,
        p.a, CudaDataType(p.a_type, GemmOp::kName), p.lda, p.stride_a, p.b, CudaDataType(p.b_type, GemmOp::kName),
        p.ldb, p.stride_b, &beta, p.c, CudaDataType(p.c_type, GemmOp::kName), p.ldc, p.stride_c, p.batch_count,
        GemmComputeType(p, ctx), CUBLAS_GEMM_DEFAULT));
}

} // namespace shardline::kernels::cuda
