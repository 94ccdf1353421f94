// The functions of cuda_backend.h: device count, stream-ordered allocation, copies, fills, casts.

#include <array>
#include <cstring>
#include <mutex>
#include <vector>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <shardline/core/context.h>
#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>

#include "../cuda_backend.h"
#include "context_internal.h"
#include "core_kernels.h"
#include "pinned_staging.h"

// Log lines are formatted by fmt::format and given to spdlog as finished strings: spdlog's own formatting overloads
// instantiate fmt 9's float formatter in this file, which g++ 13 -O3 flags with a false -Warray-bounds.

namespace shardline::detail {
namespace {

bool IsShutdownError(cudaError_t status) {
    return status == cudaErrorCudartUnloading || status == cudaErrorContextIsDestroyed;
}

/// Host memory the driver can DMA from directly (pinned or registered); a copy from it may still be in flight
/// when cudaMemcpyAsync returns, unlike a copy from pageable memory, which is staged before the call returns.
bool IsPinnedHost(const void *ptr) {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
        (void)cudaGetLastError(); // a plain host pointer on old drivers: clear the non-sticky error
        return false;
    }
    return attributes.type == cudaMemoryTypeHost;
}

} // namespace

int CudaDeviceCountImpl() {
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) {
        // No driver or no GPU: not an error for a library that also runs on the CPU. Clear it so that the next
        // launch check does not report it.
        (void)cudaGetLastError();
        return 0;
    }
    return count;
}

namespace {

// The small-block cache in front of the pool (cuda_backend.h, CudaAllocate). A block of at most kCacheMaxBlock bytes
// that was handed out outside a stream capture goes, when freed outside one, to a free list of its rounded size
// instead of cudaFreeAsync, and the next allocation of that size outside a capture takes it back without a CUDA call.
// This is the pool's own same-stream reuse, kept on the host: a block is freed on the context stream after every
// use of it (the library's contract, as for cudaFreeAsync), and the context stream only ever changes to one ordered
// after it (CudaContext::SetStream), so work queued after the reuse is ordered after the block's earlier uses.
constexpr std::size_t kCacheGranule = 512;
constexpr std::size_t kCacheMaxBlock = std::size_t{1} << 20;
constexpr std::size_t kCacheMaxBytes = std::size_t{32} << 20;
constexpr std::size_t kCacheClasses = kCacheMaxBlock / kCacheGranule + 1; ///< class c holds blocks of c · 512 bytes

/// The cache of one device. Which blocks are the cache's, and their rounded size, their Storage remembers (the
/// cache_block_bytes CudaAllocate hands out and CudaFree takes back): no map of the blocks handed out.
struct BlockCache {
    std::mutex mutex;
    std::vector<std::vector<void *>> free; ///< by class; sized on the device's first cached allocation
    std::size_t cached_bytes = 0;
};

BlockCache &CacheOf(int device) {
    // Never destroyed: tensors may be released during static destruction.
    static auto *caches = new std::array<BlockCache, kMaxCudaDevices>();
    return (*caches)[static_cast<std::size_t>(device)];
}

bool CacheEnabled() {
    static const bool enabled = env::GetBool("SHARDLINE_CUDA_BLOCK_CACHE", true);
    return enabled;
}

/// cuStreamIsCapturing, through the driver's entry point (the runtime's cudaStreamIsCapturing costs 0.07–0.11 µs a call
/// on the H100 hosts, the driver's 0.02–0.04: the cache asks on every allocation and free); null where the driver
/// lacks it. On a thread with no current context the driver answers for the context's own stream; an error (e.g. for
/// the legacy stream there) counts as a capture, which only sends the block to the pool.
using DriverCaptureQuery = CUresult (*)(CUstream, CUstreamCaptureStatus *);
DriverCaptureQuery DriverQuery() {
    static const DriverCaptureQuery query = [] {
        void *fn = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuStreamIsCapturing", &fn, 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            found != cudaDriverEntryPointSuccess || fn == nullptr) {
            (void)cudaGetLastError();
            return DriverCaptureQuery{nullptr};
        }
        return reinterpret_cast<DriverCaptureQuery>(fn);
    }();
    return query;
}

/// Whether `stream` is being captured; an unanswerable query counts as a capture (the pool path is always safe).
bool Capturing(cudaStream_t stream) {
    if (const DriverCaptureQuery query = DriverQuery()) {
        CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
        return query(stream, &status) != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE;
    }
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
        (void)cudaGetLastError();
        return true;
    }
    return status != cudaStreamCaptureStatusNone;
}

/// Hands every cached block back to the pool (cache.mutex held; `stream` is not being captured).
void ReleaseLocked(BlockCache &cache, cudaStream_t stream) {
    for (std::vector<void *> &blocks : cache.free) {
        for (void *block : blocks) {
            (void)cudaFreeAsync(block, stream);
        }
        blocks.clear();
    }
    cache.cached_bytes = 0;
    (void)cudaGetLastError();
}

/// Hands every cached block of `device` back to the pool (before an allocation retries after running out).
void ReleaseCachedBlocks(int device, cudaStream_t stream) {
    BlockCache &cache = CacheOf(device);
    std::lock_guard lock(cache.mutex);
    ReleaseLocked(cache, stream);
}

/// `capturing`: whether `stream` is being captured, where neither a free of a cached (eager) block nor a device
/// synchronisation is allowed, so running out is final.
void *PoolAllocate(std::size_t bytes, int device, cudaStream_t stream, bool capturing) {
    void *ptr = nullptr;
    cudaError_t status = cudaMallocAsync(&ptr, bytes, stream);
    if (status == cudaErrorMemoryAllocation && !capturing) {
        // Cached blocks go back to the pool, and blocks freed on other streams return to it only once those frees
        // have executed: wait for the device and try once more before giving up.
        (void)cudaGetLastError();
        ReleaseCachedBlocks(device, stream);
        SHARDLINE_CHECK_CUDA(cudaDeviceSynchronize());
        status = cudaMallocAsync(&ptr, bytes, stream);
    }
    if (status != cudaSuccess) {
        (void)cudaGetLastError();
        std::size_t free_bytes = 0;
        std::size_t total_bytes = 0;
        (void)cudaMemGetInfo(&free_bytes, &total_bytes);
        (void)cudaGetLastError();
        SHARDLINE_THROW(CudaError, "Storage::Allocate",
                        "cudaMallocAsync of {} bytes on cuda:{} failed: {} ({}); {} of {} bytes free on the device",
                        bytes, device, cudaGetErrorName(status), cudaGetErrorString(status), free_bytes, total_bytes);
    }
    return ptr;
}

} // namespace

void *CudaAllocate(std::size_t bytes, int device, std::size_t *cache_block_bytes) {
    *cache_block_bytes = 0;
    CudaContext &ctx = CudaContext::Get(device);
    const cudaStream_t stream = ctx.stream();
    const bool capturing = Capturing(stream);
    if (!CacheEnabled() || bytes > kCacheMaxBlock || capturing) {
        return PoolAllocate(bytes, device, stream, capturing);
    }
    const std::size_t rounded = (bytes + kCacheGranule - 1) / kCacheGranule * kCacheGranule;
    BlockCache &cache = CacheOf(device);
    {
        std::lock_guard lock(cache.mutex);
        if (cache.free.empty()) {
            cache.free.resize(kCacheClasses); // a device's lists, on its first cached allocation
        }
        std::vector<void *> &blocks = cache.free[rounded / kCacheGranule];
        if (!blocks.empty()) {
            void *ptr = blocks.back();
            blocks.pop_back();
            cache.cached_bytes -= rounded;
            *cache_block_bytes = rounded;
            return ptr;
        }
    }
    void *ptr = PoolAllocate(rounded, device, stream, false);
    *cache_block_bytes = rounded;
    return ptr;
}

void CudaFree(void *ptr, int device, std::size_t cache_block_bytes) noexcept {
    if (ptr == nullptr) {
        return;
    }
    // No context lookup that could throw or switch the device: the memory came from CudaAllocate, so the context
    // exists, and the free is ordered on its stream after everything queued there.
    CudaContext *ctx = CudaContextIfCreated(device);
    const cudaStream_t stream = ctx != nullptr ? ctx->stream() : nullptr;
    if (cache_block_bytes != 0 && ctx != nullptr && !Capturing(stream)) {
        BlockCache &cache = CacheOf(device);
        std::lock_guard lock(cache.mutex);
        if (cache.cached_bytes + cache_block_bytes > kCacheMaxBytes) {
            // Full (sizes that stopped coming back, e.g. a warm-up's): start over rather than stop caching.
            ReleaseLocked(cache, stream);
        }
        try {
            cache.free[cache_block_bytes / kCacheGranule].push_back(ptr);
            cache.cached_bytes += cache_block_bytes;
            return;
        } catch (...) {
            // no room on the host for the entry: the pool takes the block back
        }
    }
    const cudaError_t status = cudaFreeAsync(ptr, stream);
    if (status != cudaSuccess) {
        (void)cudaGetLastError();
        if (IsShutdownError(status)) {
            return; // tensors destroyed after the runtime unloaded: the driver reclaims everything anyway
        }
        try {
            Logger().log(spdlog::level::err, fmt::format("cudaFreeAsync({}) on cuda:{} failed: {} ({})", ptr, device,
                                                         cudaGetErrorName(status), cudaGetErrorString(status)));
        } catch (...) {
            // logging must not turn a destructor into a throw
        }
    }
}

void CudaMemcpy(void *dst, Device dst_device, const void *src, Device src_device, std::size_t bytes) {
    if (bytes == 0) {
        return;
    }
    if (dst_device.is_cpu() && src_device.is_cpu()) {
        std::memmove(dst, src, bytes);
        return;
    }
    if (dst_device.is_cpu()) {
        // D2H: queued after the producers on the source's stream, then waited for, so the caller can read dst.
        CudaContext &ctx = CudaContext::Get(src_device.index);
        SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx.stream()));
        SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(ctx.stream()));
        return;
    }
    if (src_device.is_cpu()) {
        CudaContext &ctx = CudaContext::Get(dst_device.index);
        const bool pinned = IsPinnedHost(src);
        if (!pinned && StagedHostToDevice(dst, src, bytes, dst_device.index, ctx.stream())) {
            return; // queued behind the stream's work, which the host does not wait for
        }
        SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx.stream()));
        if (pinned) {
            // The caller may free or overwrite src as soon as we return.
            SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(ctx.stream()));
        }
        return;
    }
    if (src_device.index == dst_device.index) {
        CudaContext &ctx = CudaContext::Get(dst_device.index);
        SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx.stream()));
        return;
    }
    // Across devices: the copy runs on the destination's stream after the source's pending work, and the source's
    // stream waits for the copy, so a stream-ordered free of src cannot overtake it.
    CudaContext &src_ctx = CudaContext::Get(src_device.index);
    CudaContext &dst_ctx = CudaContext::Get(dst_device.index);
    cudaEvent_t src_ready = nullptr;
    cudaEvent_t copied = nullptr;
    SHARDLINE_CHECK_CUDA(cudaSetDevice(src_device.index));
    SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&src_ready, cudaEventDisableTiming));
    SHARDLINE_CHECK_CUDA(cudaEventRecord(src_ready, src_ctx.stream()));
    SHARDLINE_CHECK_CUDA(cudaSetDevice(dst_device.index));
    SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming));
    SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(dst_ctx.stream(), src_ready, 0));
    SHARDLINE_CHECK_CUDA(cudaMemcpyPeerAsync(dst, dst_device.index, src, src_device.index, bytes, dst_ctx.stream()));
    SHARDLINE_CHECK_CUDA(cudaEventRecord(copied, dst_ctx.stream()));
    SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(src_ctx.stream(), copied, 0));
    // Destroying a recorded event is safe: its resources are released once it completes.
    SHARDLINE_CHECK_CUDA(cudaEventDestroy(src_ready));
    SHARDLINE_CHECK_CUDA(cudaEventDestroy(copied));
}

void CudaFillRandom(void *data, DType dtype, std::int64_t numel, const RandomKernelArgs &args, int device) {
    if (numel <= 0) {
        return;
    }
    CudaContext &ctx = CudaContext::Get(device);
    SHARDLINE_CHECK_CUDA(cuda::LaunchFillRandom(data, dtype, numel, args, ctx.stream()));
}

void CudaFillValue(void *data, DType dtype, std::int64_t numel, double value, int device) {
    if (numel <= 0) {
        return;
    }
    CudaContext &ctx = CudaContext::Get(device);
    SHARDLINE_CHECK_CUDA(cuda::LaunchFillValue(data, dtype, numel, value, ctx.stream()));
}

void CudaCast(const void *src, DType src_dtype, void *dst, DType dst_dtype, std::int64_t numel, int device) {
    if (numel <= 0) {
        return;
    }
    CudaContext &ctx = CudaContext::Get(device);
    SHARDLINE_CHECK_CUDA(cuda::LaunchCast(src, src_dtype, dst, dst_dtype, numel, ctx.stream()));
}

void CudaStridedCopy(const void *src, void *dst, DType dtype, const StridedCopyDesc &desc, int device) {
    SHARDLINE_CHECK_AS(ShapeError, desc.rank >= 0 && desc.rank <= kMaxCopyRank, "Tensor::Contiguous",
                       "strided copy supports rank <= {}, got {}", kMaxCopyRank, desc.rank);
    CudaContext &ctx = CudaContext::Get(device);
    SHARDLINE_CHECK_CUDA(cuda::LaunchStridedCopy(src, dst, ElementSize(dtype), desc, ctx.stream()));
}

void CudaSynchronize(int device) {
    CudaContext &ctx = CudaContext::Get(device);
    SHARDLINE_CHECK_CUDA(cudaStreamSynchronize(ctx.stream()));
}

namespace {
cudaMemPool_t DefaultPool(int device) {
    CudaContext::Get(device); // the pool's release threshold is set there
    cudaMemPool_t pool = nullptr;
    SHARDLINE_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, device));
    return pool;
}
} // namespace

void CudaPoolCounters(int device, std::uint64_t *used, std::uint64_t *used_high, std::uint64_t *reserved,
                      std::uint64_t *reserved_high) {
    cudaMemPool_t pool = DefaultPool(device);
    SHARDLINE_CHECK_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, used));
    SHARDLINE_CHECK_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, used_high));
    SHARDLINE_CHECK_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, reserved));
    SHARDLINE_CHECK_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, reserved_high));
}

void CudaResetPoolPeaks(int device) {
    cudaMemPool_t pool = DefaultPool(device);
    // Only zero may be written to the high-water marks; they then restart from the current values.
    std::uint64_t zero = 0;
    SHARDLINE_CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    SHARDLINE_CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero));
}

} // namespace shardline::detail
