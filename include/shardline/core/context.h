#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include <shardline/config.h>
#include <shardline/core/device.h>

#if SHARDLINE_HAVE_CUDA
// cudaStream_t, cublasLtHandle_t and cublasHandle_t are pointers to these opaque structs: declaring them keeps the CUDA
// headers out of the public headers. A program that calls CUDA or cuBLAS itself includes them and gets the same types.
struct CUstream_st;
struct cublasLtContext;
struct cublasContext;
#endif

namespace shardline {

#if SHARDLINE_HAVE_CUDA
/// Per-device runtime state, created on first use and kept for the life of the process: the compute stream,
/// the cuBLASLt handle and its workspace (SHARDLINE_CUBLASLT_WORKSPACE_MB, default 32), a cuBLAS handle for the
/// legacy provider, and the device's default memory pool with a release threshold of "never", so a steady-state
/// training step makes no cudaMalloc/cudaFree. Parameters and tensors never hold runtime state (seed 000).
class CudaContext {
public:
    /// The context of device `index` (makes it current on this thread).
    static CudaContext& Get(int index);
    /// The context of the current device.
    static CudaContext& Current();

    int device() const { return device_; }
    CUstream_st* stream() const { return stream_.load(std::memory_order_acquire); }
    /// Uses `stream` for compute from now on (e.g. an embedding trainer's own stream); nullptr restores ours. The new
    /// stream is ordered after the old one.
    void SetStream(CUstream_st* stream);
    /// The cuBLASLt handle, for programs that call cuBLASLt on this context's stream.
    cublasLtContext* lt_handle() const { return lt_handle_; }
    /// The legacy provider's cuBLAS handle, created on first use and bound to the compute stream.
    cublasContext* cublas_handle();
    /// The cuBLASLt workspace: ours, or the one SetWorkspace installed.
    void* workspace() const { return active_workspace_; }
    std::size_t workspace_bytes() const { return active_workspace_bytes_; }
    /// Gives cuBLASLt `workspace` (`bytes`, device memory of this device) from now on; nullptr restores ours. The
    /// legacy provider's cuBLAS handle keeps ours.
    void SetWorkspace(void* workspace, std::size_t bytes);
    /// Whether fp32 GEMMs may use TF32 (SHARDLINE_ALLOW_TF32=1, read once; or SetAllowTf32).
    bool allow_tf32() const { return allow_tf32_; }
    void SetAllowTf32(bool allow) { allow_tf32_ = allow; }
    /// Major*10 + minor compute capability and multiprocessor count.
    int compute_capability() const { return compute_capability_; }
    int multiprocessors() const { return multiprocessors_; }

    CudaContext(const CudaContext&) = delete;
    CudaContext& operator=(const CudaContext&) = delete;
    ~CudaContext();

private:
    explicit CudaContext(int device);
    int device_;
    CUstream_st* own_stream_ = nullptr;
    std::atomic<CUstream_st*> stream_{nullptr};
    cublasLtContext* lt_handle_ = nullptr;
    cublasContext* cublas_handle_ = nullptr;
    void* workspace_ = nullptr;
    std::size_t workspace_bytes_ = 0;
    void* active_workspace_ = nullptr;
    std::size_t active_workspace_bytes_ = 0;
    bool allow_tf32_ = false;
    int compute_capability_ = 0;
    int multiprocessors_ = 0;
};

/// A caller's stream and cuBLASLt workspace for the length of a scope (the functional API's explicit arguments): on
/// entry the context computes on `stream`, ordered after its previous stream as SetStream orders it, and cuBLASLt
/// uses `workspace`; on exit both are restored and the previous stream is ordered after `stream`. A null stream or
/// workspace keeps the current one. Scopes nest. Like SetStream it changes the device's context for every thread, so
/// no other shardline work may run on the device meanwhile.
class ScopedCudaOverride {
public:
    ScopedCudaOverride(CudaContext& ctx, CUstream_st* stream, void* workspace, std::size_t workspace_bytes);
    ~ScopedCudaOverride();
    ScopedCudaOverride(const ScopedCudaOverride&) = delete;
    ScopedCudaOverride& operator=(const ScopedCudaOverride&) = delete;

private:
    CudaContext& ctx_;
    CUstream_st* previous_stream_ = nullptr;
    void* previous_workspace_ = nullptr;
    std::size_t previous_workspace_bytes_ = 0;
    bool stream_set_ = false;
    bool workspace_set_ = false;
};
#endif

/// Waits for all work queued on the device's compute stream (no-op on the CPU).
void Synchronize(Device device);

/// The device memory of the device's stream-ordered pool, which every shardline tensor comes from (as does other code
/// calling cudaMallocAsync without a pool; not the cuBLASLt workspace or NCCL's buffers). The counters move as queued
/// frees execute; blocks kept by the small-block cache (≤ 32 MiB, docs/kernels.md) count as allocated. CPU: all 0.
struct DeviceMemoryStats {
    std::uint64_t allocated = 0; ///< held by live tensors and the cache (torch.cuda.memory_allocated + ≤ 32 MiB)
    std::uint64_t peak_allocated =
        0;                      ///< the most held at once since start or ResetPeakDeviceMemory (max_memory_allocated)
    std::uint64_t reserved = 0; ///< taken from the driver by the pool now (torch.cuda.memory_reserved)
    std::uint64_t peak_reserved = 0; ///< the most taken at once (max_memory_reserved)
};
DeviceMemoryStats GetDeviceMemoryStats(Device device);
/// Starts the peaks over from the current values (torch.cuda.reset_peak_memory_stats); no-op on the CPU.
void ResetPeakDeviceMemory(Device device);

} // namespace shardline
