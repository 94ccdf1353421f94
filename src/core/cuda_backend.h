#pragma once

// The CUDA half of core, implemented in src/core/cuda/*.cu. Declared here so the host code in src/core/*.cc
// stays free of CUDA headers. Only present when SHARDLINE_HAVE_CUDA.

#include <cstddef>
#include <cstdint>

#include <shardline/config.h>
#include <shardline/core/device.h>
#include <shardline/core/dtype.h>

#include "philox.h"

#if SHARDLINE_HAVE_CUDA
namespace shardline::detail {

inline constexpr int kMaxCopyRank = 8;

/// A strided source view: copies element (i0, ..., i_{r-1}) from src + Σ i_d·stride[d] to the row-major position.
struct StridedCopyDesc {
    int rank;
    std::int64_t shape[kMaxCopyRank];
    std::int64_t stride[kMaxCopyRank];
};

/// Number of visible CUDA devices; 0 when there is no driver or no GPU (never throws).
int CudaDeviceCountImpl();
/// cudaMallocAsync from the device's default pool on the context stream. A block of at most 1 MiB (rounded up to 512
/// bytes) comes from the small-block cache when it holds one of that size and the stream is not being captured: the
/// pool's same-stream reuse without its ~1 µs of host time per allocation and free (SHARDLINE_CUDA_BLOCK_CACHE=0 turns
/// the cache off). `*cache_block_bytes` receives the block's rounded size when it belongs to the cache (handed out
/// outside a capture), else 0; the owner passes it back to CudaFree.
void* CudaAllocate(std::size_t bytes, int device, std::size_t* cache_block_bytes);
/// cudaFreeAsync on the context stream, or for a block of the cache (`cache_block_bytes` from CudaAllocate, not 0) and
/// the stream not being captured, back to the cache (up to 32 MiB of cached blocks per device; past that, to the
/// pool); logs instead of throwing.
void CudaFree(void* ptr, int device, std::size_t cache_block_bytes) noexcept;
/// Copies bytes between any two devices (either side may be the CPU). Ordered on the context stream of the CUDA
/// side; synchronous when the destination is the CPU. Host to device never waits for the stream's queued work when the
/// source is pageable (up to 64 MiB it goes through pinned staging blocks, pinned_staging.h).
void CudaMemcpy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes);
/// Fills `numel` elements of dtype on the device with RandomValueAt(args, GlobalIndexOf(args, i)), rounded to the
/// dtype exactly as the CPU does (double → float → half, round to nearest even).
void CudaFillRandom(void* data, DType dtype, std::int64_t numel, const RandomKernelArgs& args, int device);
/// Fills with one value (converted double → float → dtype).
void CudaFillValue(void* data, DType dtype, std::int64_t numel, double value, int device);
/// Elementwise dtype conversion on the device (through float; float64 ↔ float32 direct).
void CudaCast(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t numel, int device);
/// Strided view → contiguous copy on the device.
void CudaStridedCopy(const void* src, void* dst, DType dtype, const StridedCopyDesc& desc, int device);
/// Waits for the context stream.
void CudaSynchronize(int device);
/// The default pool's used and reserved bytes, now and at their peaks (cudaMemPoolAttr*Mem{Current,High}).
void CudaPoolCounters(int device, std::uint64_t* used, std::uint64_t* used_high, std::uint64_t* reserved,
                      std::uint64_t* reserved_high);
/// Resets the pool's high-water marks.
void CudaResetPoolPeaks(int device);

} // namespace shardline::detail
#endif
