// Load: every rank reads the metadata, checks the model against it, reads and verifies the blocks of the saved shards
// that overlap its own shard into host staging (streamed: chunks of whole blocks on a few threads, read, crc32 and
// placed in parallel), agrees with the other ranks, and only then copies the staging into the tensors.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>

#include <fmt/format.h>

#include <shardline/ckpt/checkpoint.h>
#include <shardline/ckpt/metadata.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/mesh.h>

#include "agree.h"
#include "io.h"
#include "stream.h"

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

enum LoadPhase { kRead, kCrc, kScatter, kCopyOut, kH2D, kPreflight, kAgree };
constexpr std::array<const char *, detail::PhaseTimes::kMaxPhases> kLoadPhases = {
    "read", "crc32", "scatter", "copy_out", "h2d", "preflight", "agree", nullptr};

/// The part of saved shard `shard` that overlaps this rank's box of tensor `job`: the global box [lo, hi), its bytes
/// [first, last) in the saved shard (rows from its first to its last element), and where it starts in the staging.
struct Overlap {
    std::size_t job = 0;
    const ShardRecord *shard = nullptr;
    const detail::InFile *file = nullptr;
    std::vector<std::int64_t> lo;
    std::vector<std::int64_t> hi;
    std::int64_t first = 0;
    std::int64_t last = 0;
    std::int64_t dst_first = 0;
    /// The overlap is one byte range in the saved shard and in the staging (same box, or a split on the first dim):
    /// whole chunks inside it are read straight into the staging.
    bool contiguous = false;
};

/// Whole checksum blocks [begin, end) (bytes of the saved shard; end may be the shard's short end) of an overlap.
struct ReadChunk {
    std::size_t overlap = 0;
    std::int64_t begin = 0;
    std::int64_t end = 0;
};

struct ReadJob {
    const TensorRecord *record = nullptr;
    spmd::LocalShard box;
    Tensor staging;
};

/// The load's plan: every overlap of every job with the saved shards, cut into chunks; the files opened once.
struct ReadPlan {
    std::map<std::string, std::unique_ptr<detail::InFile>> files;
    std::vector<Overlap> overlaps;
    std::vector<ReadChunk> chunks;
};

/// Adds the overlaps of job `j` to `plan`, checking the files (missing, truncated) and the coverage of the box.
void PlanJob(const std::string &dir, const Metadata &m, const std::vector<ReadJob> &jobs, std::size_t j,
             std::int64_t chunk, ReadPlan &plan) {
    const ReadJob &job = jobs[j];
    const TensorRecord &record = *job.record;
    const std::int64_t elem = static_cast<std::int64_t>(ElementSize(record.dtype));
    const std::int64_t block = m.block_bytes;
    std::int64_t box_numel = 1;
    for (std::int64_t d : job.box.shape) {
        box_numel *= d;
    }
    std::int64_t covered = 0;
    for (const ShardRecord &s : record.shards) {
        Overlap o;
        o.job = j;
        if (box_numel == 0 || !detail::Intersect(s.offset, s.shape, job.box.offset, job.box.shape, o.lo, o.hi)) {
            continue;
        }
        const std::string path = (fs::path(dir) / s.file).string();
        const std::int64_t blocks = (s.length + block - 1) / block;
        SHARDLINE_CHECK(
            static_cast<std::int64_t>(s.block_crc32.size()) == blocks, "ckpt::Load",
            "tensor '{}': the shard in '{}' has {} bytes, so {} block checksums of {} bytes, metadata has {}",
            record.name, path, s.length, blocks, block, s.block_crc32.size());
        auto it = plan.files.find(path);
        if (it == plan.files.end()) {
            SHARDLINE_CHECK(detail::FileSize(path) >= 0, "ckpt::Load", "tensor '{}': its shard file '{}' is missing",
                            record.name, path);
            it = plan.files.emplace(path, std::make_unique<detail::InFile>(path)).first;
        }
        const std::int64_t size = it->second->size();
        SHARDLINE_CHECK(
            size >= s.byte_offset + s.length, "ckpt::Load",
            "tensor '{}': '{}' is truncated: the shard at global offset {} needs bytes [{}, {}), the file has {}",
            record.name, path, fmt::join(s.offset, ","), s.byte_offset, s.byte_offset + s.length, size);
        std::vector<std::int64_t> last_index(o.hi.size());
        std::int64_t volume = 1;
        for (std::size_t d = 0; d < o.hi.size(); ++d) {
            last_index[d] = o.hi[d] - 1;
            volume *= o.hi[d] - o.lo[d];
        }
        o.shard = &s;
        o.file = it->second.get();
        o.first = detail::LinearIndexIn(o.lo, s.offset, s.shape) * elem;
        o.last = (detail::LinearIndexIn(last_index, s.offset, s.shape) + 1) * elem;
        o.dst_first = detail::LinearIndexIn(o.lo, job.box.offset, job.box.shape) * elem;
        const std::int64_t dst_last = (detail::LinearIndexIn(last_index, job.box.offset, job.box.shape) + 1) * elem;
        o.contiguous = o.last - o.first == volume * elem && dst_last - o.dst_first == volume * elem;
        // The blocks covering [first, last), in chunks of whole blocks.
        for (std::int64_t begin = o.first / block * block; begin < o.last; begin += chunk) {
            const std::int64_t end = std::min({begin + chunk, (o.last + block - 1) / block * block, s.length});
            plan.chunks.push_back({.overlap = plan.overlaps.size(), .begin = begin, .end = end});
        }
        plan.overlaps.push_back(std::move(o));
        covered += volume;
    }
    SHARDLINE_CHECK(covered == box_numel, "ckpt::Load",
                    "tensor '{}' in '{}': the saved shards cover {} of the {} elements of this rank's shard at offset "
                    "[{}] shape [{}]",
                    record.name, dir, covered, box_numel, fmt::join(job.box.offset, ","),
                    fmt::join(job.box.shape, ","));
}

/// Reads, verifies and places every chunk into the jobs' staging tensors, on IoWorkers threads: a chunk wholly inside
/// a contiguous overlap is read straight into the staging, any other into the worker's scratch and copied from there
/// (the overlap's elements only). Throws the error of the first failing chunk in plan order.
void ReadAll(const Metadata &m, std::vector<ReadJob> &jobs, const ReadPlan &plan, detail::PhaseTimes &times) {
    const int workers = detail::IoWorkers(plan.chunks.size());
    std::vector<std::vector<char>> scratch(static_cast<std::size_t>(workers));
    const std::int64_t block = m.block_bytes;
    detail::RunTasks(plan.chunks.size(), workers, [&](std::size_t task, int worker) {
        const ReadChunk &c = plan.chunks[task];
        const Overlap &o = plan.overlaps[c.overlap];
        const ShardRecord &s = *o.shard;
        ReadJob &job = jobs[o.job];
        char *staging = static_cast<char *>(job.staging.data());
        const bool direct = o.contiguous && c.begin >= o.first && c.end <= o.last;
        char *buffer = nullptr;
        if (direct) {
            buffer = staging + o.dst_first + (c.begin - o.first);
        } else {
            std::vector<char> &mine = scratch[static_cast<std::size_t>(worker)];
            if (mine.size() < static_cast<std::size_t>(c.end - c.begin)) {
                mine = std::vector<char>(static_cast<std::size_t>(c.end - c.begin));
            }
            buffer = mine.data();
        }
        {
            const detail::PhaseTimes::Scope timed(times, kRead);
            o.file->ReadAt(s.byte_offset + c.begin, c.end - c.begin, buffer);
        }
        {
            const detail::PhaseTimes::Scope timed(times, kCrc);
            for (std::int64_t lo = c.begin; lo < c.end; lo += block) {
                const std::int64_t hi = std::min(lo + block, c.end);
                const std::size_t b = static_cast<std::size_t>(lo / block);
                const std::uint32_t crc = detail::Crc32(buffer + (lo - c.begin), static_cast<std::size_t>(hi - lo));
                SHARDLINE_CHECK(crc == s.block_crc32[b], "ckpt::Load",
                                "tensor '{}': checksum mismatch in '{}' at bytes [{}, {}) (block {} of the shard at "
                                "global offset [{}]): crc32 {:08x}, metadata.json says {:08x}",
                                job.record->name, o.file->path(), s.byte_offset + lo, s.byte_offset + hi, b,
                                fmt::join(s.offset, ","), crc, s.block_crc32[b]);
            }
        }
        if (direct) {
            return;
        }
        const detail::PhaseTimes::Scope timed(times, kScatter);
        if (o.contiguous) {
            const std::int64_t lo = std::max(c.begin, o.first);
            const std::int64_t hi = std::min(c.end, o.last);
            std::memcpy(staging + o.dst_first + (lo - o.first), buffer + (lo - c.begin),
                        static_cast<std::size_t>(hi - lo));
        } else {
            detail::CopyBoxWindow(buffer, c.begin, c.end, s.offset, s.shape, staging, job.box.offset, job.box.shape,
                                  o.lo, o.hi, ElementSize(job.record->dtype));
        }
    });
}

/// After the agreement: the staged values into the tensors, in chunks on IoWorkers threads; a CUDA tensor's chunks go
/// through each worker's pinned slot (memcpy, then a copy the link runs at full speed while other workers fill theirs).
void CopyOut(const TensorList &tensors, std::vector<ReadJob> &jobs, std::int64_t chunk, detail::PhaseTimes &times) {
    struct OutChunk {
        std::size_t job;
        std::int64_t begin;
        std::int64_t bytes;
    };
    std::vector<OutChunk> chunks;
    for (std::size_t j = 0; j < jobs.size(); ++j) {
        const std::int64_t bytes = static_cast<std::int64_t>(jobs[j].staging.nbytes());
        for (std::int64_t begin = 0; begin < bytes; begin += chunk) {
            chunks.push_back({j, begin, std::min(chunk, bytes - begin)});
        }
    }
    const int workers = detail::IoWorkers(chunks.size());
    std::vector<std::unique_ptr<detail::StagingSlot>> slots(static_cast<std::size_t>(workers));
    std::vector<detail::DeviceCopier> copiers(static_cast<std::size_t>(workers));
    detail::RunTasks(chunks.size(), workers, [&](std::size_t task, int worker) {
        const OutChunk &c = chunks[task];
        const Tensor &dst = tensors[c.job].second.local();
        const char *src = static_cast<const char *>(jobs[c.job].staging.data()) + c.begin;
        char *out = static_cast<char *>(dst.data()) + c.begin;
        if (dst.device().is_cpu()) {
            const detail::PhaseTimes::Scope timed(times, kCopyOut);
            std::memcpy(out, src, static_cast<std::size_t>(c.bytes));
            return;
        }
        auto &slot = slots[static_cast<std::size_t>(worker)];
        if (slot == nullptr) {
            slot = std::make_unique<detail::StagingSlot>(chunk, /*pinned=*/true);
        }
        {
            const detail::PhaseTimes::Scope timed(times, kCopyOut);
            std::memcpy(slot->data(), src, static_cast<std::size_t>(c.bytes));
        }
        const detail::PhaseTimes::Scope timed(times, kH2D);
        copiers[static_cast<std::size_t>(worker)].ToDevice(out, slot->data(), static_cast<std::size_t>(c.bytes),
                                                           dst.device().index);
    });
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
    const auto start = std::chrono::steady_clock::now();
    detail::PhaseTimes times;
    std::string dir;
    Metadata m;
    std::vector<ReadJob> jobs;
    std::string error;
    try {
        ReadPlan plan;
        {
            const detail::PhaseTimes::Scope timed(times, kPreflight);
            dir = ResolveCheckpoint(path);
            m = ReadMetadata(dir);
            for (std::size_t i = 0; i < tensors.size(); ++i) {
                const auto &[name, t] = tensors[i];
                const TensorRecord *record = m.Find(name);
                SHARDLINE_CHECK(record != nullptr, "ckpt::Load",
                                "tensor '{}' of the model is not in the checkpoint '{}'", name, dir);
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
                SHARDLINE_CHECK(
                    t.local().shape() == Shape(box.shape.begin(), box.shape.end()) && t.local().is_contiguous(),
                    "ckpt::Load", "tensor '{}': the local shard {} must be contiguous with the layout's shape [{}]",
                    name, t.local().ToString(), fmt::join(box.shape, ","));
                // Host staging: nothing reaches a tensor before every rank has read and verified all it needs.
                jobs.push_back({.record = record, .box = box, .staging = Tensor::Empty(t.local().shape(), t.dtype())});
                detail::AdviseHugePages(jobs.back().staging.data(), jobs.back().staging.nbytes());
            }
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
            for (std::size_t j = 0; j < jobs.size(); ++j) {
                PlanJob(dir, m, jobs, j, detail::ChunkBytes(options.chunk_bytes, m.block_bytes), plan);
            }
        }
        ReadAll(m, jobs, plan, times);
    } catch (const std::exception &e) {
        error = e.what();
    }
    {
        const detail::PhaseTimes::Scope timed(times, kAgree);
        detail::AgreeOrThrow(world, "ckpt::Load", error);
    }
    CopyOut(tensors, jobs, detail::ChunkBytes(options.chunk_bytes, 1), times);
    nlohmann::json timings = times.Json(kLoadPhases);
    timings["wall_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return {.path = dir, .step = m.step, .extra = m.extra, .timings = std::move(timings)};
}

} // namespace shardline::ckpt
