// Save: plan (plan.cc), snapshot to host memory, write and fsync one file per rank, then the collective commit.
// AsyncSaver runs the write on a thread and the commit at the next Save() or Wait().

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
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

namespace shardline::ckpt {
namespace {

namespace fs = std::filesystem;

std::string StepName(std::int64_t step) { return fmt::format("step_{:08d}", step); }

/// The bytes this rank writes, shard by shard in plan order (pointers into the tensors or into a host snapshot).
struct Snapshot {
    std::vector<const void *> data; ///< one per shard this rank writes
    std::vector<Tensor> keep_alive;
};

/// What the writer hands to the commit.
struct Written {
    std::string error;
    std::vector<std::pair<std::int64_t, std::vector<std::uint32_t>>> crcs; ///< (first block, block crcs)
};

/// A pending save between its snapshot and its commit.
struct PendingSave {
    std::string root;
    std::string tmp;
    std::int64_t step = 0;
    nlohmann::json extra;
    detail::SavePlan plan;
    Snapshot snapshot;
    Written written;
};

/// Plans, checks that every rank planned the same tensors, and has rank 0 create the temporary directory.
void Begin(PendingSave &p, const TensorList &tensors, comm::Communicator *world, const SaveOptions &options) {
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

/// The host bytes of this rank's shards: CPU tensors in place unless `copy`; CUDA tensors copied into `buffer`.
Snapshot TakeSnapshot(const detail::SavePlan &plan, const TensorList &tensors, bool copy, detail::HostBuffer &buffer) {
    Snapshot s;
    std::int64_t staged = 0;
    bool any_cuda = false;
    for (const detail::PlannedShard &shard : plan.shards) {
        const Tensor &local = tensors[static_cast<std::size_t>(shard.tensor)].second.local();
        if (shard.writer == plan.rank && (copy || !local.device().is_cpu())) {
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
        if (!copy && local.device().is_cpu()) {
            s.data.push_back(local.data());
            s.keep_alive.push_back(local);
            continue;
        }
        Tensor dst = Tensor::FromBlob(host, local.shape(), local.dtype(), Device::CPU());
        dst.CopyFrom(local);
        if (!local.device().is_cpu() && std::find(devices.begin(), devices.end(), local.device()) == devices.end()) {
            devices.push_back(local.device());
        }
        s.data.push_back(host);
        host += shard.length;
    }
    for (Device d : devices) {
        Synchronize(d);
    }
    return s;
}

/// The block crc32s of `shards` ((first block, crcs) per shard), blocks spread over up to 4 threads.
std::vector<std::pair<std::int64_t, std::vector<std::uint32_t>>>
Checksums(const std::vector<std::pair<const detail::PlannedShard *, const void *>> &shards, std::int64_t block) {
    std::vector<std::pair<std::int64_t, std::vector<std::uint32_t>>> out;
    std::vector<std::pair<std::size_t, std::int64_t>> blocks; // (shard, block)
    for (std::size_t i = 0; i < shards.size(); ++i) {
        out.emplace_back(shards[i].first->first_block,
                         std::vector<std::uint32_t>(static_cast<std::size_t>(shards[i].first->num_blocks)));
        for (std::int64_t b = 0; b < shards[i].first->num_blocks; ++b) {
            blocks.emplace_back(i, b);
        }
    }
    std::atomic<std::size_t> next{0};
    auto work = [&] {
        for (std::size_t k = next++; k < blocks.size(); k = next++) {
            const auto [i, b] = blocks[k];
            const detail::PlannedShard &shard = *shards[i].first;
            const std::int64_t begin = b * block;
            const std::int64_t bytes = std::min(block, shard.length - begin);
            out[i].second[static_cast<std::size_t>(b)] =
                detail::Crc32(static_cast<const char *>(shards[i].second) + begin, static_cast<std::size_t>(bytes));
        }
    };
    const std::size_t threads =
        std::min<std::size_t>(blocks.size(), std::max(1u, std::min(4u, std::thread::hardware_concurrency())));
    std::vector<std::thread> pool;
    for (std::size_t t = 1; t < threads; ++t) {
        pool.emplace_back(work);
    }
    work();
    for (std::thread &t : pool) {
        t.join();
    }
    return out;
}

/// Writes and fsyncs this rank's file (no collective: may run on a thread). Never throws.
void WriteFiles(PendingSave &p) noexcept {
    try {
        const std::string path = (fs::path(p.tmp) / detail::RankFileName(p.plan.rank)).string();
        std::vector<std::pair<const detail::PlannedShard *, const void *>> mine;
        std::size_t k = 0;
        for (const detail::PlannedShard &shard : p.plan.shards) {
            if (shard.writer == p.plan.rank) {
                mine.emplace_back(&shard, p.snapshot.data[k++]);
            }
        }
        // The checksums on other threads while this one writes: the bytes are in memory already, so the two overlap
        // and the save runs at the slower of the disk and crc32 (a few blocks at once), not their sum.
        auto crcs =
            std::async(std::launch::async, [&mine, block = p.plan.block_bytes] { return Checksums(mine, block); });
        detail::OutFile file(path);
        try {
            for (const auto &[shard, data] : mine) {
                file.Write(data, static_cast<std::size_t>(shard->length));
            }
            file.Close();
        } catch (...) {
            crcs.wait();
            throw;
        }
        p.written.crcs = crcs.get();
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
    return {.path = (fs::path(p.root) / name).string(), .step = p.step, .extra = p.extra};
}

} // namespace

CheckpointInfo Save(const std::string &root, std::int64_t step, const TensorList &tensors, const nlohmann::json &extra,
                    comm::Communicator *world, const SaveOptions &options) {
    SHARDLINE_CHECK(step >= 0, "ckpt::Save", "step must be >= 0, got {}", step);
    PendingSave p{.root = root, .tmp = {}, .step = step, .extra = extra, .plan = {}, .snapshot = {}, .written = {}};
    Begin(p, tensors, world, options);
    detail::HostBuffer buffer;
    try {
        p.snapshot = TakeSnapshot(p.plan, tensors, /*copy=*/false, buffer);
    } catch (const std::exception &e) {
        p.written.error = e.what();
    }
    if (p.written.error.empty()) {
        WriteFiles(p);
    }
    return Finish(p, world, options);
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
    impl_->pending = std::move(p);
    if (impl_->pending->written.error.empty()) {
        PendingSave *job = impl_->pending.get();
        impl_->writer = std::thread([job] { WriteFiles(*job); });
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
