#include "stream.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>

#if SHARDLINE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace shardline::ckpt::detail {
namespace {

std::int64_t NowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

/// The free slots, pinned and pageable; never destroyed (pinned memory outlives the last save, freed at exit).
struct SlotPool {
    std::mutex mutex;
    std::vector<std::unique_ptr<HostBuffer>> free[2];
};

SlotPool &Pool() {
    static auto *pool = new SlotPool;
    return *pool;
}

} // namespace

std::int64_t ChunkBytes(std::int64_t requested, std::int64_t block_bytes) {
    SHARDLINE_CHECK(requested > 0 && block_bytes > 0, "ckpt", "chunk_bytes ({}) and block_bytes ({}) must be positive",
                    requested, block_bytes);
    return std::max<std::int64_t>(1, requested / block_bytes) * block_bytes;
}

int IoWorkers(std::size_t tasks) { return static_cast<int>(std::clamp<std::size_t>(tasks, 1, 8)); }

void RunTasks(std::size_t tasks, int workers, const std::function<void(std::size_t task, int worker)> &fn) {
    workers = static_cast<int>(
        std::clamp<std::size_t>(static_cast<std::size_t>(std::max(workers, 1)), 1, std::max<std::size_t>(tasks, 1)));
    std::atomic<std::size_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex mutex;
    std::size_t failed_task = tasks;
    std::string failure;
    auto work = [&](int worker) {
        for (std::size_t task = next++; task < tasks && !failed.load(); task = next++) {
            try {
                fn(task, worker);
            } catch (const std::exception &e) {
                std::lock_guard lock(mutex);
                if (task < failed_task) {
                    failed_task = task;
                    failure = e.what();
                }
                failed = true;
            }
        }
    };
    std::vector<std::thread> pool;
    for (int w = 1; w < workers; ++w) {
        pool.emplace_back(work, w);
    }
    work(0);
    for (std::thread &t : pool) {
        t.join();
    }
    if (failed_task < tasks) {
        throw Error(failure);
    }
}

PhaseTimes::Scope::Scope(PhaseTimes &times, int phase) : times_(times), phase_(phase), start_ns_(NowNs()) {}

PhaseTimes::Scope::~Scope() { times_.ns_[static_cast<std::size_t>(phase_)] += NowNs() - start_ns_; }

void PhaseTimes::Add(int phase, double seconds) {
    ns_[static_cast<std::size_t>(phase)] += static_cast<std::int64_t>(seconds * 1e9);
}

nlohmann::json PhaseTimes::Json(const std::array<const char *, kMaxPhases> &names) const {
    nlohmann::json out = nlohmann::json::object();
    for (std::size_t i = 0; i < names.size(); ++i) {
        if (names[i] != nullptr) {
            out[std::string(names[i]) + "_s"] = static_cast<double>(ns_[i].load()) * 1e-9;
        }
    }
    return out;
}

StagingSlot::StagingSlot(std::int64_t bytes, bool pinned) : pinned_(pinned) {
    {
        SlotPool &pool = Pool();
        std::lock_guard lock(pool.mutex);
        auto &free = pool.free[pinned ? 1 : 0];
        if (!free.empty()) {
            buffer_ = std::move(free.back());
            free.pop_back();
        }
    }
    if (buffer_ == nullptr) {
        buffer_ = std::make_unique<HostBuffer>();
    }
    data_ = static_cast<char *>(buffer_->Reserve(bytes, pinned));
}

StagingSlot::~StagingSlot() {
    SlotPool &pool = Pool();
    std::lock_guard lock(pool.mutex);
    pool.free[pinned_ ? 1 : 0].push_back(std::move(buffer_));
}

#if SHARDLINE_HAVE_CUDA

DeviceCopier::~DeviceCopier() {
    if (event_ != nullptr) {
        cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    }
}

void *DeviceCopier::Event(int device) {
    if (device_ != device && event_ != nullptr) {
        SHARDLINE_CHECK_CUDA(cudaEventDestroy(static_cast<cudaEvent_t>(event_)));
        event_ = nullptr;
    }
    if (event_ == nullptr) {
        CudaContext::Get(device); // current on this thread: the event belongs to the device
        cudaEvent_t event = nullptr;
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
        event_ = event;
        device_ = device;
    }
    return event_;
}

void QueueToHost(void *dst, const void *src, std::size_t bytes, int device) {
    SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, CudaContext::Get(device).stream()));
}

void DeviceCopier::ToHost(void *dst, const void *src, std::size_t bytes, int device) {
    auto *event = static_cast<cudaEvent_t>(Event(device));
    QueueToHost(dst, src, bytes, device);
    cudaStream_t stream = CudaContext::Get(device).stream();
    SHARDLINE_CHECK_CUDA(cudaEventRecord(event, stream));
    SHARDLINE_CHECK_CUDA(cudaEventSynchronize(event));
}

void DeviceCopier::ToDevice(void *dst, const void *src, std::size_t bytes, int device) {
    auto *event = static_cast<cudaEvent_t>(Event(device));
    cudaStream_t stream = CudaContext::Get(device).stream();
    SHARDLINE_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
    SHARDLINE_CHECK_CUDA(cudaEventRecord(event, stream));
    SHARDLINE_CHECK_CUDA(cudaEventSynchronize(event));
}

#else

DeviceCopier::~DeviceCopier() = default;

void *DeviceCopier::Event(int device) {
    SHARDLINE_THROW(DeviceError, "ckpt", "cuda:{} tensors need a build with CUDA", device);
}

void QueueToHost(void *, const void *, std::size_t, int device) {
    SHARDLINE_THROW(DeviceError, "ckpt", "cuda:{} tensors need a build with CUDA", device);
}

void DeviceCopier::ToHost(void *, const void *, std::size_t, int device) { Event(device); }

void DeviceCopier::ToDevice(void *, const void *, std::size_t, int device) { Event(device); }

#endif

} // namespace shardline::ckpt::detail
