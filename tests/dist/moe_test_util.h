#pragma once

// Shared by the expert-parallel tests (autograd_moe_dispatch_test.cc, nn_moe_test.cc): (dp, ep, tp) meshes built once
// per process, and the all-to-all counts of a phase.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "nn_test_util.h"

namespace shardline::moe_test {

using namespace nn_test;

using MoeMeshes = std::map<std::pair<std::int64_t, std::int64_t>, std::unique_ptr<DeviceMesh>>;
inline MoeMeshes &TheMoeMeshes() {
    static MoeMeshes meshes;
    return meshes;
}
class MoeMeshEnvironment : public ::testing::Environment {
public:
    void TearDown() override { TheMoeMeshes().clear(); }
};
inline const auto *const kMoeMeshEnvironment = ::testing::AddGlobalTestEnvironment(new MoeMeshEnvironment);

/// A (dp, ep, tp) mesh of the world (tp fastest), built once per shape; every rank asks for the same shapes in the
/// same order (the tests run in one order everywhere).
inline DeviceMesh &MoeMesh(std::int64_t ep, std::int64_t tp) {
    auto &m = TheMoeMeshes()[{ep, tp}];
    if (!m) {
        const std::int64_t dp = World().size() / (ep * tp);
        m = std::make_unique<DeviceMesh>(World(), std::vector<std::int64_t>{dp, ep, tp},
                                         std::vector<std::string>{"dp", "ep", "tp"});
    }
    return *m;
}

/// Every (ep, tp) that divides the world: the expert-parallel matrix of a job (ep = the whole world included).
inline std::vector<std::pair<std::int64_t, std::int64_t>> MeshShapes() {
    std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
    const std::int64_t w = World().size();
    for (std::int64_t ep : {1, 2, 4}) {
        for (std::int64_t tp : {1, 2}) {
            if (w % (ep * tp) == 0) {
                shapes.emplace_back(ep, tp);
            }
        }
    }
    return shapes;
}

/// The all-to-all calls (even and uneven: the counts and the rows) on each mesh dim's group, and nothing else anywhere
/// but the all-reduces `tp_all_reduce` and the all-gathers `tp_all_gather` (etp 1 below tp) on tp.
inline void ExpectAllToAll(DeviceMesh &mesh, std::int64_t ep_calls, std::int64_t tp_all_reduce,
                           const std::string &phase, std::int64_t tp_all_gather = 0) {
    for (int d = 0; d < mesh.ndim(); ++d) {
        const std::string &name = mesh.dim_names()[static_cast<std::size_t>(d)];
        const comm::CollectiveCounts got = mesh.group(d).Counts();
        const std::int64_t want_a2a = name == "ep" ? ep_calls : 0;
        const std::int64_t want_ar = name == "tp" ? tp_all_reduce : 0;
        const std::int64_t want_ag = name == "tp" ? tp_all_gather : 0;
        EXPECT_EQ(got.Calls(CollectiveKind::kAllToAll), want_a2a) << phase << ": all_to_all on " << name;
        EXPECT_EQ(got.Calls(CollectiveKind::kAllReduce), want_ar) << phase << ": all_reduce on " << name;
        EXPECT_EQ(got.Calls(CollectiveKind::kAllGather), want_ag) << phase << ": all_gather on " << name;
        EXPECT_EQ(got.TotalCalls(), want_a2a + want_ar + want_ag) << phase << ": other collectives on " << name;
    }
    EXPECT_EQ(mesh.world().Counts().TotalCalls(), 0) << phase << ": on the world";
}

/// Runs `make` (which must throw a shardline::Error) with the mesh's counters reset, expects no collective on any
/// group, and returns the error's message ("threw nothing" when it did not throw).
template <class Make> std::string RefusedBeforeAnyCollective(DeviceMesh &mesh, Make make) {
    ResetCounts(mesh);
    std::string message = "threw nothing";
    try {
        make();
    } catch (const Error &e) {
        message = e.what();
    }
    ExpectAllToAll(mesh, 0, 0, "a refused configuration");
    return message;
}

} // namespace shardline::moe_test
