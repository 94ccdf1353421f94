// The einsum engine itself: the deterministic policy, broadcast, the Partial policies, reverse and grad.

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::S;
using testing::T;

const ProcessMesh k2x2({2, 2});

SpmdInfo Einsum(const std::string &eq, const std::vector<TensorSpec> &inputs, const ProcessMesh &mesh = k2x2) {
    return InferEinsumOpForward(mesh, eq, inputs);
}

// ab[0,-1], bc[-1,1], cd[-1,-1] -> ad: b, c contracted: ad[0,-1]; bc required [-1,1]; c sharded -> partial{1}
TEST(EinsumTest, ChainContractionGivesPartialForEachShardedContractedLabel) {
    const SpmdInfo info = Einsum("ab,bc,cd->ad", {T({4, 4}, "[0,-1]"), T({4, 4}, "[-1,1]"), T({4, 4}, "[-1,-1]")});
    EXPECT_EQ(S(info.inputs[2]), "[1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1] partial{1}");
}

// ab[0,1] -> ba: transpose as einsum
TEST(EinsumTest, PermutationMovesShardings) {
    EXPECT_EQ(S(Einsum("ab->ba", {T({4, 6}, "[0,1]")}).outputs[0]), "[1,0]");
}

// ab[0,1] -> a: b contracted: a[0] partial{1}
TEST(EinsumTest, ReductionLabel) { EXPECT_EQ(S(Einsum("ab->a", {T({4, 6}, "[0,1]")}).outputs[0]), "[0] partial{1}"); }

// a[0], b[1] -> ab[0,1]: outer product
TEST(EinsumTest, OuterProduct) { EXPECT_EQ(S(Einsum("a,b->ab", {T({4}, "[0]"), T({6}, "[1]")}).outputs[0]), "[0,1]"); }

// a[0], b[0] -> ab: mesh dim 0 claimed by a first; b replicated
TEST(EinsumTest, MeshDimClaimedByEarlierLabel) {
    const SpmdInfo info = Einsum("a,b->ab", {T({4}, "[0]"), T({6}, "[0]")});
    EXPECT_EQ(S(info.inputs[1]), "[-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1]");
}

// ab[[0,1],-1], ab[1,0]: the first operand's list wins label a; b loses mesh dim 0 and 1 (claimed)
TEST(EinsumTest, FirstOperandCoShardWins) {
    const SpmdInfo info = Einsum("ab,ab->ab", {T({4, 4}, "[[0,1],-1]"), T({4, 4}, "[1,0]")});
    EXPECT_EQ(S(info.inputs[1]), "[[0,1],-1]");
    EXPECT_EQ(S(info.outputs[0]), "[[0,1],-1]");
}

// ab[-1,[0,1]] partial-free, ab[0,-1]: label b takes [0,1] from x, a gets nothing
TEST(EinsumTest, CoShardClaimsBothMeshDims) {
    const SpmdInfo info = Einsum("ab,ab->ab", {T({4, 4}, "[-1,[0,1]]"), T({4, 4}, "[0,-1]")});
    EXPECT_EQ(S(info.outputs[0]), "[-1,[0,1]]");
}

// ab[-1,[0,1]], ab[[1],-1]: label a from y loses mesh dim 1 (claimed) -> empty
TEST(EinsumTest, PartlyClaimedListKeepsTheRest) {
    const ProcessMesh mesh({2, 2, 2});
    const SpmdInfo info = Einsum("ab,ab->ab", {T({4, 4}, "[-1,[0,1]]"), T({4, 4}, "[[1,2],-1]")}, mesh);
    EXPECT_EQ(S(info.outputs[0]), "[2,[0,1]]");
}

// size-1 label: a [1] is never sharded even when asked
TEST(EinsumTest, SizeOneLabelIsNeverSharded) {
    EXPECT_EQ(S(Einsum("ab->ab", {T({1, 4}, "[0,1]")}).outputs[0]), "[-1,1]");
}

// inconsistent sizes name the label and both operands
TEST(EinsumTest, LabelSizeMismatchIsAnError) {
    try {
        Einsum("ab,bc->ac", {T({4, 3}, "[-1,-1]"), T({5, 2}, "[-1,-1]")});
        FAIL();
    } catch (const SpmdError &e) {
        EXPECT_NE(std::string(e.what()).find("dim 'b' has size 3 in in0 but 5 in in1"), std::string::npos) << e.what();
    }
}

TEST(EinsumTest, MalformedEquationsAreErrors) {
    EXPECT_THROW(Einsum("ab,bc", {T({4, 3}, "[-1,-1]"), T({3, 2}, "[-1,-1]")}), SpmdError);
    EXPECT_THROW(Einsum("ab->ab", {T({4, 3}, "[-1,-1]"), T({3, 2}, "[-1,-1]")}), SpmdError);
    EXPECT_THROW(Einsum("aa->a", {T({4, 4}, "[-1,-1]")}), SpmdError);
    EXPECT_THROW(Einsum("ab->abz", {T({4, 4}, "[-1,-1]")}), SpmdError);
    EXPECT_THROW(Einsum("ab->a", {T({4}, "[-1]")}), SpmdError);
}

// reverse: ac[0,-1] partial{1} from "ab,bc->ac": b (first contracted) gets mesh dim 1
TEST(EinsumTest, ReversePutsPartialOnFirstContractedLabel) {
    const SpmdInfo info = InferEinsumOpReverse(k2x2, "ab,bc->ac", {T({4, 4}, "[-1,-1]"), T({4, 4}, "[-1,-1]")},
                                               T({4, 4}, "[0,-1] partial{1}"));
    EXPECT_EQ(S(info.inputs[0]), "[0,1]");
    EXPECT_EQ(S(info.inputs[1]), "[1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[0,-1] partial{1}");
}

// reverse of a partial with no contracted label: the first linear operand carries it
TEST(EinsumTest, ReversePartialWithoutContractionGoesToFirstOperand) {
    const SpmdInfo info = InferEinsumOpReverse(k2x2, "ab,ab->ab", {T({4, 4}, "[-1,-1]"), T({4, 4}, "[-1,-1]")},
                                               T({4, 4}, "[-1,-1] partial{0}"));
    EXPECT_EQ(S(info.inputs[0]), "[-1,-1] partial{0}");
    EXPECT_EQ(S(info.inputs[1]), "[-1,-1]");
    EXPECT_EQ(S(info.outputs[0]), "[-1,-1] partial{0}");
}

// grad of "ab,bc->ac" with b on mesh dim 1: d(in0) = dy . in1^T has b -> no partial; d(in1) has no a -> partial{0}
TEST(EinsumTest, GradPartialsComeFromLabelsReducedAway) {
    const SpmdInfo info =
        InferEinsumOpGrad(k2x2, "ab,bc->ac", {T({4, 4}, "[0,1]"), T({4, 4}, "[1,-1]")}, T({4, 4}, "[0,-1]"));
    EXPECT_EQ(S(info.Output("in0_grad")), "[0,1]");
    EXPECT_EQ(S(info.Output("in1_grad")), "[1,-1] partial{0}");
}

// the engine directly: an additive term's gradient ignores the other operands' labels
TEST(EinsumTest, AdditiveTermGradIgnoresOtherOperands) {
    EinsumProblem problem;
    problem.op = "test";
    problem.inputs = {{.name = "x", .labels = "mk", .shape = {4, 4}, .layout = testing::L("[-1,0]")},
                      {.name = "w", .labels = "kn", .shape = {4, 4}, .layout = testing::L("[0,-1]"), .priority = 1},
                      {.name = "b",
                       .labels = "n",
                       .shape = {4},
                       .layout = testing::L("[-1]"),
                       .priority = 2,
                       .linear = false,
                       .additive_term = true}};
    problem.output = "mn";
    problem.partial_policy = PartialPolicy::kMultilinear;
    const EinsumGradResult grad = InferEinsumGrad(k2x2, problem, T({4, 4}, "[-1,-1]"));
    EXPECT_EQ(S(grad.input_grads[2]), "[-1]");
    EXPECT_EQ(S(grad.input_grads[0]), "[-1,0]");
    EXPECT_EQ(grad.assignment.labels.at('k'), std::vector<int>{0});
}

// kAdditive: P(sum) + R -> the R operand is partialized, output P(sum)
TEST(EinsumTest, AdditivePolicyPartializesTheOtherOperand) {
    EinsumProblem problem;
    problem.op = "add";
    problem.inputs = {{.name = "x", .labels = "a", .shape = {4}, .layout = testing::L("[-1] partial{0}")},
                      {.name = "y", .labels = "a", .shape = {4}, .layout = testing::L("[-1]"), .priority = 1}};
    problem.output = "a";
    problem.partial_policy = PartialPolicy::kAdditive;
    const EinsumResult r = InferEinsumForward(k2x2, problem);
    EXPECT_EQ(S(r.inputs[1]), "[-1] partial{0}");
    EXPECT_EQ(S(r.output), "[-1] partial{0}");
}

// kResolve: every Partial is reduced
TEST(EinsumTest, ResolvePolicyReducesPartials) {
    EinsumProblem problem;
    problem.op = "gelu";
    problem.inputs = {{.name = "x", .labels = "a", .shape = {4}, .layout = testing::L("[0] partial{1}")}};
    problem.output = "a";
    const EinsumResult r = InferEinsumForward(k2x2, problem);
    EXPECT_EQ(S(r.inputs[0]), "[0]");
    EXPECT_EQ(S(r.output), "[0]");
}

// unshardable labels stay replicated
TEST(EinsumTest, UnshardableLabelStaysReplicated) {
    EinsumProblem problem;
    problem.op = "softmax";
    problem.inputs = {{.name = "x", .labels = "ab", .shape = {4, 4}, .layout = testing::L("[0,1]")}};
    problem.output = "ab";
    problem.unshardable = "b";
    EXPECT_EQ(S(InferEinsumForward(k2x2, problem).output), "[0,-1]");
}

// priority: a lower priority value wins even when it comes later
TEST(EinsumTest, PriorityDecidesConflicts) {
    EinsumProblem problem;
    problem.op = "test";
    problem.inputs = {{.name = "x", .labels = "a", .shape = {4}, .layout = testing::L("[0]"), .priority = 5},
                      {.name = "y", .labels = "b", .shape = {4}, .layout = testing::L("[0]"), .priority = 1}};
    problem.output = "ab";
    problem.partial_policy = PartialPolicy::kMultilinear;
    const EinsumResult r = InferEinsumForward(k2x2, problem);
    EXPECT_EQ(S(r.inputs[0]), "[-1]");
    EXPECT_EQ(S(r.output), "[-1,0]");
}

} // namespace
} // namespace shardline::spmd
