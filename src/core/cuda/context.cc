// CudaContext: one per device, created on first use and kept until the process exits.

#include <array>
#include <atomic>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string_view>

#include <cuda_runtime_api.h>

#include <shardline/core/context.h>
#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>

#include "context_internal.h"
#include "cublas_check.h"

// Log lines are formatted by fmt::format and given to spdlog as finished strings: spdlog's own formatting overloads
// instantiate fmt 9's float formatter in this file, which g++ 13 -O3 flags with a false -Warray-bounds.

namespace shardline {
namespace {

constexpr std::size_t kDefaultWorkspaceMiB = 32;

// Contexts are never destroyed: tearing down streams and handles during static destruction races the CUDA
// runtime's own shutdown. The table is fixed-size so that lookups after creation take no lock.
std::array<std::atomic<CudaContext *>, detail::kMaxCudaDevices> &Slots() {
    static std::array<std::atomic<CudaContext *>, detail::kMaxCudaDevices> slots{};
    return slots;
}

std::mutex &CreateMutex() {
    static std::mutex mutex;
    return mutex;
}

// Guards the lazily created cuBLAS handles and their stream/workspace binding.
std::mutex &CublasMutex() {
    static std::mutex mutex;
    return mutex;
}

std::size_t WorkspaceBytesFromEnv() {
    static const std::size_t bytes = [] {
        const auto mib = env::GetInt("SHARDLINE_CUBLASLT_WORKSPACE_MB", static_cast<std::int64_t>(kDefaultWorkspaceMiB),
                                     0, std::int64_t{1} << 20);
        return static_cast<std::size_t>(mib) << 20;
    }();
    return bytes;
}

bool AllowTf32FromEnv() {
    static const bool allow = [] { return env::GetBool("SHARDLINE_ALLOW_TF32", false); }();
    return allow;
}

void BindCublas(cublasHandle_t handle, cudaStream_t stream, void *workspace, std::size_t workspace_bytes) {
    SHARDLINE_CHECK_CUBLAS(cublasSetStream(handle, stream));
    // cublasSetStream resets the handle to cuBLAS's own workspace pool; point it back at ours (stream-ordered, so
    // sharing it with cuBLASLt on the same stream is safe).
    if (workspace_bytes > 0) {
        SHARDLINE_CHECK_CUBLAS(cublasSetWorkspace(handle, workspace, workspace_bytes));
    }
}

} // namespace

namespace detail {
CudaContext *CudaContextIfCreated(int device) {
    if (device < 0 || device >= kMaxCudaDevices) {
        return nullptr;
    }
    return Slots()[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
}
} // namespace detail

CudaContext &CudaContext::Get(int index) {
    const int count = CudaDeviceCount();
    SHARDLINE_CHECK_AS(DeviceError, index >= 0 && index < count && index < detail::kMaxCudaDevices, "CudaContext",
                       "device cuda:{} is not available ({} CUDA device(s) visible)", index, count);
    std::atomic<CudaContext *> &slot = Slots()[static_cast<std::size_t>(index)];
    CudaContext *ctx = slot.load(std::memory_order_acquire);
    if (ctx == nullptr) [[unlikely]] {
        std::lock_guard lock(CreateMutex());
        ctx = slot.load(std::memory_order_acquire);
        if (ctx == nullptr) {
            ctx = new CudaContext(index);
            slot.store(ctx, std::memory_order_release);
        }
    }
    int current = -1;
    SHARDLINE_CHECK_CUDA(cudaGetDevice(&current));
    if (current != index) {
        SHARDLINE_CHECK_CUDA(cudaSetDevice(index));
    }
    return *ctx;
}

CudaContext &CudaContext::Current() {
    int current = 0;
    SHARDLINE_CHECK_CUDA(cudaGetDevice(&current));
    return Get(current);
}

CudaContext::CudaContext(int device) : device_(device) {
    SHARDLINE_CHECK_CUDA(cudaSetDevice(device));
    int major = 0;
    int minor = 0;
    int pools = 0;
    SHARDLINE_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    SHARDLINE_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    SHARDLINE_CHECK_CUDA(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device));
    SHARDLINE_CHECK_CUDA(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
    compute_capability_ = major * 10 + minor;
    SHARDLINE_CHECK_AS(DeviceError, pools != 0, "CudaContext",
                       "device cuda:{} does not support stream-ordered allocation (cudaMallocAsync)", device);

    // Freed blocks stay in the pool instead of going back to the driver at each synchronisation, so a steady-state
    // training step is served from the pool without cudaMalloc/cudaFree.
    cudaMemPool_t pool = nullptr;
    SHARDLINE_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, device));
    std::uint64_t threshold = UINT64_MAX;
    SHARDLINE_CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));

    try {
        // Non-blocking: our work never serialises against the legacy default stream of other libraries.
        SHARDLINE_CHECK_CUDA(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
        stream_ = own_stream_;
        SHARDLINE_CHECK_CUBLAS(cublasLtCreate(&lt_handle_));
        workspace_bytes_ = WorkspaceBytesFromEnv();
        if (workspace_bytes_ > 0) {
            SHARDLINE_CHECK_CUDA(cudaMalloc(&workspace_, workspace_bytes_));
        }
        active_workspace_ = workspace_;
        active_workspace_bytes_ = workspace_bytes_;
    } catch (...) {
        if (workspace_ != nullptr) {
            cudaFree(workspace_);
        }
        if (lt_handle_ != nullptr) {
            cublasLtDestroy(lt_handle_);
        }
        if (own_stream_ != nullptr) {
            cudaStreamDestroy(own_stream_);
        }
        throw;
    }
    allow_tf32_ = AllowTf32FromEnv();
    if (Logger().should_log(spdlog::level::debug)) {
        Logger().log(spdlog::level::debug,
                     fmt::format("CUDA context cuda:{}: sm_{}, {} SMs, cuBLASLt workspace {} MiB, TF32 {}", device,
                                 compute_capability_, multiprocessors_, workspace_bytes_ >> 20,
                                 allow_tf32_ ? "on" : "off"));
    }
}

CudaContext::~CudaContext() {
    // Never reached in practice (contexts live until exit); statuses are ignored because a destructor must not
    // throw.
    if (cublas_handle_ != nullptr) {
        cublasDestroy(cublas_handle_);
    }
    if (lt_handle_ != nullptr) {
        cublasLtDestroy(lt_handle_);
    }
    if (workspace_ != nullptr) {
        cudaFree(workspace_);
    }
    if (own_stream_ != nullptr) {
        cudaStreamDestroy(own_stream_);
    }
}

void CudaContext::SetStream(cudaStream_t stream) {
    std::lock_guard lock(CublasMutex());
    const cudaStream_t next = stream != nullptr ? stream : own_stream_;
    const cudaStream_t previous = stream_.load();
    if (next != previous) {
        // The new stream must follow the old one: the cuBLASLt workspace is shared, and tensors last used on the old
        // stream are freed (stream-ordered) on the new one.
        cudaEvent_t handoff = nullptr;
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&handoff, cudaEventDisableTiming));
        SHARDLINE_CHECK_CUDA(cudaEventRecord(handoff, previous));
        SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(next, handoff, 0));
        SHARDLINE_CHECK_CUDA(cudaEventDestroy(handoff));
    }
    stream_.store(next);
    if (cublas_handle_ != nullptr) {
        BindCublas(cublas_handle_, next, workspace_, workspace_bytes_);
    }
}

void CudaContext::SetWorkspace(void *workspace, std::size_t bytes) {
    // No ordering is needed: work already queued keeps the workspace it was given, later work takes the new one, and
    // the two never share memory.
    std::lock_guard lock(CublasMutex());
    active_workspace_ = workspace != nullptr ? workspace : workspace_;
    active_workspace_bytes_ = workspace != nullptr ? bytes : workspace_bytes_;
}

ScopedCudaOverride::ScopedCudaOverride(CudaContext &ctx, cudaStream_t stream, void *workspace,
                                       std::size_t workspace_bytes)
    : ctx_(ctx), previous_stream_(ctx.stream()), previous_workspace_(ctx.workspace()),
      previous_workspace_bytes_(ctx.workspace_bytes()) {
    if (stream != nullptr && stream != previous_stream_) {
        ctx_.SetStream(stream);
        stream_set_ = true;
    }
    if (workspace != nullptr) {
        ctx_.SetWorkspace(workspace, workspace_bytes);
        workspace_set_ = true;
    }
}

ScopedCudaOverride::~ScopedCudaOverride() {
    // A destructor must not throw: a failure to restore is logged (the CUDA error is sticky and the next call raises).
    try {
        if (workspace_set_) {
            // previous_workspace_ is ours or an outer scope's; SetWorkspace(nullptr) would drop an outer override.
            ctx_.SetWorkspace(previous_workspace_, previous_workspace_bytes_);
        }
        if (stream_set_) {
            ctx_.SetStream(previous_stream_);
        }
    } catch (const std::exception &e) {
        Logger().log(spdlog::level::err,
                     fmt::format("ScopedCudaOverride: restoring cuda:{} failed: {}", ctx_.device(), e.what()));
    }
}

cublasHandle_t CudaContext::cublas_handle() {
    std::lock_guard lock(CublasMutex());
    if (cublas_handle_ == nullptr) {
        int current = -1;
        SHARDLINE_CHECK_CUDA(cudaGetDevice(&current));
        if (current != device_) {
            SHARDLINE_CHECK_CUDA(cudaSetDevice(device_));
        }
        cublasHandle_t handle = nullptr;
        SHARDLINE_CHECK_CUBLAS(cublasCreate(&handle));
        try {
            BindCublas(handle, stream_.load(), workspace_, workspace_bytes_);
        } catch (...) {
            cublasDestroy(handle);
            throw;
        }
        cublas_handle_ = handle;
    }
    return cublas_handle_;
}

} // namespace shardline
