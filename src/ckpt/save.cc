// Save: plan (plan.cc), stream this rank's shards into its file (stream.h: copy, crc32 and write of chunks overlap;
// one fsync), then the collective commit.
// AsyncSaver runs the write on a thread and the commit at the next Save() or Wait().

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <regex>
#include <thread>

#include <fmt/format.h>

#include <shardline/ckpt/checkpoint.h>
#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>

#include "agree.h"
#include "host_buffer.h"
#include "io.h"
#include "plan.h"
#include "stream.h"

namespace shardline::ckpt {
namespace {

namespace fs = std::filesystem;

std::string StepName(std::int64_t step) { return fmt::format("step_{:08d}", step); }

/// The bytes this rank writes, shard by shard in plan order: pointers into CPU tensors, into a host snapshot, or (a
/// synchronous save) into CUDA tensors, which the writer streams through pinned slots.
struct Snapshot {
    std::vector<const void *> data; ///< one per shard this rank writes
    std::vector<int> device;        ///< its CUDA device, -1 for host memory
    std::vector<Tensor> keep_alive;
};

/// What the writer hands to the commit.
struct Written {
    std::string error;
    std::vector<std::pair<std::int64_t, std::vector<std::uint32_t>>> crcs; ///< (first block, block crcs)
};

enum SavePhase { kD2H, kCrc, kWrite, kFsync, kCommit, kSnapshot, kPlan };
constexpr std::array<const char *, detail::PhaseTimes::kMaxPhases> kSavePhases = {
    "d2h", "crc32", "write", "fsync", "commit", "snapshot", "plan", nullptr};

/// A pending save between its snapshot and its commit.
struct PendingSave {
    std::string root;
    std::string tmp;
    std::int64_t step = 0;
    nlohmann::json extra;
    detail::SavePlan plan;
    Snapshot snapshot;
    Written written;
    detail::PhaseTimes times;
};

/// Plans, checks that every rank planned the same tensors, and has rank 0 create the temporary directory.
void Begin(PendingSave &p, const TensorList &tensors, comm::Communicator *world, const SaveOptions &options) {
    const detail::PhaseTimes::Scope timed(p.times, kPlan);
    std::string error;
    try {
        p.plan = detail::PlanSave(tensors, world, options.block_bytes);
    } catch (const Error &e) {
        error = e.what();
    }
    detail::AgreeOrThrow(world, "ckpt::Save", error);
    const std::vector<double> fp = detail::AllReduceMax(world, {p.plan.fingerprint, -p.plan.fingerprint});
    SHARDLINE_CHECK(fp[0] == -fp[1], "ckpt::Save",
                    "the ranks passed different tensor lists (names, shapes, dtypes, meshes or layouts differ): "
                    "every rank must save the same named tensors");
    p.tmp = (fs::path(p.root) / fmt::format(".tmp_{}", StepName(p.step))).string();
    error.clear();
    if (p.plan.rank == 0) {
        try {
            detail::MakeDir(p.root);
            detail::RemoveTree(p.tmp); // a crashed save's leftovers
            detail::MakeDir(p.tmp);
        } catch (const Error &e) {
            error = e.what();
        }
    }
    detail::AgreeOrThrow(world, "ckpt::Save", error);
}

/// This rank's shards: with `copy`, copied into `buffer` (pinned when any is on a GPU: the async save's snapshot);
/// else in place, CPU and CUDA tensors alike (the synchronous save streams the CUDA ones).
Snapshot TakeSnapshot(const detail::SavePlan &plan, const TensorList &tensors, bool copy, detail::HostBuffer &buffer) {
    Snapshot s;
    std::int64_t staged = 0;
    bool any_cuda = false;
    for (const detail::PlannedShard &shard : plan.shards) {
        const Tensor &local = tensors[static_cast<std::size_t>(shard.tensor)].second.local();
        if (shard.writer == plan.rank && copy) {
            staged += shard.length;
            any_cuda = any_cuda || !local.device().is_cpu();
        }
    }
    // Pinned memory only for device-to-host copies (it makes them run at the link's speed).
    char *host = static_cast<char *>(buffer.Reserve(staged, /*pinned=*/any_cuda));
    std::vector<Device> devices;
    for (const detail::PlannedShard &shard : plan.shards) {
        if (shard.writer != plan.rank) {
            continue;
        }
        const Tensor &local = tensors[static_cast<std::size_t>(shard.tensor)].second.local();
        if (!copy) {
            s.data.push_back(local.data());
            s.device.push_back(local.device().is_cpu() ? -1 : local.device().index);
            s.keep_alive.push_back(local);
            continue;
        }
        // The planned shards are contiguous (PlanSave checks it), so the bytes go as they are. Device copies are only
        // queued here and waited for once per device below.
        if (local.device().is_cpu()) {
            std::memcpy(host, local.data(), static_cast<std::size_t>(shard.length));
        } else {
            detail::QueueToHost(host, local.data(), static_cast<std::size_t>(shard.length), local.device().index);
            if (std::find(devices.begin(), devices.end(), local.device()) == devices.end()) {
                devices.push_back(local.device());
            }
        }
        s.data.push_back(host);
        s.device.push_back(-1);
        host += shard.length;
    }
    for (Device d : devices) {
        Synchronize(d);
    }
    return s;
}

/// One chunk of the file: bytes [begin, begin + bytes) of shard `shard` (an index into the writer's list).
struct WriteChunk {
    std::size_t shard = 0;
    std::int64_t begin = 0;
    std::int64_t bytes = 0;
};

/// Writes and fsyncs this rank's file (no collective: may run on a thread). Never throws. Streamed: chunks of whole
/// checksum blocks go to a few workers, each of which copies its chunk to a pinned slot when it is on a GPU, computes
/// its block crc32s and pwrites it at its offset, so the copies, the checksums and the writes of different chunks
/// overlap and the disk sees several large writes at once; the written prefix of the file is handed to writeback as
/// it grows; one fsync at the end.
void WriteFiles(PendingSave &p, std::int64_t chunk_bytes) noexcept {
    try {
        const std::string path = (fs::path(p.tmp) / detail::RankFileName(p.plan.rank)).string();
        struct Mine {
            const detail::PlannedShard *shard;
            const char *data;
            int device;
        };
        std::vector<Mine> mine;
        std::size_t k = 0;
        for (const detail::PlannedShard &shard : p.plan.shards) {
            if (shard.writer == p.plan.rank) {
                mine.push_back({&shard, static_cast<const char *>(p.snapshot.data[k]), p.snapshot.device[k]});
                ++k;
            }
        }
        const std::int64_t block = p.plan.block_bytes;
        const std::int64_t chunk = detail::ChunkBytes(chunk_bytes, block);
        std::vector<WriteChunk> chunks;
        std::vector<std::pair<std::int64_t, std::vector<std::uint32_t>>> crcs;
        for (std::size_t i = 0; i < mine.size(); ++i) {
            crcs.emplace_back(mine[i].shard->first_block,
                              std::vector<std::uint32_t>(static_cast<std::size_t>(mine[i].shard->num_blocks)));
            for (std::int64_t begin = 0; begin < mine[i].shard->length; begin += chunk) {
                chunks.push_back({.shard = i, .begin = begin, .bytes = std::min(chunk, mine[i].shard->length - begin)});
            }
        }
        detail::OutFile file(path);
        // Chunks are in file order; the writeback of the written prefix starts as it grows (OutFile::StartWriteback).
        std::mutex prefix_mutex;
        std::vector<char> written(chunks.size(), 0);
        std::size_t prefix = 0;
        const auto file_offset = [&](std::size_t i) {
            return mine[chunks[i].shard].shard->byte_offset + chunks[i].begin;
        };
        const int workers = detail::IoWorkers(chunks.size());
        std::vector<std::unique_ptr<detail::StagingSlot>> slots(static_cast<std::size_t>(workers));
        std::vector<detail::DeviceCopier> copiers(static_cast<std::size_t>(workers));
        detail::RunTasks(chunks.size(), workers, [&](std::size_t task, int worker) {
            const WriteChunk &c = chunks[task];
            const Mine &m = mine[c.shard];
            const char *bytes = m.data + c.begin;
            if (m.device >= 0) {
                auto &slot = slots[static_cast<std::size_t>(worker)];
                if (slot == nullptr) {
                    slot = std::make_unique<detail::StagingSlot>(chunk, /*pinned=*/true);
                }
                const detail::PhaseTimes::Scope timed(p.times, kD2H);
                copiers[static_cast<std::size_t>(worker)].ToHost(slot->data(), bytes, static_cast<std::size_t>(c.bytes),
                                                                 m.device);
                bytes = slot->data();
            }
            {
                const detail::PhaseTimes::Scope timed(p.times, kCrc);
                std::vector<std::uint32_t> &out = crcs[c.shard].second;
                for (std::int64_t at = 0; at < c.bytes; at += block) {
                    out[static_cast<std::size_t>((c.begin + at) / block)] =
                        detail::Crc32(bytes + at, static_cast<std::size_t>(std::min(block, c.bytes - at)));
                }
            }
            const detail::PhaseTimes::Scope timed(p.times, kWrite);
            file.WriteAt(bytes, static_cast<std::size_t>(c.bytes), m.shard->byte_offset + c.begin);
            std::size_t from = 0;
            std::size_t to = 0;
            {
                std::lock_guard lock(prefix_mutex);
                written[task] = 1;
                from = prefix;
                while (prefix < chunks.size() && written[prefix] != 0) {
                    ++prefix;
                }
                to = prefix;
            }
            if (to > from) { // this thread alone advanced the prefix over [from, to)
                const std::int64_t begin = file_offset(from);
                file.StartWriteback(begin, file_offset(to - 1) + chunks[to - 1].bytes - begin);
            }
        });
        {
            const detail::PhaseTimes::Scope timed(p.times, kFsync);
            file.Close();
        }
        p.written.crcs = std::move(crcs);
    } catch (const std::exception &e) {
        p.written.error = e.what();
    }
}

/// (step, revision) of a committed directory's name "step_<N>" or "step_<N>.<revision>"; step -1 for other names.
std::pair<std::int64_t, std::int64_t> StepOf(const std::string &name) {
    static const std::regex pattern("step_([0-9]+)(\\.([0-9]+))?");
    std::smatch m;
    if (!std::regex_match(name, m, pattern)) {
        return {-1, 0};
    }
    return {std::stoll(m[1].str()), m[3].matched ? std::stoll(m[3].str()) : 0};
}

/// Keeps the newest `keep_last` committed checkpoints (and the one `latest` names), removes stale temporaries.
void Prune(const std::string &root, const std::string &latest, int keep_last) {
    std::vector<std::pair<std::pair<std::int64_t, std::int64_t>, std::string>> committed;
    for (const auto &entry : fs::directory_iterator(root)) {
        const std::string name = entry.path().filename().string();
        if (entry.is_directory() && name.rfind(".tmp_", 0) == 0) {
            detail::RemoveTree(entry.path().string());
        } else if (entry.is_directory() && StepOf(name).first >= 0 && fs::exists(entry.path() / kMetadataFile)) {
            committed.emplace_back(StepOf(name), name);
        }
    }
    if (keep_last <= 0 || static_cast<int>(committed.size()) <= keep_last) {
        return;
    }
    std::sort(committed.begin(), committed.end());
    for (std::size_t i = 0; i + static_cast<std::size_t>(keep_last) < committed.size(); ++i) {
        if (committed[i].second != latest) {
            detail::RemoveTree((fs::path(root) / committed[i].second).string());
        }
    }
    detail::FsyncDir(root);
}

/// Rank 0: metadata.json, then the renames that commit. Returns the committed directory's name.
std::string CommitOnRank0(const PendingSave &p, const std::vector<double> &crcs, const SaveOptions &options) {
    Metadata m;
    m.library_version = SHARDLINE_VERSION;
    m.step = p.step;
    m.world_size = p.plan.world_size;
    m.block_bytes = p.plan.block_bytes;
    for (int r = 0; r < p.plan.world_size; ++r) {
        if (p.plan.file_bytes[static_cast<std::size_t>(r)] > 0 || r == 0) {
            m.files.push_back(
                {.name = detail::RankFileName(r), .rank = r, .bytes = p.plan.file_bytes[static_cast<std::size_t>(r)]});
        }
    }
    m.tensors = p.plan.tensors;
    for (const detail::PlannedShard &shard : p.plan.shards) {
        ShardRecord record{.offset = shard.offset,
                           .shape = shard.shape,
                           .file = detail::RankFileName(shard.writer),
                           .byte_offset = shard.byte_offset,
                           .length = shard.length,
                           .block_crc32 = {}};
        for (std::int64_t b = 0; b < shard.num_blocks; ++b) {
            record.block_crc32.push_back(
                static_cast<std::uint32_t>(crcs[static_cast<std::size_t>(shard.first_block + b)]));
        }
        m.tensors[static_cast<std::size_t>(shard.tensor)].shards.push_back(std::move(record));
    }
    m.extra = p.extra;
    detail::WriteTextSynced((fs::path(p.tmp) / kMetadataFile).string(), ToJson(m).dump(1) + "\n");
    detail::FsyncDir(p.tmp);
    if (options.before_commit) {
        options.before_commit();
    }
    // A re-save of a step gets a new revision ("step_<N>.1", ...): rename cannot replace a non-empty directory, and
    // moving the old one aside first would leave `latest` naming nothing until the second rename.
    std::string name = StepName(p.step);
    for (int revision = 1; fs::exists(fs::path(p.root) / name); ++revision) {
        name = fmt::format("{}.{}", StepName(p.step), revision);
    }
    detail::RenameSynced(p.tmp, (fs::path(p.root) / name).string(), p.root);
    const std::string latest_tmp = (fs::path(p.root) / ".latest.tmp").string();
    detail::WriteTextSynced(latest_tmp, name + "\n");
    detail::RenameSynced(latest_tmp, (fs::path(p.root) / "latest").string(), p.root);
    try {
        Prune(p.root, name, options.keep_last);
    } catch (const std::exception &e) { // committed already: a failed clean-up is no failed save
        SHARDLINE_LOG_WARN("ckpt::Save: step {} is committed, but removing old checkpoints failed: {}", p.step,
                           e.what());
    }
    return name;
}

/// Collective: agrees on the writes, gathers the checksums, rank 0 commits, everyone agrees on the commit.
CheckpointInfo Finish(PendingSave &p, comm::Communicator *world, const SaveOptions &options) {
    const auto start = std::chrono::steady_clock::now();
    detail::AgreeOrThrow(world, "ckpt::Save", p.written.error);
    std::vector<double> crcs(static_cast<std::size_t>(p.plan.total_blocks), 0.0);
    for (const auto &[first, blocks] : p.written.crcs) {
        for (std::size_t b = 0; b < blocks.size(); ++b) {
            crcs[static_cast<std::size_t>(first) + b] = static_cast<double>(blocks[b]);
        }
    }
    crcs = detail::AllReduceSum(world, std::move(crcs));
    std::string error;
    std::string name;
    if (p.plan.rank == 0) {
        try {
            name = CommitOnRank0(p, crcs, options);
        } catch (const std::exception &e) {
            error = e.what();
        }
    }
    detail::AgreeOrThrow(world, "ckpt::Save", error);
    // The other ranks learn the revision rank 0 committed (0 for a first save of the step).
    const std::int64_t revision = static_cast<std::int64_t>(
        detail::AllReduceMax(world, {p.plan.rank == 0 ? static_cast<double>(StepOf(name).second) : 0.0})[0]);
    name = revision == 0 ? StepName(p.step) : fmt::format("{}.{}", StepName(p.step), revision);
    p.times.Add(kCommit, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    return {.path = (fs::path(p.root) / name).string(),
            .step = p.step,
            .extra = p.extra,
            .timings = p.times.Json(kSavePhases)};
}

} // namespace

CheckpointInfo Save(const std::string &root, std::int64_t step, const TensorList &tensors, const nlohmann::json &extra,
                    comm::Communicator *world, const SaveOptions &options) {
    SHARDLINE_CHECK(step >= 0, "ckpt::Save", "step must be >= 0, got {}", step);
    const auto start = std::chrono::steady_clock::now();
    PendingSave p{
        .root = root, .tmp = {}, .step = step, .extra = extra, .plan = {}, .snapshot = {}, .written = {}, .times = {}};
    Begin(p, tensors, world, options);
    detail::HostBuffer buffer; // stays empty: no copy
    try {
        p.snapshot = TakeSnapshot(p.plan, tensors, /*copy=*/false, buffer);
    } catch (const std::exception &e) {
        p.written.error = e.what();
    }
    if (p.written.error.empty()) {
        WriteFiles(p, options.chunk_bytes);
    }
    CheckpointInfo info = Finish(p, world, options);
    info.timings["wall_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return info;
}

struct AsyncSaver::Impl {
    comm::Communicator *world = nullptr;
    SaveOptions options;
    detail::HostBuffer buffer;
    std::unique_ptr<PendingSave> pending;
    std::thread writer;
    double snapshot_seconds = 0;

    void Join() {
        if (writer.joinable()) {
            writer.join();
        }
    }
};

AsyncSaver::AsyncSaver(comm::Communicator *world, SaveOptions options) : impl_(std::make_unique<Impl>()) {
    impl_->world = world;
    impl_->options = std::move(options);
}

AsyncSaver::~AsyncSaver() {
    impl_->Join();
    if (impl_->pending != nullptr) {
        SHARDLINE_LOG_WARN("ckpt::AsyncSaver: the save of step {} was written but never committed (call Wait() before "
                           "exit); '{}' is left as a crash would leave it",
                           impl_->pending->step, impl_->pending->tmp);
    }
}

void AsyncSaver::Save(const std::string &root, std::int64_t step, const TensorList &tensors,
                      const nlohmann::json &extra) {
    Wait();
    SHARDLINE_CHECK(step >= 0, "ckpt::AsyncSaver::Save", "step must be >= 0, got {}", step);
    auto p = std::make_unique<PendingSave>();
    p->root = root;
    p->step = step;
    p->extra = extra;
    Begin(*p, tensors, impl_->world, impl_->options);
    const auto start = std::chrono::steady_clock::now();
    try {
        p->snapshot = TakeSnapshot(p->plan, tensors, /*copy=*/true, impl_->buffer);
    } catch (const std::exception &e) {
        p->written.error = e.what();
    }
    impl_->snapshot_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    p->times.Add(kSnapshot, impl_->snapshot_seconds);
    impl_->pending = std::move(p);
    if (impl_->pending->written.error.empty()) {
        PendingSave *job = impl_->pending.get();
        impl_->writer = std::thread([job, chunk = impl_->options.chunk_bytes] { WriteFiles(*job, chunk); });
    }
}

CheckpointInfo AsyncSaver::Wait() {
    impl_->Join();
    if (impl_->pending == nullptr) {
        return {};
    }
    std::unique_ptr<PendingSave> p = std::move(impl_->pending);
    return Finish(*p, impl_->world, impl_->options);
}

bool AsyncSaver::pending() const { return impl_->pending != nullptr; }

double AsyncSaver::last_snapshot_seconds() const { return impl_->snapshot_seconds; }

} // namespace shardline::ckpt
