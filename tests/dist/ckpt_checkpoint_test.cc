// Distributed checkpoints (issue 17): saves on dp×tp = 1×1, 1×2 and 2×2 loaded on 1×1, 1×4, 2×1 (and the save's own
// mesh), every tensor bitwise equal to the saved global tensor; each shard written once and spread over the replicas;
// async saves keep the values of their snapshot; a crash before the commit leaves the previous checkpoint; keep_last.
// One job of N ranks runs every mesh that fits in N, on sub-worlds of its first ranks.

#include <algorithm>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <shardline/ckpt/checkpoint.h>
#include <shardline/ckpt/metadata.h>
#include <shardline/core/error.h>

#include "ckpt_test_util.h"

namespace shardline::ckpt_test {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr std::uint64_t kSaved = 7;
constexpr std::uint64_t kOther = 99;

struct MeshShape {
    std::int64_t dp;
    std::int64_t tp;
};

std::string Name(MeshShape m) { return fmt::format("{}x{}", m.dp, m.tp); }

bool Fits(MeshShape m) { return m.dp * m.tp <= World().size(); }

/// Saves on every dp×tp that fits, loads each onto every dp×tp that fits, and checks every tensor bitwise.
void ReshardEverySaveOntoEveryLoad(const std::string &dir, const ckpt::SaveOptions &save,
                                   const ckpt::LoadOptions &load) {
    const std::vector<MeshShape> saves = {{1, 1}, {1, 2}, {2, 2}};
    const std::vector<MeshShape> loads = {{1, 1}, {1, 4}, {2, 1}, {1, 2}, {2, 2}};
    for (MeshShape s : saves) {
        if (!Fits(s)) {
            continue;
        }
        const std::string root = dir + "/" + Name(s);
        {
            SubMesh m = MakeDpTp(s.dp, s.tp);
            if (m.mesh) {
                const ckpt::CheckpointInfo info = ckpt::Save(root, 20, MakeTensors(*m.mesh, kSaved),
                                                             {{"step", 20}, {"note", Name(s)}}, m.comm.get(), save);
                EXPECT_EQ(info.step, 20);
                EXPECT_EQ(fs::path(info.path).filename().string(), "step_00000020");
            }
        }
        for (MeshShape l : loads) {
            if (!Fits(l)) {
                continue;
            }
            SCOPED_TRACE(fmt::format("saved on {}, loaded on {}", Name(s), Name(l)));
            SubMesh m = MakeDpTp(l.dp, l.tp);
            if (!m.mesh) {
                continue;
            }
            const ckpt::TensorList tensors = MakeTensors(*m.mesh, kOther); // other values: all must come from the file
            const ckpt::CheckpointInfo info = ckpt::Load(root, tensors, m.comm.get(), load);
            EXPECT_EQ(info.step, 20);
            EXPECT_EQ(info.extra.at("note"), Name(s));
            EXPECT_TRUE(info.timings.contains("read_s") && info.timings.contains("wall_s")) << info.timings.dump();
            ExpectHolds(tensors, kSaved, Name(s) + " -> " + Name(l));
        }
    }
}

TEST(CheckpointTest, ReshardsEverySaveMeshOntoEveryLoadMesh) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    ReshardEverySaveOntoEveryLoad(SharedTempDir("reshard"), {}, {});
}

// The streamed pipelines with chunks far smaller than the shards: 8-byte checksum blocks, 3-block save chunks and
// 2-block read chunks cut rows in the middle, so a load places chunks read straight into the staging (a contiguous
// overlap), chunks at an overlap's ends and chunks of boxes (row pieces clipped at both ends), every tensor bitwise.
TEST(CheckpointTest, ChunksSmallerThanTheShardsReshardBitwise) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    ckpt::SaveOptions save;
    save.block_bytes = 8;
    save.chunk_bytes = 24;
    ckpt::LoadOptions load;
    load.chunk_bytes = 16;
    ReshardEverySaveOntoEveryLoad(SharedTempDir("small_chunks"), save, load);
    // Chunks that are not a whole number of blocks round down to whole blocks (one at least).
    load.chunk_bytes = 5;
    SubMesh m = MakeDpTp(1, World().size());
    const std::string root = SharedTempDir("odd_chunks");
    save.chunk_bytes = 13;
    const ckpt::CheckpointInfo saved = ckpt::Save(root, 3, MakeTensors(*m.mesh, kSaved), {}, m.comm.get(), save);
    EXPECT_TRUE(saved.timings.contains("crc32_s") && saved.timings.contains("fsync_s")) << saved.timings.dump();
    const ckpt::TensorList tensors = MakeTensors(*m.mesh, kOther);
    ckpt::Load(root, tensors, m.comm.get(), load);
    ExpectHolds(tensors, kSaved, "13-byte save chunks, 5-byte read chunks over 8-byte blocks");
}

// Each distinct shard once: the files hold exactly the model's bytes, and replicated tensors are spread over ranks.
TEST(CheckpointTest, EachShardIsWrittenOnceByRanksSpreadOverTheReplicas) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const std::string dir = SharedTempDir("spread");
    const MeshShape shape{World().size(), 1}; // dp = world: every tensor replicated on every rank
    SubMesh m = MakeDpTp(shape.dp, shape.tp);
    const ckpt::TensorList tensors = MakeTensors(*m.mesh, kSaved);
    const ckpt::CheckpointInfo info = ckpt::Save(dir, 1, tensors, {}, m.comm.get());
    const ckpt::Metadata meta = ckpt::ReadMetadata(info.path);
    std::int64_t model_bytes = 0;
    for (const Spec &s : ModelSpecs()) {
        model_bytes += Numel(s.shape) * static_cast<std::int64_t>(ElementSize(s.dtype));
    }
    std::int64_t file_bytes = 0;
    int writers = 0;
    for (const ckpt::FileRecord &f : meta.files) {
        EXPECT_EQ(fs::file_size(fs::path(info.path) / f.name), static_cast<std::uintmax_t>(f.bytes)) << f.name;
        file_bytes += f.bytes;
        writers += f.bytes > 0 ? 1 : 0;
    }
    EXPECT_EQ(file_bytes, model_bytes);
    EXPECT_EQ(writers, std::min<int>(World().size(), static_cast<int>(ModelSpecs().size())));
    for (const Spec &s : ModelSpecs()) {
        bool over_dp = false;
        for (const dist::ShardOn &on : s.shards) {
            over_dp = over_dp || std::find(on.over.begin(), on.over.end(), "dp") != on.over.end();
        }
        if (!over_dp) {
            EXPECT_EQ(meta.Find(s.name)->shards.size(), 1u) << s.name << " is replicated on every rank: one shard";
        }
    }
    EXPECT_TRUE(ckpt::VerifyCheckpoint(info.path, meta).empty());
}

// The snapshot is taken at Save(): in-place changes made while the writer runs (training steps) are not in the file.
TEST(CheckpointTest, AsyncSaveKeepsTheValuesOfItsSnapshotAndCommitsAtTheNextSave) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const std::string dir = SharedTempDir("async");
    SubMesh m = MakeDpTp(World().size() >= 4 ? 2 : 1, World().size() >= 4 ? World().size() / 2 : World().size());
    ckpt::TensorList tensors = MakeTensors(*m.mesh, kSaved);
    ckpt::AsyncSaver saver(m.comm.get());
    saver.Save(dir, 1, tensors, {{"step", 1}});
    EXPECT_TRUE(saver.pending());
    const ckpt::TensorList changed = MakeTensors(*m.mesh, kSaved + 1);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
        Tensor local = tensors[i].second.local();
        local.CopyFrom(changed[i].second.local()); // a training step while the writer runs
    }
    saver.Save(dir, 2, tensors, {{"step", 2}}); // commits step 1 first
    EXPECT_TRUE(fs::exists(fs::path(dir) / "step_00000001" / ckpt::kMetadataFile));
    const ckpt::CheckpointInfo second = saver.Wait();
    EXPECT_EQ(second.step, 2);
    EXPECT_FALSE(saver.pending());

    const ckpt::TensorList first = MakeTensors(*m.mesh, kOther);
    EXPECT_EQ(ckpt::Load(dir + "/step_00000001", first, m.comm.get()).step, 1);
    ExpectHolds(first, kSaved, "async step 1");
    const ckpt::TensorList latest = MakeTensors(*m.mesh, kOther);
    EXPECT_EQ(ckpt::Load(dir, latest, m.comm.get()).step, 2);
    ExpectHolds(latest, kSaved + 1, "async step 2");
}

TEST(CheckpointTest, ACrashBeforeTheCommitLeavesThePreviousCheckpointLoadable) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const std::string dir = SharedTempDir("crash");
    SubMesh m = MakeDpTp(1, World().size());
    ckpt::Save(dir, 1, MakeTensors(*m.mesh, kSaved), {{"step", 1}}, m.comm.get());
    const ckpt::SaveOptions crash{.before_commit = [] { throw std::runtime_error("simulated crash before commit"); }};
    std::string error;
    try {
        ckpt::Save(dir, 2, MakeTensors(*m.mesh, kSaved + 1), {{"step", 2}}, m.comm.get(), crash);
    } catch (const Error &e) {
        error = e.what();
    }
    EXPECT_THAT(error, HasSubstr("simulated crash before commit")) << "every rank raises";
    // The partial save is a temporary directory, never `latest`; the load finds step 1.
    EXPECT_TRUE(fs::exists(fs::path(dir) / ".tmp_step_00000002"));
    EXPECT_FALSE(fs::exists(fs::path(dir) / "step_00000002"));
    EXPECT_EQ(fs::path(ckpt::ResolveCheckpoint(dir)).filename().string(), "step_00000001");
    const ckpt::TensorList loaded = MakeTensors(*m.mesh, kOther);
    EXPECT_EQ(ckpt::Load(dir, loaded, m.comm.get()).step, 1);
    ExpectHolds(loaded, kSaved, "after the crash");
    // The next save commits and clears the leftovers.
    ckpt::Save(dir, 3, MakeTensors(*m.mesh, kSaved + 2), {}, m.comm.get());
    World().Barrier()->Wait(true);
    EXPECT_FALSE(fs::exists(fs::path(dir) / ".tmp_step_00000002"));
    EXPECT_EQ(fs::path(ckpt::ResolveCheckpoint(dir)).filename().string(), "step_00000003");
}

// Saving a step again never leaves `latest` without a directory: the new save is a revision beside the old one.
TEST(CheckpointTest, ASecondSaveOfAStepCommitsARevision) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const std::string dir = SharedTempDir("revision");
    SubMesh m = MakeDpTp(1, World().size());
    ckpt::Save(dir, 5, MakeTensors(*m.mesh, kSaved), {}, m.comm.get());
    const ckpt::CheckpointInfo again = ckpt::Save(dir, 5, MakeTensors(*m.mesh, kSaved + 1), {}, m.comm.get());
    EXPECT_EQ(fs::path(again.path).filename().string(), "step_00000005.1");
    EXPECT_EQ(fs::path(ckpt::ResolveCheckpoint(dir)).filename().string(), "step_00000005.1");
    const ckpt::TensorList loaded = MakeTensors(*m.mesh, kOther);
    EXPECT_EQ(ckpt::Load(dir, loaded, m.comm.get()).step, 5);
    ExpectHolds(loaded, kSaved + 1, "the revision");
    const ckpt::TensorList first = MakeTensors(*m.mesh, kOther);
    ckpt::Load(dir + "/step_00000005", first, m.comm.get());
    ExpectHolds(first, kSaved, "the first save of the step");
}

TEST(CheckpointTest, KeepLastKeepsTheNewestCheckpoints) {
    SHARDLINE_DIST_TENSOR_TEST_BACKEND();
    const std::string dir = SharedTempDir("keep");
    SubMesh m = MakeDpTp(1, World().size());
    ckpt::SaveOptions keep;
    keep.keep_last = 2;
    for (int step = 1; step <= 4; ++step) {
        ckpt::Save(dir, step * 10, MakeTensors(*m.mesh, kSaved + static_cast<std::uint64_t>(step)), {}, m.comm.get(),
                   keep);
    }
    World().Barrier()->Wait(true);
    std::vector<std::string> names;
    for (const auto &entry : fs::directory_iterator(dir)) {
        names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_00000030", "step_00000040"}));
    const ckpt::TensorList loaded = MakeTensors(*m.mesh, kOther);
    ckpt::Load(dir, loaded, m.comm.get());
    ExpectHolds(loaded, kSaved + 4, "the newest");
}

} // namespace
} // namespace shardline::ckpt_test
