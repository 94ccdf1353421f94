#include "plan.h"

#include <algorithm>
#include <functional>
#include <map>

#include <fmt/format.h>

#include <shardline/core/error.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>

namespace shardline::ckpt::detail {

std::string RankFileName(int rank) { return fmt::format("rank_{:05d}.bin", rank); }

SavePlan PlanSave(const TensorList &tensors, comm::Communicator *world, std::int64_t block_bytes) {
    SHARDLINE_CHECK(block_bytes > 0, "ckpt::Save", "block_bytes must be positive, got {}", block_bytes);
    SavePlan plan;
    plan.world_size = world != nullptr ? world->size() : 1;
    plan.rank = world != nullptr ? world->rank() : 0;
    plan.block_bytes = block_bytes;
    plan.file_bytes.assign(static_cast<std::size_t>(plan.world_size), 0);
    std::size_t hash = 0;
    const auto mix = [&hash](const std::string &text) { hash = hash * 1000003u ^ std::hash<std::string>{}(text); };
    for (std::size_t i = 0; i < tensors.size(); ++i) {
        const auto &[name, t] = tensors[i];
        SHARDLINE_CHECK(t.defined(), "ckpt::Save", "tensor '{}' is undefined", name);
        for (std::size_t j = 0; j < i; ++j) {
            SHARDLINE_CHECK(tensors[j].first != name, "ckpt::Save", "tensor name '{}' appears twice", name);
        }
        SHARDLINE_CHECK(!t.layout().IsPartial(), "ckpt::Save",
                        "tensor '{}' is Partial ({}): reduce it before saving (a checkpoint holds one global value)",
                        name, t.layout().ToString());
        SHARDLINE_CHECK(t.local().is_contiguous(), "ckpt::Save", "tensor '{}' must be contiguous, got {}", name,
                        t.local().ToString());
        TensorRecord record{.name = name,
                            .shape = std::vector<std::int64_t>(t.global_shape().begin(), t.global_shape().end()),
                            .dtype = t.dtype(),
                            .mesh_shape = {},
                            .mesh_dim_names = {},
                            .layout = t.layout().ToString(),
                            .shards = {}};
        // Which boxes exist and who holds each (replicas in rank order).
        std::vector<spmd::LocalShard> boxes;
        std::vector<std::vector<int>> holders;
        if (t.is_local()) {
            boxes.push_back({record.shape, std::vector<std::int64_t>(record.shape.size(), 0)});
            holders.emplace_back();
            for (int r = 0; r < plan.world_size; ++r) {
                holders.back().push_back(r);
            }
        } else {
            const comm::DeviceMesh &mesh = t.mesh();
            SHARDLINE_CHECK(world != nullptr && &const_cast<comm::DeviceMesh &>(mesh).world() == world, "ckpt::Save",
                            "tensor '{}' lives on a mesh over another communicator than the save's world", name);
            record.mesh_shape = mesh.shape();
            record.mesh_dim_names = mesh.dim_names();
            const spmd::ProcessMesh pm(mesh.shape(), mesh.dim_names());
            std::map<std::vector<std::int64_t>, std::size_t> index; // offset ++ shape -> box
            for (int r = 0; r < plan.world_size; ++r) {
                spmd::LocalShard box = spmd::ComputeLocalShardOfProcess(pm, record.shape, t.layout(), r);
                std::vector<std::int64_t> key = box.offset;
                key.insert(key.end(), box.shape.begin(), box.shape.end());
                auto [it, inserted] = index.emplace(std::move(key), boxes.size());
                if (inserted) {
                    boxes.push_back(std::move(box));
                    holders.emplace_back();
                }
                holders[it->second].push_back(r);
            }
        }
        mix(name);
        mix(record.layout);
        mix(std::string(DTypeName(record.dtype)));
        mix(fmt::format("{}|{}|{}", fmt::join(record.shape, ","), fmt::join(record.mesh_shape, ","),
                        fmt::join(record.mesh_dim_names, ",")));
        const std::int64_t elem = static_cast<std::int64_t>(ElementSize(record.dtype));
        for (std::size_t b = 0; b < boxes.size(); ++b) {
            std::int64_t numel = 1;
            for (std::int64_t d : boxes[b].shape) {
                numel *= d;
            }
            if (numel == 0) {
                continue;
            }
            int writer = holders[b].front();
            for (int r : holders[b]) {
                if (plan.file_bytes[static_cast<std::size_t>(r)] < plan.file_bytes[static_cast<std::size_t>(writer)]) {
                    writer = r;
                }
            }
            PlannedShard shard{.tensor = static_cast<int>(i),
                               .offset = boxes[b].offset,
                               .shape = boxes[b].shape,
                               .writer = writer,
                               .byte_offset = plan.file_bytes[static_cast<std::size_t>(writer)],
                               .length = numel * elem,
                               .first_block = plan.total_blocks,
                               .num_blocks = (numel * elem + block_bytes - 1) / block_bytes};
            if (writer == plan.rank) {
                SHARDLINE_CHECK(t.local().shape() == Shape(shard.shape.begin(), shard.shape.end()), "ckpt::Save",
                                "tensor '{}': this rank's local shard {} must have the layout's shape [{}]", name,
                                t.local().ToString(), fmt::join(shard.shape, ","));
            }
            plan.file_bytes[static_cast<std::size_t>(writer)] += shard.length;
            plan.total_blocks += shard.num_blocks;
            plan.shards.push_back(std::move(shard));
        }
        plan.tensors.push_back(std::move(record));
    }
    plan.fingerprint = static_cast<double>(hash & ((std::size_t{1} << 52) - 1));
    return plan;
}

} // namespace shardline::ckpt::detail
