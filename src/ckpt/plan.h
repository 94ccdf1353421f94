#pragma once

// Private to src/ckpt: which rank writes which shard where. Every rank computes the same plan from the same tensor
// list, without communication (the fingerprint check makes sure the lists agree).

#include <cstdint>
#include <string>
#include <vector>

#include <shardline/ckpt/checkpoint.h>
#include <shardline/ckpt/metadata.h>

namespace shardline::ckpt::detail {

struct PlannedShard {
    int tensor = 0; ///< index into the tensor list
    std::vector<std::int64_t> offset;
    std::vector<std::int64_t> shape;
    int writer = 0;
    std::int64_t byte_offset = 0; ///< in the writer's file
    std::int64_t length = 0;
    std::int64_t first_block = 0; ///< index of its first crc among all blocks of the checkpoint
    std::int64_t num_blocks = 0;
};

struct SavePlan {
    int world_size = 1;
    int rank = 0;
    std::int64_t block_bytes = 0;
    std::vector<TensorRecord> tensors; ///< without shards
    std::vector<PlannedShard> shards;
    std::vector<std::int64_t> file_bytes; ///< per rank
    std::int64_t total_blocks = 0;
    /// A hash of names, shapes, dtypes, meshes and layouts, below 2^52: equal on every rank of an SPMD program.
    double fingerprint = 0;
};

/// Checks the tensors (no Partial layout, meshes over `world`, contiguous shards of the layout's shape) and plans the
/// save: the distinct non-empty shards of every tensor, each given to the least loaded of the ranks that hold it
/// (ties: the lowest rank), placed back to back in that rank's file. Throws Error naming the tensor.
SavePlan PlanSave(const TensorList& tensors, comm::Communicator* world, std::int64_t block_bytes);

/// "rank_00003.bin".
std::string RankFileName(int rank);

} // namespace shardline::ckpt::detail
