// functional::ColumnParallelLinear{Forward,Backward} (docs/functional.md) on caller-owned memory: every rank builds the
// same full X, W, b and dY from one seed, takes its shard, calls the functional API on raw pointers, gathers the
// outputs and gradients and compares them with a single-rank dense float64 reference (bitwise for integer-valued
// operands, rtol 1e-5 for random fp32), and asserts each call's collectives against DESIGN.md §6 rows 1-3.
// BACKEND cpu (MPI, np 1/2/4) and BACKEND cuda (NCCL, np 2/4; SHARDLINE_FUNCTIONAL_TEST_CUDA) build this file, with
// the shared problem, meshes and RunColumn / RunRow of functional_test_util.h.

#include <gtest/gtest.h>

#include "functional_test_util.h"

namespace shardline {
namespace {

using namespace functional_test;

// ---- column parallel: DESIGN.md §6 rows 1-3
// ----------------------------------------------------------------------------

// x R, W S(0), b S(0) -> y S(-1); backward dx P(sum) -> R: one all-reduce.
TEST(ColumnParallelLinearTest, ReplicatedInputMatchesDenseWithNoForwardCollectiveAndOneDxAllReduce) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        for (bool bias : {true, false}) {
            RunColumn({.problem = p, .bias = bias});
        }
    }
}

// needs_input_grad = false: no dx, so no all-reduce at all (Megatron's backward all-reduce is dx's).
TEST(ColumnParallelLinearTest, BackwardSkipsInputAllReduceWhenDxIsNotRequested) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    RunColumn({.problem = Fp32Problems()[0], .wants = {.dx = false}});
    RunColumn({.problem = Fp32Problems()[0], .wants = {.dx = false, .dbias = false}});
    RunColumn({.problem = Fp32Problems()[0], .wants = {.dx = true, .dweight = false, .dbias = false}});
    RunColumn({.problem = Fp32Problems()[0], .wants = {.dx = false, .dweight = false, .dbias = false}});
}

// x S(0) -> R: all-gather (kept in x_total); backward dx P(sum) -> S(0): reduce-scatter.
TEST(ColumnParallelLinearTest, SequenceParallelAllGathersInputAndReduceScattersDx) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        for (bool bias : {true, false}) {
            RunColumn({.problem = p, .bias = bias, .sequence_parallel = true});
        }
    }
    RunColumn({.problem = Fp32Problems()[0], .sequence_parallel = true, .wants = {.dx = false}});
}

// Without x_total the rule's grad input plan gathers x again for dweight: one more all-gather, and none without
// dweight.
TEST(ColumnParallelLinearTest, SequenceParallelGathersInputAgainWhenTheForwardDidNotKeepIt) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    RunColumn({.problem = Fp32Problems()[1], .sequence_parallel = true, .keep_x_total = false});
    RunColumn({.problem = Fp32Problems()[0], .sequence_parallel = true, .keep_x_total = false, .wants = {.dx = false}});
    RunColumn({.problem = Fp32Problems()[0],
               .sequence_parallel = true,
               .keep_x_total = false,
               .wants = {.dx = true, .dweight = false}});
}

// y S(-1) -> R: + all-gather; backward dY R -> S(-1): a local slice, no collective.
TEST(ColumnParallelLinearTest, GatherOutputAllGathersYAndSlicesDyLocally) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    for (const Problem &p : Fp32Problems()) {
        RunColumn({.problem = p, .gather_output = true});
    }
    RunColumn({.problem = Fp32Problems()[0], .gather_output = true, .wants = {.dx = false}});
}

TEST(ColumnParallelLinearTest, AccumulatesParameterGradsIntoMainGrads) {
    SHARDLINE_FUNCTIONAL_TEST_BACKEND();
    RunColumn({.problem = Fp32Problems()[0], .wants = {.mode = GradMode::kAccumulate}});
    RunColumn({.problem = Fp32Problems()[1], .sequence_parallel = true, .wants = {.mode = GradMode::kAccumulate}});
    RunColumn({.problem = Fp32Problems()[0], .wants = {.dweight = false, .mode = GradMode::kAccumulate}});
}

} // namespace
} // namespace shardline
