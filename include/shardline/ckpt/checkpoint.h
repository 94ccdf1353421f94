#pragma once

// Distributed checkpoints (DESIGN.md §9): named DistTensors plus a JSON object saved as a directory that any mesh can
// load. The layout follows PyTorch Distributed Checkpoint and Megatron-Core dist_checkpointing:
//
//   ROOT/latest                     "step_00000020": the last committed checkpoint (replaced by rename)
//   ROOT/step_00000020/metadata.json  format, library version, and per tensor its global shape, dtype, mesh, layout
//                                     and saved shards (global offset and shape, file, byte offset, length, crc32
//                                     of every block_bytes block); the caller's JSON under "extra"
//   ROOT/step_00000020/rank_00003.bin the shards rank 3 wrote, back to back, row-major
//
// Save is collective over the world. Each distinct shard (replicas hold the same one) is written once, by the least
// loaded of its replicas, so the bytes spread over the ranks. Files are written into ROOT/.tmp_step_..., fsynced,
// then rank 0 writes metadata.json, fsyncs, renames the directory and then `latest` (each rename fsynced): a crash at
// any point leaves the previous checkpoint loadable. Both directions stream: chunks of whole blocks go through the
// device<->host copy, crc32 and pread/pwrite on several threads at once, with one fsync per file. Load is collective
// too: each rank computes its shard's global box from the spmd layout math (torch.chunk shards) and reads only the
// blocks of saved shards that overlap it, verifying their crc32 (zlib), into host staging; once every rank succeeded
// it writes the values into the given tensors in place. Every failure (missing or truncated
// file, checksum, missing tensor, other shape or dtype) is agreed over the world first, so every rank raises the same
// Error naming the file, the tensor and what differs, and nothing hangs.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <shardline/comm/communicator.h>
#include <shardline/dist/dist_tensor.h>

namespace shardline::ckpt {

/// Named tensors in a fixed order, the same names, global shapes, dtypes and layouts on every rank. A DistTensor with
/// a mesh must live on a mesh over `world`; a local one is taken as replicated on every rank. Partial layouts are
/// refused (reduce them first).
using TensorList = std::vector<std::pair<std::string, dist::DistTensor>>;

struct SaveOptions {
    /// Committed checkpoints to keep under ROOT (the oldest are removed after a commit); 0 keeps all.
    int keep_last = 0;
    /// Bytes per checksummed block: a load verifies and reads whole blocks.
    std::int64_t block_bytes = 4 << 20;
    /// Bytes per write request (rounded down to whole blocks, at least one): the save streams chunks of this size
    /// through device-to-host copy, crc32 and pwrite on several threads at once (dd's 16 MiB blocks).
    std::int64_t chunk_bytes = 16 << 20;
    /// Test hook: called on rank 0 after every file and metadata.json are written and synced, before the rename that
    /// commits. A throw here is a crash before commit: the save fails on every rank and `latest` is unchanged.
    std::function<void()> before_commit;
};

/// What a save committed or a load read.
struct CheckpointInfo {
    std::string path; ///< the checkpoint directory
    std::int64_t step = 0;
    nlohmann::json extra; ///< the caller's JSON (step, RNG, data position, config ...)
    /// This rank's seconds per phase ("<phase>_s"; summed over the worker threads for the streamed phases, so they
    /// may exceed "wall_s"): save d2h, crc32, write, fsync, commit; load read, crc32, scatter, copy_out, h2d, agree.
    nlohmann::json timings;
};

/// Writes `tensors` and `extra` as ROOT/step_<step> and points ROOT/latest at it. Collective over `world` (nullptr:
/// one process). Returns on every rank after the commit, or throws the same Error on every rank.
CheckpointInfo Save(const std::string& root, std::int64_t step, const TensorList& tensors, const nlohmann::json& extra,
                    comm::Communicator* world, const SaveOptions& options = {});

struct LoadOptions {
    /// Also an error: a tensor of the checkpoint that `tensors` does not ask for.
    bool strict = false;
    /// Bytes per read request (rounded down to whole blocks of the checkpoint, at least one), read and verified on
    /// several threads at once.
    std::int64_t chunk_bytes = 16 << 20;
};

/// Reads the checkpoint at `path` (a checkpoint directory, or a ROOT whose `latest` names one) into `tensors` in
/// place, resharding from the saved mesh and layout to each tensor's own. Collective over `world` (nullptr: one
/// process). Nothing is written into a tensor unless every rank read and verified all it needs.
CheckpointInfo Load(const std::string& path, const TensorList& tensors, comm::Communicator* world,
                    const LoadOptions& options = {});

/// The checkpoint directory `path` denotes: itself when it holds metadata.json, else ROOT/<contents of latest>.
/// Throws Error when neither exists.
std::string ResolveCheckpoint(const std::string& path);
/// True when `path` is a checkpoint directory or a ROOT with a `latest` pointer.
bool CheckpointExists(const std::string& path);

/// Async save (Megatron-Core's async_save): Save() copies this rank's shards to host memory (pinned for CUDA
/// tensors, reused across saves) and returns; a background thread writes and syncs the files. The commit is
/// collective, so it runs on the calling thread: at the next Save(), at Wait(), or never (call Wait() before exit;
/// the destructor only joins the writer and leaves the uncommitted directory, as a crash would).
class AsyncSaver {
public:
    explicit AsyncSaver(comm::Communicator* world, SaveOptions options = {});
    ~AsyncSaver();
    AsyncSaver(const AsyncSaver&) = delete;
    AsyncSaver& operator=(const AsyncSaver&) = delete;

    /// Waits for and commits the previous save, then snapshots `tensors` and starts writing. Collective.
    void Save(const std::string& root, std::int64_t step, const TensorList& tensors, const nlohmann::json& extra);
    /// Waits for the pending save's files and commits it (no-op when none). Collective. Returns what it committed.
    CheckpointInfo Wait();
    bool pending() const;
    /// Seconds the last Save() spent copying to host memory (the training stall).
    double last_snapshot_seconds() const;

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

} // namespace shardline::ckpt
