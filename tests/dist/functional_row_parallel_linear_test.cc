// functional::RowParallelLinear{Forward,Backward} (docs/functional.md) on caller-owned memory, against a single-rank
// dense float64 reference, with each call's collectives asserted against DESIGN.md §6 rows 4-5.
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 2/4; SHARDLINE_FUNCTIONAL_TEST_CUDA) build this file, with
// the shared problem, meshes and RunColumn / RunRow of functional_test_util.h.

#include <gtest/gtest.h>

#include "functional_test_util.h"

namespace shardline {
namespace {

using namespace functional_test;

// ---- row parallel: DESIGN.md §6 rows 4-5
// -------------------------------------------------------------------------------

// x S(-1), W S(1) -> y P(sum) -> R: one all-reduce, then + bias once; backward: nothing.
TEST(RowParallelLinearTest, InputIsParallelAllReducesYThenAddsBiasOnce) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        for (bool bias : {true, false}) {
            RunRow({.problem = p, .bias = bias});
        }
    }
    RunRow({.problem = Fp32Problems()[0], .wants = {.dx = false}});
}

// y P(sum) -> S(0): reduce-scatter, then + bias; backward dY S(0) -> R: all-gather. dbias comes out Replicate (the rule
// sums the gathered dY), so it needs no collective of its own.
TEST(RowParallelLinearTest, SequenceParallelReduceScattersYAndAllGathersDy) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        for (bool bias : {true, false}) {
            RunRow({.problem = p, .bias = bias, .sequence_parallel = true});
        }
    }
    RunRow({.problem = Fp32Problems()[0], .sequence_parallel = true, .wants = {.dx = false, .dweight = false}});
}

// x R -> S(-1): a local slice; backward dx S(-1) -> R: all-gather, only when dx is requested.
TEST(RowParallelLinearTest, ReplicatedInputIsSlicedLocallyAndItsDxAllGathered) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        RunRow({.problem = p, .input_is_parallel = false});
    }
    RunRow({.problem = Fp32Problems()[0], .input_is_parallel = false, .wants = {.dx = false}});
}

TEST(RowParallelLinearTest, AccumulatesParameterGradsIntoMainGrads) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    RunRow({.problem = Fp32Problems()[0], .wants = {.mode = GradMode::kAccumulate}});
    RunRow({.problem = Fp32Problems()[1], .sequence_parallel = true, .wants = {.mode = GradMode::kAccumulate}});
}

} // namespace
} // namespace shardline
