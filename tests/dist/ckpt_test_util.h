#pragma once

// Shared by the checkpoint tests: a directory every rank agrees on, sub-worlds of the first n ranks (so one job of 4
// ranks saves on 2×2 and loads on 1×1, 1×4 and 2×1), and the tensors of a small sharded "model" with uneven and empty
// shards, built from full tensors of random values that every rank makes alike.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <shardline/ckpt/checkpoint.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/dist/dist_tensor.h>

#include "dist_tensor_test_util.h"

namespace shardline::ckpt_test {

using namespace dist_test;

/// The directories SharedTempDir made, removed by rank 0 after the last test (the test main agrees after every test,
/// so no rank reads them any more).
inline std::vector<std::string> &TempDirs() {
    static std::vector<std::string> dirs;
    return dirs;
}
class TempDirEnvironment : public ::testing::Environment {
public:
    void TearDown() override {
        if (World().rank() == 0) {
            for (const std::string &dir : TempDirs()) {
                std::filesystem::remove_all(dir);
            }
        }
    }
};
inline const auto *const kTempDirEnvironment = ::testing::AddGlobalTestEnvironment(new TempDirEnvironment);

/// A fresh directory under the system's temp dir, the same path on every rank (rank 0's pid names it).
inline std::string SharedTempDir(const std::string &name) {
    Tensor pid = Tensor::FromVector({World().rank() == 0 ? static_cast<double>(::getpid()) : 0.0}, {1}, DType::kFloat64)
                     .To(World().device());
    World().AllReduce(pid, comm::ReduceOp::kSum)->Wait(true);
    const auto dir = std::filesystem::temp_directory_path() /
                     fmt::format("shardline_ckpt_{}_{}", static_cast<long>(pid.ToDoubleVector()[0]), name);
    if (World().rank() == 0) {
        std::filesystem::remove_all(dir);
        std::filesystem::create_directories(dir);
    }
    World().Barrier()->Wait(true);
    TempDirs().push_back(dir.string());
    return dir.string();
}

/// The first `n` ranks of the world as a communicator (nullptr on the others, which take part in the split only).
inline std::unique_ptr<comm::Communicator> FirstRanks(int n) {
    const bool member = World().rank() < n;
    std::unique_ptr<comm::Communicator> sub =
        World().Split(member ? 0 : 1, World().rank(), fmt::format("first {} ranks", n));
    return member ? std::move(sub) : nullptr;
}

/// A mesh over a sub-world.
struct SubMesh {
    std::unique_ptr<comm::Communicator> comm;
    std::unique_ptr<DeviceMesh> mesh; ///< nullptr on ranks outside
};

/// dp×tp over the first dp·tp ranks.
inline SubMesh MakeDpTp(std::int64_t dp, std::int64_t tp) {
    SubMesh m;
    m.comm = FirstRanks(static_cast<int>(dp * tp));
    if (m.comm) {
        m.mesh = std::make_unique<DeviceMesh>(*m.comm, std::vector<std::int64_t>{dp, tp},
                                              std::vector<std::string>{"dp", "tp"});
    }
    return m;
}

/// One tensor of the test model: its full value and how it is split on a dp×tp mesh.
struct Spec {
    std::string name;
    Shape shape;
    DType dtype;
    std::vector<dist::ShardOn> shards;
};

/// Uneven shards (10 rows over 4: 3,3,3,1; 9 columns over 4: 3,3,3,0 — an empty shard), dp and tp on different dims,
/// co-sharding over (dp, tp), a replicated vector, float64, int64 and bfloat16.
inline std::vector<Spec> ModelSpecs() {
    return {
        {"col.weight", {10, 6}, DType::kFloat32, {{.dim = 0, .over = {"tp"}}}},
        {"row.weight", {6, 9}, DType::kFloat32, {{.dim = 1, .over = {"tp"}}}},
        {"row.bias", {7}, DType::kFloat32, {}},
        {"both", {8, 5}, DType::kFloat64, {{.dim = 0, .over = {"dp"}}, {.dim = 1, .over = {"tp"}}}},
        {"coshard", {12, 3}, DType::kFloat32, {{.dim = 0, .over = {"dp", "tp"}}}},
        {"counts", {5}, DType::kInt64, {{.dim = 0, .over = {"tp"}}}},
        {"half", {6, 4}, DType::kBFloat16, {{.dim = 0, .over = {"tp"}}}},
    };
}

/// The full value of a spec: random normals (integers for int64) from (seed, name).
inline Tensor FullOf(const Spec &s, std::uint64_t seed) {
    Tensor t = Tensor::Empty(s.shape, s.dtype, TestDevice());
    if (s.dtype == DType::kInt64) {
        FillRandom(
            t, RandomSpec{
                   .seed = seed, .name = s.name, .distribution = RandomDistribution::kInteger, .a = -1000, .b = 1000});
    } else {
        FillRandom(
            t,
            RandomSpec{.seed = seed, .name = s.name, .distribution = RandomDistribution::kNormal, .a = 0.0, .b = 1.0});
    }
    return t;
}

/// The model's tensors on `mesh` holding the full values of `seed` (shards cut from them).
inline ckpt::TensorList MakeTensors(DeviceMesh &mesh, std::uint64_t seed) {
    ckpt::TensorList list;
    for (const Spec &s : ModelSpecs()) {
        list.emplace_back(s.name, DistTensor::Sharded(FullOf(s, seed), mesh, s.shards));
    }
    return list;
}

/// The values of the box [offset, offset + shape) of a row-major `full` of shape `full_shape`.
inline std::vector<double> Slice(const std::vector<double> &full, const Shape &full_shape,
                                 const std::vector<std::int64_t> &offset, const std::vector<std::int64_t> &shape) {
    std::vector<double> out;
    std::int64_t n = 1;
    for (std::int64_t d : shape) {
        n *= d;
    }
    std::vector<std::int64_t> index(shape.size(), 0);
    for (std::int64_t k = 0; k < n; ++k) {
        std::int64_t linear = 0;
        for (std::size_t d = 0; d < shape.size(); ++d) {
            linear = linear * full_shape[d] + offset[d] + index[d];
        }
        out.push_back(full[static_cast<std::size_t>(linear)]);
        for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
            if (++index[static_cast<std::size_t>(d)] < shape[static_cast<std::size_t>(d)]) {
                break;
            }
            index[static_cast<std::size_t>(d)] = 0;
        }
    }
    return out;
}

/// Every rank's shard against its box of the full values of `seed`, and (float dtypes) the gathered full tensor,
/// bitwise.
inline void ExpectHolds(const ckpt::TensorList &list, std::uint64_t seed, const std::string &what) {
    const std::vector<Spec> specs = ModelSpecs();
    ASSERT_EQ(list.size(), specs.size());
    for (std::size_t i = 0; i < specs.size(); ++i) {
        const DistTensor &t = list[i].second;
        const std::vector<double> want = FullOf(specs[i], seed).ToDoubleVector();
        const spmd::ProcessMesh pm(t.mesh().shape(), t.mesh().dim_names());
        const spmd::LocalShard box =
            spmd::ComputeLocalShard(pm, std::vector<std::int64_t>(specs[i].shape.begin(), specs[i].shape.end()),
                                    t.layout(), t.mesh().coordinate());
        EXPECT_EQ(t.local().ToDoubleVector(), Slice(want, specs[i].shape, box.offset, box.shape))
            << what << ": this rank's shard of " << specs[i].name;
        if (specs[i].dtype == DType::kFloat32 || specs[i].dtype == DType::kFloat64) { // what both backends move
            EXPECT_EQ(t.FullTensor().ToDoubleVector(), want) << what << ": gathered " << specs[i].name;
        }
    }
}

} // namespace shardline::ckpt_test
