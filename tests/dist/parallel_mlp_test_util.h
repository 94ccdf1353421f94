#pragma once

// The column → GELU → row MLP problem shared by the autograd ParallelMLP tests (autograd_parallel_mlp_test.cc) and
// the fused-residual ones (autograd_parallel_mlp_residual_test.cc): the full tensors, their leaves on a mesh, one
// gathered step, bit-for-bit comparison and the float64 check against central finite differences. Header-only; each
// test file includes it once.

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/autograd/engine.h>
#include <shardline/autograd/functions.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/dist/dist_tensor.h>
#include <shardline/functional/parallel_linear.h>

#include "dist_tensor_test_util.h"
#include "reference.h"

namespace shardline::parallel_mlp_test {

using namespace dist_test; // Variable, DeviceMesh, DistTensor, TestDevice
using functional::ColumnParallelLinearOptions;
using functional::RowParallelLinearOptions;
using functional::TensorParallelGroup;
using testing::Values;

inline constexpr std::int64_t kSeq = 4;    ///< divides by 1, 2 and 4 (sequence parallelism)
inline constexpr std::int64_t kBatch = 2;  ///< divides by dp = 2
inline constexpr std::int64_t kHidden = 8; ///< fc1 in, fc2 out
inline constexpr std::int64_t kFfn = 8;    ///< fc1 out, fc2 in: divides by 1, 2 and 4

/// Which of the five inputs (x, W1, b1, W2, b2) require a gradient.
using Needs = std::array<bool, 5>;
inline constexpr Needs kAll = {true, true, true, true, true};
inline const char *const kNames[] = {"dx", "dW1", "db1", "dW2", "db2"};

/// A random full tensor of float32-representable normal values in `dtype`, the same on every rank.
inline Tensor Full(const Shape &shape, std::string_view name, DType dtype, std::uint64_t seed = 41) {
    return testing::RandomTensor(shape, DType::kFloat32, TestDevice(), seed, name).To(dtype);
}

/// The full tensors of one MLP problem.
struct Problem {
    Tensor x, w1, b1, w2, b2, dy;
};
/// Values from `seed` (the weights, biases and x) and `seed + 1` (dy).
inline Problem MakeProblem(DType dtype, std::int64_t batch = kBatch, std::uint64_t seed = 41) {
    return {.x = Full({kSeq, batch, kHidden}, "x", dtype, seed),
            .w1 = Full({kFfn, kHidden}, "w1", dtype, seed),
            .b1 = Full({kFfn}, "b1", dtype, seed),
            .w2 = Full({kHidden, kFfn}, "w2", dtype, seed),
            .b2 = Full({kHidden}, "b2", dtype, seed),
            .dy = Full({kSeq, batch, kHidden}, "dy", dtype, seed + 1)};
}

/// The MLP's leaves on `mesh` from a problem's full tensors (W1, b1 split on dim 0 over tp, W2 on dim 1, b2
/// replicated; x split on the sequence over tp with sequence parallelism, and on the batch over dp when there is one).
struct Leaves {
    Variable x, w1, b1, w2, b2;
    std::vector<Variable *> all() { return {&x, &w1, &b1, &w2, &b2}; }
};
inline Leaves MakeLeaves(const Problem &p, DeviceMesh &mesh, bool sp, const Needs &needs = kAll) {
    std::vector<dist::ShardOn> x_shards;
    if (sp) {
        x_shards.push_back({.dim = 0, .over = {"tp"}});
    }
    if (mesh.ndim() == 2) {
        x_shards.push_back({.dim = 1, .over = {"dp"}});
    }
    return {.x = Variable(DistTensor::Sharded(p.x, mesh, x_shards), needs[0]),
            .w1 = Variable(DistTensor::Sharded(p.w1, mesh, {{.dim = 0, .over = {"tp"}}}), needs[1]),
            .b1 = Variable(DistTensor::Sharded(p.b1, mesh, {{.dim = 0, .over = {"tp"}}}), needs[2]),
            .w2 = Variable(DistTensor::Sharded(p.w2, mesh, {{.dim = 1, .over = {"tp"}}}), needs[3]),
            .b2 = Variable(DistTensor::Replicated(p.b2, mesh), needs[4])};
}

inline ColumnParallelLinearOptions Fc1(bool sp) {
    return {.in_features = kHidden, .out_features = kFfn, .sequence_parallel = sp};
}
inline RowParallelLinearOptions Fc2(bool sp) {
    return {.in_features = kFfn, .out_features = kHidden, .input_is_parallel = true, .sequence_parallel = sp};
}

/// y and every gradient, gathered to full tensors (undefined where there is none).
struct Result {
    Tensor y;
    std::vector<Tensor> grads;
};
inline Result Step(const std::function<Variable(Leaves &)> &mlp, Leaves &l, const Tensor &dy_full) {
    Variable y = mlp(l);
    const DistTensor dy = DistTensor::FromFull(dy_full, y.value().layout(), y.value().mesh());
    y.Backward(&dy);
    Result r{.y = y.value().FullTensor(), .grads = {}};
    for (Variable *v : l.all()) {
        r.grads.push_back(v->grad().defined() ? v->grad().FullTensor() : Tensor());
    }
    return r;
}

inline void ExpectSameBits(const Result &got, const Result &want) {
    EXPECT_EQ(got.y.ToDoubleVector(), want.y.ToDoubleVector()) << "y";
    for (std::size_t i = 0; i < want.grads.size(); ++i) {
        ASSERT_EQ(got.grads[i].defined(), want.grads[i].defined()) << kNames[i];
        if (want.grads[i].defined()) {
            EXPECT_EQ(got.grads[i].ToDoubleVector(), want.grads[i].ToDoubleVector()) << kNames[i];
        }
    }
}

inline void ResetCounts(DeviceMesh &mesh) {
    for (int d = 0; d < mesh.ndim(); ++d) {
        mesh.group(d).ResetCounts();
    }
}

/// One way to build the MLP on the leaves: fused, unfused, with or without the residual.
using MlpForm = std::function<Variable(Leaves &, const TensorParallelGroup &, bool sp)>;

/// `form` agrees with `reference` bit for bit — y and every gradient — on a tp mesh of the whole world and on a dp×tp
/// mesh (dp 2 when the world allows), in float32 and float64, with and without sequence parallelism, and issues the
/// same tp collectives (`why` says why they must be the same). Problems from `seed` (MakeProblem).
inline void ExpectSameBitsAndCollectivesOnEveryMesh(const MlpForm &form, const MlpForm &reference, std::uint64_t seed,
                                                    std::string_view why) {
    const int w = World().size();
    const std::int64_t dp = w >= 2 ? 2 : 1;
    DeviceMesh tp_mesh(World(), {w}, {"tp"});
    DeviceMesh dp_tp_mesh(World(), {dp, w / dp}, {"dp", "tp"});
    for (DeviceMesh *mesh : {&tp_mesh, &dp_tp_mesh}) {
        const TensorParallelGroup tp = TensorParallelGroup::Named(*mesh, "tp");
        for (const DType dtype : {DType::kFloat32, DType::kFloat64}) {
            for (const bool sp : {false, true}) {
                SCOPED_TRACE(::testing::Message() << "mesh of " << mesh->ndim() << " dims, " << DTypeName(dtype)
                                                  << (sp ? ", sequence parallel" : ""));
                const Problem p = MakeProblem(dtype, kBatch, seed);
                Leaves got_leaves = MakeLeaves(p, *mesh, sp);
                Leaves want_leaves = MakeLeaves(p, *mesh, sp);
                ResetCounts(*mesh);
                const Result want = Step([&](Leaves &v) { return reference(v, tp, sp); }, want_leaves, p.dy);
                const comm::CollectiveCounts want_calls = mesh->group("tp").Counts();
                ResetCounts(*mesh);
                const Result got = Step([&](Leaves &v) { return form(v, tp, sp); }, got_leaves, p.dy);
                ExpectSameBits(got, want);
                for (const CollectiveKind kind :
                     {CollectiveKind::kAllReduce, CollectiveKind::kAllGather, CollectiveKind::kReduceScatter}) {
                    EXPECT_EQ(mesh->group("tp").Counts().Calls(kind), want_calls.Calls(kind)) << why;
                }
            }
        }
    }
}

/// L = Σ y ⊙ dy with y = mlp(leaves of p), distributed, float64: `got` (Step's gradients of the same mlp) against
/// central differences of L in every element of every input (each evaluation runs the forward with its collectives on
/// every rank alike). A zero numeric gradient fails: it could not test anything.
inline void ExpectGradsMatchCentralDifferences(const Result &got, const Problem &p, DeviceMesh &mesh, bool sp,
                                               const std::function<Variable(Leaves &)> &mlp) {
    const Values r = p.dy.ToDoubleVector();
    constexpr double kStep = 1e-5;
    const std::vector<Tensor> inputs = {p.x, p.w1, p.b1, p.w2, p.b2};
    auto loss = [&](const std::vector<Tensor> &full) {
        autograd::NoGradGuard no_grad;
        Leaves v = MakeLeaves({full[0], full[1], full[2], full[3], full[4], p.dy}, mesh, sp);
        const Values y = mlp(v).value().FullTensor().ToDoubleVector();
        double s = 0.0;
        for (std::size_t k = 0; k < y.size(); ++k) {
            s += y[k] * r[k];
        }
        return s;
    };
    for (std::size_t i = 0; i < inputs.size(); ++i) {
        std::vector<Tensor> full;
        for (const Tensor &t : inputs) {
            full.push_back(t.Clone());
        }
        double *data = full[i].data_as<double>();
        Values numeric(static_cast<std::size_t>(full[i].numel()));
        for (std::int64_t j = 0; j < full[i].numel(); ++j) {
            const double saved = data[j];
            data[j] = saved + kStep;
            const double plus = loss(full);
            data[j] = saved - kStep;
            const double minus = loss(full);
            data[j] = saved;
            numeric[static_cast<std::size_t>(j)] = (plus - minus) / (2 * kStep);
        }
        ASSERT_TRUE(got.grads[i].defined()) << kNames[i];
        double magnitude = 0.0;
        for (const double v : numeric) {
            magnitude += v < 0 ? -v : v;
        }
        ASSERT_GT(magnitude, 0.0) << kNames[i] << ": a zero gradient cannot test anything";
        const std::string diff = testing::CompareValues(got.grads[i].ToDoubleVector(), numeric, 1e-6, 1e-6);
        EXPECT_TRUE(diff.empty()) << kNames[i] << " vs finite differences: " << diff;
    }
}

} // namespace shardline::parallel_mlp_test
