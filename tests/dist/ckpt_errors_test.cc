// Checkpoint errors (issue 17): a flipped byte, a truncated file, a missing file, another model shape or a tensor the
// checkpoint lacks is an Error on every rank (the same text, naming the file, the tensor and what differs), raised
// before any tensor is written; a rank that read nothing wrong still raises, and nothing hangs.

#include <filesystem>
#include <fstream>
#include <functional>
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

template <class F> std::string ErrorOf(F &&f) {
    try {
        f();
    } catch (const Error &e) {
        return e.what();
    }
    return "(no error)";
}

/// A checkpoint of the test model on the world as 1×W; returns its directory.
class CheckpointErrorTest : public ::testing::Test {
protected:
    void SetUp() override {
        SHARDLINE_DIST_TENSOR_TEST_BACKEND();
        root_ = SharedTempDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
        mesh_ = MakeDpTp(1, World().size());
        path_ = ckpt::Save(root_, 5, MakeTensors(*mesh_.mesh, kSaved), {{"step", 5}}, mesh_.comm.get()).path;
        meta_ = ckpt::ReadMetadata(path_);
    }

    /// Rank 0 changes the files, then every rank loads into tensors of other values, which must stay untouched.
    std::string LoadAfter(const std::function<void()> &damage) {
        if (World().rank() == 0) {
            damage();
        }
        World().Barrier()->Wait(true);
        const ckpt::TensorList tensors = MakeTensors(*mesh_.mesh, kOther);
        const std::string error = ErrorOf([&] { ckpt::Load(root_, tensors, mesh_.comm.get()); });
        ExpectHolds(tensors, kOther, "a failed load writes nothing");
        return error;
    }

    /// The file holding the last shard of `tensor` (on W > 1 often another rank's than rank 0's).
    const ckpt::ShardRecord &LastShard(const std::string &tensor) const { return meta_.Find(tensor)->shards.back(); }

    std::string root_;
    std::string path_;
    SubMesh mesh_;
    ckpt::Metadata meta_;
};

TEST_F(CheckpointErrorTest, AFlippedByteIsAChecksumErrorOnEveryRank) {
    const ckpt::ShardRecord shard = LastShard("row.weight");
    const std::string file = (fs::path(path_) / shard.file).string();
    const std::string error = LoadAfter([&] {
        std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
        f.seekg(shard.byte_offset + 2);
        char c = 0;
        f.read(&c, 1);
        c = static_cast<char>(c ^ 0x10);
        f.seekp(shard.byte_offset + 2);
        f.write(&c, 1);
    });
    EXPECT_THAT(error, HasSubstr("checksum mismatch"));
    EXPECT_THAT(error, HasSubstr(shard.file));
    EXPECT_THAT(error, HasSubstr("tensor 'row.weight'"));
    // The tool's full verification finds it too.
    const std::vector<std::string> problems = ckpt::VerifyCheckpoint(path_, meta_);
    ASSERT_EQ(problems.size(), 1u);
    EXPECT_THAT(problems[0], HasSubstr("row.weight"));
}

// Streamed with chunks far smaller than the shards (8-byte blocks, 2-block read chunks): the flipped block is found
// wherever its chunk lands among the workers, and the same error reaches every rank.
TEST_F(CheckpointErrorTest, AFlippedByteAmongManySmallChunksIsAChecksumErrorOnEveryRank) {
    ckpt::SaveOptions save;
    save.block_bytes = 8;
    save.chunk_bytes = 24;
    const std::string root = SharedTempDir("small_chunks");
    const std::string path = ckpt::Save(root, 5, MakeTensors(*mesh_.mesh, kSaved), {}, mesh_.comm.get(), save).path;
    const ckpt::ShardRecord shard = ckpt::ReadMetadata(path).Find("row.weight")->shards.back();
    if (World().rank() == 0) {
        std::fstream f((fs::path(path) / shard.file).string(), std::ios::in | std::ios::out | std::ios::binary);
        const std::int64_t at = shard.byte_offset + shard.length - 5; // inside the shard's last (short) block
        f.seekg(at);
        char c = 0;
        f.read(&c, 1);
        c = static_cast<char>(c ^ 0x40);
        f.seekp(at);
        f.write(&c, 1);
    }
    World().Barrier()->Wait(true);
    ckpt::LoadOptions load;
    load.chunk_bytes = 16;
    const ckpt::TensorList tensors = MakeTensors(*mesh_.mesh, kOther);
    const std::string error = ErrorOf([&] { ckpt::Load(root, tensors, mesh_.comm.get(), load); });
    ExpectHolds(tensors, kOther, "a failed load writes nothing");
    EXPECT_THAT(error, HasSubstr("checksum mismatch"));
    EXPECT_THAT(error, HasSubstr("tensor 'row.weight'"));
    EXPECT_THAT(error, HasSubstr(shard.file));
}

TEST_F(CheckpointErrorTest, ATruncatedFileIsNamedOnEveryRank) {
    const ckpt::ShardRecord shard = LastShard("col.weight");
    const std::string file = (fs::path(path_) / shard.file).string();
    const std::string error =
        LoadAfter([&] { fs::resize_file(file, static_cast<std::uintmax_t>(shard.byte_offset + 3)); });
    EXPECT_THAT(error, HasSubstr("is truncated"));
    EXPECT_THAT(error, HasSubstr(shard.file));
    EXPECT_THAT(error, HasSubstr("tensor '")); // the first tensor read from the short part of the file
}

TEST_F(CheckpointErrorTest, AMissingFileIsNamedOnEveryRank) {
    const ckpt::ShardRecord shard = LastShard("coshard");
    const std::string error = LoadAfter([&] { fs::remove(fs::path(path_) / shard.file); });
    EXPECT_THAT(error, HasSubstr("is missing"));
    EXPECT_THAT(error, HasSubstr(shard.file));
}

TEST_F(CheckpointErrorTest, AnotherModelShapeNamesTheTensorAndBothShapes) {
    World().Barrier()->Wait(true);
    ckpt::TensorList tensors = MakeTensors(*mesh_.mesh, kOther);
    tensors[0].second = DistTensor::Sharded(RandomFull({10, 7}, "wider"), *mesh_.mesh, {{.dim = 0, .over = {"tp"}}});
    const std::string error = ErrorOf([&] { ckpt::Load(root_, tensors, mesh_.comm.get()); });
    EXPECT_THAT(error, HasSubstr("tensor 'col.weight' has the shape [10,7] in the model, [10,6] in the checkpoint"));
}

TEST_F(CheckpointErrorTest, AnotherDTypeAndAMissingTensorAreNamed) {
    ckpt::TensorList tensors = MakeTensors(*mesh_.mesh, kOther);
    tensors[2].second = DistTensor::Replicated(RandomFull({7}, "b", DType::kFloat64), *mesh_.mesh);
    EXPECT_THAT(ErrorOf([&] { ckpt::Load(root_, tensors, mesh_.comm.get()); }),
                HasSubstr("tensor 'row.bias' is float64 in the model, float32 in the checkpoint"));
    ckpt::TensorList more = MakeTensors(*mesh_.mesh, kOther);
    more.emplace_back("head.weight", DistTensor::Replicated(RandomFull({3}, "h"), *mesh_.mesh));
    EXPECT_THAT(ErrorOf([&] { ckpt::Load(root_, more, mesh_.comm.get()); }),
                HasSubstr("tensor 'head.weight' of the model is not in the checkpoint"));
    ckpt::TensorList fewer = MakeTensors(*mesh_.mesh, kOther);
    fewer.pop_back();
    EXPECT_THAT(ErrorOf([&] { ckpt::Load(root_, fewer, mesh_.comm.get(), {.strict = true}); }),
                HasSubstr("holds tensor 'half', which the model lacks"));
}

TEST_F(CheckpointErrorTest, ADirectoryWithoutACheckpointIsNamed) {
    const ckpt::TensorList tensors = MakeTensors(*mesh_.mesh, kOther);
    EXPECT_THAT(ErrorOf([&] { ckpt::Load(root_ + "/nowhere", tensors, mesh_.comm.get()); }),
                HasSubstr("is no checkpoint"));
}

TEST_F(CheckpointErrorTest, RanksThatSaveDifferentTensorListsAllRaise) {
    if (World().size() == 1) {
        GTEST_SKIP() << "needs two ranks";
    }
    ckpt::TensorList tensors = MakeTensors(*mesh_.mesh, kSaved);
    if (World().rank() == 1) {
        tensors.pop_back();
    }
    EXPECT_THAT(ErrorOf([&] { ckpt::Save(root_, 6, tensors, {}, mesh_.comm.get()); }),
                HasSubstr("the ranks passed different tensor lists"));
}

TEST_F(CheckpointErrorTest, APartialTensorIsRefusedBeforeAnythingIsWritten) {
    ckpt::TensorList tensors = MakeTensors(*mesh_.mesh, kSaved);
    const DistTensor &bias = tensors[2].second;
    tensors[2].second = DistTensor::FromTrustedShard(
        bias.local(), bias.global_shape(), bias.layout().WithPartial({{1, spmd::ReduceOp::kSum}}), bias.mesh_ptr());
    EXPECT_THAT(ErrorOf([&] { ckpt::Save(root_, 6, tensors, {}, mesh_.comm.get()); }),
                HasSubstr("tensor 'row.bias' is Partial"));
    EXPECT_FALSE(fs::exists(fs::path(root_) / "step_00000006"));
}

} // namespace
} // namespace shardline::ckpt_test
