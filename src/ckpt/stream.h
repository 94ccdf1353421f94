#pragma once

// Private to src/ckpt: what the save and load pipelines are built from. A save or load is a list of chunks (at most
// ChunkBytes, whole checksum blocks) that a few worker threads take in turn; each worker moves its chunk through every
// stage (device->host copy, crc32, write; or read, crc32, copy) on its own, so the stages of different chunks overlap
// and several I/Os are in flight, as an NVMe disk wants. Host staging for device copies comes from pinned slots that
// live until exit.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "host_buffer.h"

namespace shardline::ckpt::detail {

/// Bytes per chunk: `requested` (SaveOptions/LoadOptions::chunk_bytes) rounded down to whole checksum blocks, at
/// least one block.
std::int64_t ChunkBytes(std::int64_t requested, std::int64_t block_bytes);

/// Worker threads for I/O-bound pipelines: enough outstanding requests for an NVMe disk (8), fewer when there are
/// fewer tasks.
int IoWorkers(std::size_t tasks);

/// Runs fn(task, worker) for every task in [0, tasks) on `workers` threads (the caller's among them, as worker 0).
/// After a task throws, no new task starts; then rethrows the failure of the lowest-numbered failing task (as Error,
/// with its message), so the message does not depend on thread timing.
void RunTasks(std::size_t tasks, int workers, const std::function<void(std::size_t task, int worker)>& fn);

/// Seconds per phase summed over the threads that ran it (thread-seconds), for CheckpointInfo::timings.
class PhaseTimes {
public:
    static constexpr int kMaxPhases = 8;
    /// RAII: adds the seconds from construction to destruction to `phase`.
    class Scope {
    public:
        Scope(PhaseTimes& times, int phase);
        ~Scope();
        Scope(const Scope&) = delete;
        Scope& operator=(const Scope&) = delete;

    private:
        PhaseTimes& times_;
        int phase_;
        std::int64_t start_ns_;
    };
    void Add(int phase, double seconds);
    /// {"<name>_s": seconds, ...} for the phases named in `names` (index = phase).
    nlohmann::json Json(const std::array<const char*, kMaxPhases>& names) const;

private:
    std::array<std::atomic<std::int64_t>, kMaxPhases> ns_{};
};

/// Host memory for one worker's chunks, taken from a process-wide pool and given back on destruction: pinned
/// (cudaHostAlloc) when CUDA is available and `pinned`, so device copies run at the link's speed; kept until exit
/// because pinning is slow.
class StagingSlot {
public:
    StagingSlot(std::int64_t bytes, bool pinned);
    ~StagingSlot();
    StagingSlot(const StagingSlot&) = delete;
    StagingSlot& operator=(const StagingSlot&) = delete;
    char* data() const { return data_; }

private:
    std::unique_ptr<HostBuffer> buffer_;
    bool pinned_ = false;
    char* data_ = nullptr;
};

/// Queues a copy of device memory `src` on cuda:`device` into host `dst` on the device's compute stream (after the
/// kernels that produced it) and returns at once: `dst` holds the bytes after the next Synchronize(device). The async
/// save's snapshot queues every shard's copy this way and waits once, so the copies run back to back at the link's
/// speed instead of one host wait per tensor.
void QueueToHost(void* dst, const void* src, std::size_t bytes, int device);

/// One worker's device<->host copies on the compute stream of the device (so a save's copy runs after the kernels
/// that produced the tensor, a load's before the kernels that read it), each waited for on its own event: the worker
/// then owns the host bytes again while the other workers' copies and I/O go on. Not thread-safe: one per worker.
class DeviceCopier {
public:
    DeviceCopier() = default;
    ~DeviceCopier();
    DeviceCopier(const DeviceCopier&) = delete;
    DeviceCopier& operator=(const DeviceCopier&) = delete;
    /// Device memory `src` on cuda:`device` -> host `dst`; returns when `dst` holds the bytes.
    void ToHost(void* dst, const void* src, std::size_t bytes, int device);
    /// Host `src` -> device memory `dst` on cuda:`device`; returns when the copy has read `src`.
    void ToDevice(void* dst, const void* src, std::size_t bytes, int device);

private:
    void* Event(int device);
    void* event_ = nullptr; ///< cudaEvent_t of device_
    int device_ = -1;
};

} // namespace shardline::ckpt::detail
