// Load: every rank reads the metadata, checks the model against it, reads and verifies the blocks of the saved shards
// that overlap its own shard into host memory, agrees with the other ranks, and only then writes into the tensors.

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <thread>

#include <fmt/format.h>

#include <shardline/ckpt/checkpoint.h>
#include <shardline/ckpt/metadata.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>

#include "agree.h"
#include "io.h"

namespace shardline::ckpt {
namespace {

namespace fs = std::filesystem;

std::string Trim(std::string text) {
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ' || text.back() == '\r')) {
        text.pop_back();
    }
    return text;
}

/// This rank's box of `t`: the whole tensor when local, else the spmd layout math's shard for its coordinate.
spmd::LocalShard BoxOf(const dist::DistTensor &t) {
    const std::vector<std::int64_t> shape(t.global_shape().begin(), t.global_shape().end());
    if (t.is_local()) {
        return {shape, std::vector<std::int64_t>(shape.size(), 0)};
    }
    const comm::DeviceMesh &mesh = t.mesh();
    const spmd::ProcessMesh pm(mesh.shape(), mesh.dim_names());
    return spmd::ComputeLocalShard(pm, shape, t.layout(), mesh.coordinate());
}

/// Reads this rank's part of `record` into `staging` (host, the box's shape), from the overlapping saved shards.
void ReadInto(const std::string &dir, const Metadata &m, const TensorRecord &record, const spmd::LocalShard &box,
              Tensor &staging) {
    const std::size_t elem = ElementSize(record.dtype);
    std::int64_t box_numel = 1;
    for (std::int64_t d : box.shape) {
        box_numel *= d;
    }
    std::int64_t covered = 0;
    std::vector<std::int64_t> lo;
    std::vector<std::int64_t> hi;
    std::vector<char> buffer;
    for (const ShardRecord &s : record.shards) {
        if (box_numel == 0 || !detail::Intersect(s.offset, s.shape, box.offset, box.shape, lo, hi)) {
            continue;
        }
        // Bytes [first, last) of the saved shard hold the intersection (rows between its first and last element).
        std::vector<std::int64_t> last_index(hi.size());
        std::int64_t volume = 1;
        for (std::size_t d = 0; d < hi.size(); ++d) {
            last_index[d] = hi[d] - 1;
            volume *= hi[d] - lo[d];
        }
        const std::int64_t first = detail::LinearIndexIn(lo, s.offset, s.shape) * static_cast<std::int64_t>(elem);
        const std::int64_t last =
            (detail::LinearIndexIn(last_index, s.offset, s.shape) + 1) * static_cast<std::int64_t>(elem);
        std::int64_t buffer_begin = 0;
        detail::ReadShardVerified(dir, s, m.block_bytes, record.name, first, last, buffer, buffer_begin);
        // CopyBox indexes from the start of the saved shard: point it buffer_begin bytes before the buffer.
        detail::CopyBox(buffer.data() - buffer_begin, s.offset, s.shape, static_cast<char *>(staging.data()),
                        box.offset, box.shape, lo, hi, elem);
        covered += volume;
    }
    SHARDLINE_CHECK(covered == box_numel, "ckpt::Load",
                    "tensor '{}' in '{}': the saved shards cover {} of the {} elements of this rank's shard at offset "
                    "[{}] shape [{}]",
                    record.name, dir, covered, box_numel, fmt::join(box.offset, ","), fmt::join(box.shape, ","));
}

struct ReadJob {
    const TensorRecord *record = nullptr;
    spmd::LocalShard box;
    Tensor *staging = nullptr;
};

/// Runs the reads on a few threads (a disk serves several requests at once, and crc32 runs beside the reads); throws
/// the error of the first failing job in list order.
void ReadAll(const std::string &dir, const Metadata &m, std::vector<ReadJob> &jobs) {
    const std::size_t threads =
        std::min<std::size_t>(jobs.size(), std::max(1u, std::min(8u, std::thread::hardware_concurrency())));
    std::vector<std::string> errors(jobs.size());
    std::atomic<std::size_t> next{0};
    auto work = [&] {
        for (std::size_t i = next++; i < jobs.size(); i = next++) {
            try {
                ReadInto(dir, m, *jobs[i].record, jobs[i].box, *jobs[i].staging);
            } catch (const std::exception &e) {
                errors[i] = e.what();
            }
        }
    };
    std::vector<std::thread> pool;
    for (std::size_t t = 1; t < threads; ++t) {
        pool.emplace_back(work);
    }
    work();
    for (std::thread &t : pool) {
        t.join();
    }
    for (const std::string &e : errors) {
        if (!e.empty()) {
            throw Error(e);
        }
    }
}

} // namespace

std::string ResolveCheckpoint(const std::string &path) {
    if (fs::exists(fs::path(path) / kMetadataFile)) {
        return path;
    }
    const fs::path latest = fs::path(path) / "latest";
    SHARDLINE_CHECK(fs::exists(latest), "ckpt::Load", "'{}' is no checkpoint: it has neither {} nor a 'latest' pointer",
                    path, kMetadataFile);
    const std::string name = Trim(detail::ReadText(latest.string()));
    const fs::path dir = fs::path(path) / name;
    SHARDLINE_CHECK(!name.empty() && fs::exists(dir / kMetadataFile), "ckpt::Load", "'{}' names '{}', which has no {}",
                    latest.string(), name, kMetadataFile);
    return dir.string();
}

bool CheckpointExists(const std::string &path) {
    return fs::exists(fs::path(path) / kMetadataFile) || fs::exists(fs::path(path) / "latest");
}

CheckpointInfo Load(const std::string &path, const TensorList &tensors, comm::Communicator *world,
                    const LoadOptions &options) {
    std::string dir;
    Metadata m;
    std::vector<Tensor> staging(tensors.size());
    std::vector<ReadJob> jobs;
    std::string error;
    try {
        dir = ResolveCheckpoint(path);
        m = ReadMetadata(dir);
        for (std::size_t i = 0; i < tensors.size(); ++i) {
            const auto &[name, t] = tensors[i];
            const TensorRecord *record = m.Find(name);
            SHARDLINE_CHECK(record != nullptr, "ckpt::Load", "tensor '{}' of the model is not in the checkpoint '{}'",
                            name, dir);
            const std::vector<std::int64_t> shape(t.global_shape().begin(), t.global_shape().end());
            SHARDLINE_CHECK(record->shape == shape, "ckpt::Load",
                            "tensor '{}' has the shape [{}] in the model, [{}] in the checkpoint '{}'", name,
                            fmt::join(shape, ","), fmt::join(record->shape, ","), dir);
            SHARDLINE_CHECK(record->dtype == t.dtype(), "ckpt::Load",
                            "tensor '{}' is {} in the model, {} in the checkpoint '{}'", name, DTypeName(t.dtype()),
                            DTypeName(record->dtype), dir);
            SHARDLINE_CHECK(!t.layout().IsPartial(), "ckpt::Load",
                            "tensor '{}' is Partial ({}): load into a "
                            "replicated or sharded tensor",
                            name, t.layout().ToString());
            const spmd::LocalShard box = BoxOf(t);
            SHARDLINE_CHECK(t.local().shape() == Shape(box.shape.begin(), box.shape.end()) && t.local().is_contiguous(),
                            "ckpt::Load",
                            "tensor '{}': the local shard {} must be contiguous with the layout's shape [{}]", name,
                            t.local().ToString(), fmt::join(box.shape, ","));
            staging[i] = Tensor::Empty(t.local().shape(), t.dtype());
            jobs.push_back({.record = record, .box = box, .staging = &staging[i]});
        }
        ReadAll(dir, m, jobs);
        if (options.strict) {
            for (const TensorRecord &record : m.tensors) {
                bool asked = false;
                for (const auto &entry : tensors) {
                    asked = asked || entry.first == record.name;
                }
                SHARDLINE_CHECK(asked, "ckpt::Load", "the checkpoint '{}' holds tensor '{}', which the model lacks",
                                dir, record.name);
            }
        }
    } catch (const std::exception &e) {
        error = e.what();
    }
    detail::AgreeOrThrow(world, "ckpt::Load", error);
    std::vector<Device> devices;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
        Tensor dst = tensors[i].second.local();
        dst.CopyFrom(staging[i]);
        if (!dst.device().is_cpu()) {
            devices.push_back(dst.device());
        }
    }
    for (Device d : devices) {
        Synchronize(d);
    }
    return {.path = dir, .step = m.step, .extra = m.extra};
}

} // namespace shardline::ckpt
