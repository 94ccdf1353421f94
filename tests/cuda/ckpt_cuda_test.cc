// Checkpoints of CUDA training state (issue 17), one process on one GPU: bf16, fp16 and fp32 parameters with AdamW
// (fp32 masters and moments) saved from CUDA tensors while training steps overlap the async writer, and loaded into
// CUDA tensors of a fresh model: the values bitwise those of the snapshot, and training after the load bitwise the
// training that never stopped. Also the optimizer fix for half parameters (the master follows a replaced tensor, and
// ReloadModelParams an in-place write).

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <shardline/autograd/functions.h>
#include <shardline/ckpt/checkpoint.h>
#include <shardline/ckpt/metadata.h>
#include <shardline/core/error.h>
#include <shardline/nn/checkpoint.h>
#include <shardline/nn/linear.h>
#include <shardline/nn/optim.h>

#include "helpers.h"

namespace shardline::testing {
namespace {

using autograd::Variable;
using dist::DistTensor;
namespace fs = std::filesystem;

using Layers = std::vector<std::unique_ptr<nn::Linear>>;

/// bf16, fp16 and fp32 layers of odd sizes on the GPU; `seed` sets their initial values.
Layers MakeLayers(std::uint64_t seed) {
    Layers layers;
    const DType dtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
    const std::int64_t sizes[][2] = {{67, 33}, {16, 9}, {9, 5}};
    for (int i = 0; i < 3; ++i) {
        layers.push_back(
            std::make_unique<nn::Linear>(nn::LinearOptions{.in_features = sizes[i][0], .out_features = sizes[i][1]},
                                         nn::ParameterOptions{.dtype = dtypes[i],
                                                              .device = Gpu(),
                                                              .seed = seed + static_cast<std::uint64_t>(i),
                                                              .name = fmt::format("layer{}", i)}));
    }
    return layers;
}

std::vector<Variable> ParametersOf(const Layers &layers) {
    std::vector<Variable> params;
    for (const auto &layer : layers) {
        for (const Variable &p : layer->Parameters()) {
            params.push_back(p);
        }
    }
    return params;
}

/// One training step: gelu(x·Wᵀ + b) of each layer with random x and output gradient (a function of `step`).
void TrainStep(const Layers &layers, nn::AdamW &optimizer, int step) {
    optimizer.ZeroGrad();
    for (std::size_t i = 0; i < layers.size(); ++i) {
        const nn::Linear &layer = *layers[i];
        const Shape &w = layer.weight.shape();
        const DType dtype = layer.weight.dtype();
        const auto seed = static_cast<std::uint64_t>(100 * step + i);
        Variable x(RandomGpu({6, w[1]}, dtype, seed, "x"));
        Variable y = autograd::Gelu(layer.Forward(x));
        const DistTensor dy = DistTensor::Local(RandomGpu({6, w[0]}, dtype, seed, "dy"));
        y.Backward(&dy);
    }
    optimizer.Step();
}

/// Host copies of every checkpoint tensor (what the snapshot must hold).
std::vector<std::vector<unsigned char>> Bytes(const ckpt::TensorList &tensors) {
    std::vector<std::vector<unsigned char>> out;
    for (const auto &entry : tensors) {
        out.push_back(HostBytes(entry.second.local()));
    }
    return out;
}

class CheckpointCudaTest : public CudaTest {
protected:
    void SetUp() override {
        CudaTest::SetUp();
        if (IsSkipped()) {
            return;
        }
        dir_ = (fs::temp_directory_path() / fmt::format("shardline_ckpt_cuda_{}", ::getpid())).string();
        fs::remove_all(dir_);
    }
    void TearDown() override {
        if (!dir_.empty()) {
            fs::remove_all(dir_);
        }
        CudaTest::TearDown();
    }
    std::string dir_;
};

TEST_F(CheckpointCudaTest, AsyncSaveOverlapsTrainingAndALoadContinuesBitwise) {
    const nn::AdamWOptions options{.lr = 1e-2, .weight_decay = 0.1};
    Layers layers = MakeLayers(3);
    nn::AdamW optimizer(ParametersOf(layers), options);
    for (int step = 0; step < 3; ++step) {
        TrainStep(layers, optimizer, step);
    }
    const ckpt::TensorList tensors = nn::TrainingTensors(ParametersOf(layers), &optimizer);
    // bf16/fp16 parameters, fp32 masters and moments: 2 params x 3 layers + (2 moments + master if half) each.
    ASSERT_EQ(tensors.size(), 6u + 2u * 6u + 4u);
    Synchronize(Gpu());
    const std::vector<std::vector<unsigned char>> snapshot = Bytes(tensors);

    ckpt::AsyncSaver saver(nullptr);
    saver.Save(dir_, 3, tensors, {{"optimizer", nn::OptimizerScalars(optimizer)}});
    std::printf("[   INFO   ] async save: training stalled %.3f ms for the device-to-host copy\n",
                saver.last_snapshot_seconds() * 1e3);
    // Training goes on while the writer runs: the file must hold the snapshot, not these steps.
    for (int step = 3; step < 6; ++step) {
        TrainStep(layers, optimizer, step);
    }
    EXPECT_EQ(saver.Wait().step, 3);
    Synchronize(Gpu());
    const std::vector<std::vector<unsigned char>> after_six = Bytes(tensors);
    EXPECT_NE(after_six, snapshot) << "the steps after the save changed nothing";

    // A fresh model of other values on the GPU, loaded in place.
    Layers fresh = MakeLayers(40);
    nn::AdamW fresh_optimizer(ParametersOf(fresh), options);
    const ckpt::TensorList fresh_tensors = nn::TrainingTensors(ParametersOf(fresh), &fresh_optimizer);
    const ckpt::CheckpointInfo info = ckpt::Load(dir_, fresh_tensors, nullptr);
    nn::LoadOptimizerScalars(fresh_optimizer, info.extra.at("optimizer"));
    const std::vector<std::vector<unsigned char>> loaded = Bytes(fresh_tensors);
    ASSERT_EQ(loaded.size(), snapshot.size());
    for (std::size_t i = 0; i < loaded.size(); ++i) {
        EXPECT_EQ(loaded[i], snapshot[i]) << fresh_tensors[i].first << " differs from the saved snapshot";
        EXPECT_TRUE(fresh_tensors[i].second.device().is_cuda()) << fresh_tensors[i].first;
    }
    for (int step = 3; step < 6; ++step) {
        TrainStep(fresh, fresh_optimizer, step);
    }
    Synchronize(Gpu());
    const std::vector<std::vector<unsigned char>> resumed = Bytes(fresh_tensors);
    for (std::size_t i = 0; i < resumed.size(); ++i) {
        EXPECT_EQ(resumed[i], after_six[i]) << fresh_tensors[i].first << " after 3 more steps";
    }
}

TEST_F(CheckpointCudaTest, ASyncSaveOfCudaTensorsReadsBackThroughTheTool) {
    Layers layers = MakeLayers(5);
    nn::AdamW optimizer(ParametersOf(layers), {});
    TrainStep(layers, optimizer, 0);
    const ckpt::TensorList tensors = nn::TrainingTensors(ParametersOf(layers), &optimizer);
    const ckpt::CheckpointInfo info = ckpt::Save(dir_, 1, tensors, {}, nullptr);
    const ckpt::Metadata meta = ckpt::ReadMetadata(info.path);
    EXPECT_TRUE(ckpt::VerifyCheckpoint(info.path, meta).empty());
    for (const auto &[name, t] : tensors) {
        const ckpt::TensorRecord *record = meta.Find(name);
        ASSERT_NE(record, nullptr) << name;
        EXPECT_EQ(record->dtype, t.dtype()) << name;
        EXPECT_EQ(HostBytes(ckpt::ReadFullTensor(info.path, meta, *record)), HostBytes(t.local())) << name;
    }
}

// The streamed pipelines with CUDA tensors: a synchronous save copies chunks to pinned slots on 8 workers at once
// (small chunks: many device-to-host copies in flight on the compute stream), a load copies chunks to the device
// through the workers' slots after the reads; with the default 16 MiB chunks a 24 MiB tensor takes two. A CPU tensor
// rides along. Every tensor reads back bitwise; a flipped byte is an error that writes nothing into the GPU tensors.
TEST_F(CheckpointCudaTest, StreamedSaveAndLoadOfCudaTensorsAreBitwise) {
    const auto make = [](std::uint64_t seed) {
        ckpt::TensorList list;
        list.emplace_back("big", DistTensor::Local(RandomGpu({3000, 2000}, DType::kFloat32, seed, "big")));
        list.emplace_back("half", DistTensor::Local(RandomGpu({1001, 999}, DType::kBFloat16, seed, "half")));
        list.emplace_back("odd", DistTensor::Local(RandomGpu({257, 131}, DType::kFloat16, seed, "odd")));
        list.emplace_back("host",
                          DistTensor::Local(RandomGpu({33, 17}, DType::kFloat32, seed, "host").To(Device::CPU())));
        return list;
    };
    const ckpt::TensorList saved = make(11);
    Synchronize(Gpu());
    const std::vector<std::vector<unsigned char>> want = Bytes(saved);
    ckpt::SaveOptions small;
    small.block_bytes = 1000;
    small.chunk_bytes = 3000;
    ckpt::LoadOptions small_load;
    small_load.chunk_bytes = 5000;
    for (const bool chunked : {true, false}) {
        SCOPED_TRACE(chunked ? "1000-byte blocks, 3000/5000-byte chunks" : "default blocks and chunks");
        const std::string root = dir_ + (chunked ? "/small" : "/default");
        const ckpt::CheckpointInfo info =
            ckpt::Save(root, 1, saved, {}, nullptr, chunked ? small : ckpt::SaveOptions{});
        EXPECT_GT(info.timings.at("d2h_s").get<double>(), 0.0) << info.timings.dump();
        const ckpt::TensorList loaded = make(12);
        const ckpt::CheckpointInfo back = ckpt::Load(root, loaded, nullptr, chunked ? small_load : ckpt::LoadOptions{});
        EXPECT_GT(back.timings.at("h2d_s").get<double>(), 0.0) << back.timings.dump();
        const std::vector<std::vector<unsigned char>> got = Bytes(loaded);
        for (std::size_t i = 0; i < got.size(); ++i) {
            EXPECT_EQ(got[i], want[i]) << loaded[i].first;
        }
        EXPECT_TRUE(loaded[0].second.device().is_cuda());
    }
    // A flipped byte in the middle of "big": every block is checked, and the GPU tensors keep their values.
    const std::string root = dir_ + "/small";
    const ckpt::Metadata meta = ckpt::ReadMetadata(ckpt::ResolveCheckpoint(root));
    const ckpt::ShardRecord &shard = meta.Find("big")->shards.at(0);
    const std::string file = (fs::path(ckpt::ResolveCheckpoint(root)) / shard.file).string();
    {
        std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
        f.seekg(shard.byte_offset + shard.length / 2);
        char c = 0;
        f.read(&c, 1);
        c = static_cast<char>(c ^ 0x01);
        f.seekp(shard.byte_offset + shard.length / 2);
        f.write(&c, 1);
    }
    const ckpt::TensorList other = make(13);
    Synchronize(Gpu());
    const std::vector<std::vector<unsigned char>> before = Bytes(other);
    std::string error;
    try {
        ckpt::Load(root, other, nullptr, small_load);
    } catch (const Error &e) {
        error = e.what();
    }
    EXPECT_NE(error.find("checksum mismatch"), std::string::npos) << error;
    EXPECT_NE(error.find("tensor 'big'"), std::string::npos) << error;
    EXPECT_EQ(Bytes(other), before) << "a failed load wrote into the tensors";
}

// The optimizer fix for half parameters: a replaced tensor re-derives the fp32 master; ReloadModelParams follows an
// in-place write. Each run is compared with a twin optimizer built on the new values from the start of that step.
TEST_F(CheckpointCudaTest, AHalfParametersMasterFollowsSetValueAndReloadModelParams) {
    for (const bool replace : {true, false}) {
        SCOPED_TRACE(replace ? "SetValue" : "in-place write + ReloadModelParams");
        Layers layers = MakeLayers(7);
        nn::AdamW optimizer(ParametersOf(layers), {.lr = 1e-2});
        TrainStep(layers, optimizer, 0);
        Variable &w = layers[0]->weight; // bf16
        const Tensor fresh = RandomGpu(w.local().shape(), DType::kBFloat16, 77, "fresh");
        if (replace) {
            w.SetValue(DistTensor::Local(fresh.Clone()));
        } else {
            Tensor local = w.local();
            local.CopyFrom(fresh);
            optimizer.ReloadModelParams();
        }
        std::vector<nn::Optimizer::ParamState> state = optimizer.State();
        EXPECT_EQ(HostBytes(state[0].tensors.back().second), HostBytes(fresh.To(DType::kFloat32)))
            << "the master is the new value";
        TrainStep(layers, optimizer, 1);
        EXPECT_NE(HostBytes(w.local()), HostBytes(fresh)) << "the new tensor was updated";
    }
}

} // namespace
} // namespace shardline::testing
