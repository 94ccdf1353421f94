// Property tests: random meshes (1-3 dims of size 1-3), random uneven shapes and random layouts (co-sharding,
// Partials), every rank simulated in one process on integer-valued float64 data. Seeded: a failure prints the
// case index and reproduces exactly.

#include <algorithm>
#include <random>

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::Dense;
using testing::DenseEinsum;
using testing::Distribute;
using testing::RandomShape;
using testing::Shards;
using testing::ShardsMatch;

constexpr int kCases = 300;

ReduceOp RandomOp(std::mt19937 &rng) {
    const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProd};
    return ops[std::uniform_int_distribution<int>(0, 4)(rng)];
}

Shards LocalEinsum(const ProcessMesh &mesh, const std::vector<std::string> &labels, const std::vector<Shards> &inputs,
                   const std::string &out_labels, ReduceOp combine = ReduceOp::kSum) {
    Shards out(mesh.Size());
    for (int64_t r = 0; r < mesh.Size(); ++r) {
        std::vector<Dense> operands;
        for (const Shards &s : inputs) {
            operands.push_back(s[r]);
        }
        out[r] = DenseEinsum(labels, operands, out_labels, combine);
    }
    return out;
}

/// Labels of a gradient: the input's labels, with broadcast (size-1) dims renamed so the einsum sums them away.
std::string GradLabels(const std::string &labels, const std::vector<int64_t> &shape,
                       const std::map<char, int64_t> &sizes) {
    std::string out = labels;
    for (size_t j = 0; j < labels.size(); ++j) {
        if (shape[j] == 1 && sizes.at(labels[j]) > 1) {
            out[j] = static_cast<char>('A' + j);
        }
    }
    return out;
}

std::map<char, int64_t> Sizes(const std::vector<std::string> &labels, const std::vector<std::vector<int64_t>> &shapes) {
    std::map<char, int64_t> sizes;
    for (size_t i = 0; i < labels.size(); ++i) {
        for (size_t j = 0; j < labels[i].size(); ++j) {
            sizes[labels[i][j]] = std::max(sizes[labels[i][j]], shapes[i][j]);
        }
    }
    return sizes;
}

/// Executes `plan` on every simulated rank from `src` and checks each rank ends with exactly its `dst` shard.
void ExpectPlanReachesDestination(const ProcessMesh &mesh, const std::vector<int64_t> &shape, const Layout &src,
                                  const Layout &dst, const RedistributePlan &plan, std::mt19937 &rng) {
    const Dense global = testing::RandomDense(shape, rng);
    Shards shards = Distribute(mesh, global, src, rng);
    ASSERT_TRUE(ShardsMatch(mesh, shards, global, src));
    Layout state = src.Canonical(mesh);
    double cost = 0.0;
    for (size_t s = 0; s < plan.steps.size(); ++s) {
        const RedistributeStep &step = plan.steps[s];
        ASSERT_EQ(step.before, state) << "step " << s;
        state = step.after;
        cost += step.cost_us;
        testing::Execute(mesh, step, shards);
        // Never all_reduce and then slice the same mesh dim: that is a reduce_scatter.
        if (s > 0 && step.collective == Collective::kLocalSlice) {
            const RedistributeStep &prev = plan.steps[s - 1];
            EXPECT_FALSE(prev.collective == Collective::kAllReduce && prev.mesh_dim == step.mesh_dim);
        }
    }
    EXPECT_DOUBLE_EQ(plan.cost_us, cost);
    ASSERT_EQ(state, dst.Canonical(mesh));
    ASSERT_TRUE(ShardsMatch(mesh, shards, global, dst));
}

TEST(RedistributePropertyTest, ExecutingThePlanYieldsExactlyTheDestinationShards) {
    std::mt19937 rng(20240601);
    for (int c = 0; c < kCases * 2; ++c) {
        SCOPED_TRACE(::testing::Message() << "case " << c);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const int rank = std::uniform_int_distribution<int>(1, 3)(rng);
        const std::vector<int64_t> shape = RandomShape(rng, rank, 7);
        const ReduceOp src_op = RandomOp(rng);
        const Layout src = testing::RandomLayout(mesh, rank, rng, true, src_op);
        const Layout dst = testing::RandomLayout(mesh, rank, rng, true, c % 3 == 0 ? RandomOp(rng) : src_op);
        SCOPED_TRACE(::testing::Message() << mesh.ToString() << " shape " << ShapeToString(shape) << " "
                                          << src.ToString() << " -> " << dst.ToString());
        ExpectPlanReachesDestination(mesh, shape, src, dst, PlanRedistribute(mesh, shape, src, dst), rng);
    }
}

// Bandwidth-bound cost models (alpha 0 or tiny, per-dim bandwidths) make the searched plans win often: each is
// executed, costs no more than the ordered plan (options.search = false), and some must be strictly cheaper.
TEST(RedistributePropertyTest, SearchedPlansReachTheDestinationAndNeverCostMore) {
    std::mt19937 rng(20241121);
    int cheaper = 0;
    int with_all_to_all = 0;
    for (int c = 0; c < kCases * 2; ++c) {
        SCOPED_TRACE(::testing::Message() << "case " << c);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const int rank = std::uniform_int_distribution<int>(1, 3)(rng);
        const std::vector<int64_t> shape = RandomShape(rng, rank, 9);
        const ReduceOp src_op = RandomOp(rng);
        const Layout src = testing::RandomLayout(mesh, rank, rng, true, src_op);
        const Layout dst = testing::RandomLayout(mesh, rank, rng, true, c % 3 == 0 ? RandomOp(rng) : src_op);
        PlanOptions options;
        options.cost.call_us = 0.0;
        options.cost.alpha_us = c % 2 == 0 ? 0.0 : 1e-4;
        for (int d = 0; d < mesh.NDim(); ++d) {
            options.cost.bandwidth_gb_per_s_per_dim.push_back(rng() % 2 == 0 ? 1.0 : 4.0);
        }
        SCOPED_TRACE(::testing::Message() << mesh.ToString() << " shape " << ShapeToString(shape) << " "
                                          << src.ToString() << " -> " << dst.ToString());
        const RedistributePlan plan = PlanRedistribute(mesh, shape, src, dst, options);
        PlanOptions ordered_options = options;
        ordered_options.search = false;
        const RedistributePlan ordered = PlanRedistribute(mesh, shape, src, dst, ordered_options);
        EXPECT_LE(plan.cost_us, ordered.cost_us);
        if (plan.cost_us < ordered.cost_us) {
            ++cheaper;
            with_all_to_all += std::any_of(plan.steps.begin(), plan.steps.end(), [](const RedistributeStep &s) {
                return s.collective == Collective::kAllToAll;
            });
        }
        ExpectPlanReachesDestination(mesh, shape, src, dst, plan, rng);
    }
    EXPECT_GE(cheaper, 10);
    EXPECT_GE(with_all_to_all, 10);
}

struct MatmulCase {
    std::vector<int64_t> x_shape, y_shape;
    std::string x_labels, y_labels, out_labels;
    MatmulAttrs attrs;
};

MatmulCase RandomMatmul(std::mt19937 &rng) {
    MatmulCase c;
    c.attrs.trans_x = rng() % 2;
    c.attrs.trans_y = rng() % 2;
    const int xb = std::uniform_int_distribution<int>(0, 2)(rng);
    const int yb = std::uniform_int_distribution<int>(0, 2)(rng);
    const int ob = std::max(xb, yb);
    const std::vector<int64_t> batch = RandomShape(rng, ob, 4);
    const std::string labels = std::string("abcdefghij").substr(0, ob);
    const int64_t m = std::uniform_int_distribution<int64_t>(1, 6)(rng);
    const int64_t k = std::uniform_int_distribution<int64_t>(1, 6)(rng);
    const int64_t n = std::uniform_int_distribution<int64_t>(1, 6)(rng);
    for (int i = ob - xb; i < ob; ++i) {
        c.x_shape.push_back(rng() % 3 == 0 ? 1 : batch[i]);
        c.x_labels.push_back(labels[i]);
    }
    for (int i = ob - yb; i < ob; ++i) {
        c.y_shape.push_back(rng() % 3 == 0 ? 1 : batch[i]);
        c.y_labels.push_back(labels[i]);
    }
    if (c.attrs.trans_x) {
        c.x_shape.insert(c.x_shape.end(), {k, m});
        c.x_labels += "km";
    } else {
        c.x_shape.insert(c.x_shape.end(), {m, k});
        c.x_labels += "mk";
    }
    if (c.attrs.trans_y) {
        c.y_shape.insert(c.y_shape.end(), {n, k});
        c.y_labels += "nk";
    } else {
        c.y_shape.insert(c.y_shape.end(), {k, n});
        c.y_labels += "kn";
    }
    c.out_labels = labels + "mn";
    return c;
}

TEST(MatmulPropertyTest, ShardedForwardEqualsDenseMatmul) {
    std::mt19937 rng(7);
    for (int i = 0; i < kCases; ++i) {
        SCOPED_TRACE(::testing::Message() << "case " << i);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const MatmulCase c = RandomMatmul(rng);
        const TensorSpec x{c.x_shape, testing::RandomLayout(mesh, static_cast<int>(c.x_shape.size()), rng, true)};
        const TensorSpec y{c.y_shape, testing::RandomLayout(mesh, static_cast<int>(c.y_shape.size()), rng, true)};
        RuleOptions options;
        options.mode = i % 2 == 0 ? RuleMode::kDeterministic : RuleMode::kCostBased;
        const SpmdInfo info = InferMatmulForward(mesh, x, y, c.attrs, options);
        SCOPED_TRACE(::testing::Message()
                     << x.layout.ToString() << " " << y.layout.ToString() << " -> " << info.inputs[0].layout.ToString()
                     << " " << info.inputs[1].layout.ToString() << " -> " << info.outputs[0].layout.ToString());
        const Dense gx = testing::RandomDense(c.x_shape, rng);
        const Dense gy = testing::RandomDense(c.y_shape, rng);
        const Dense want = DenseEinsum({c.x_labels, c.y_labels}, {gx, gy}, c.out_labels);
        ASSERT_EQ(info.outputs[0].shape, want.shape);
        const Shards out = LocalEinsum(
            mesh, {c.x_labels, c.y_labels},
            {Distribute(mesh, gx, info.inputs[0].layout, rng), Distribute(mesh, gy, info.inputs[1].layout, rng)},
            c.out_labels);
        ASSERT_TRUE(ShardsMatch(mesh, out, want, info.outputs[0].layout));
    }
}

TEST(MatmulPropertyTest, ShardedGradsEqualDenseGrads) {
    std::mt19937 rng(11);
    for (int i = 0; i < kCases; ++i) {
        SCOPED_TRACE(::testing::Message() << "case " << i);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const MatmulCase c = RandomMatmul(rng);
        const auto sizes = Sizes({c.x_labels, c.y_labels}, {c.x_shape, c.y_shape});
        std::vector<int64_t> out_shape;
        for (char l : c.out_labels) {
            out_shape.push_back(sizes.at(l));
        }
        const TensorSpec x{c.x_shape, testing::RandomLayout(mesh, static_cast<int>(c.x_shape.size()), rng, true)};
        const TensorSpec y{c.y_shape, testing::RandomLayout(mesh, static_cast<int>(c.y_shape.size()), rng, true)};
        const TensorSpec dy{out_shape, testing::RandomLayout(mesh, static_cast<int>(out_shape.size()), rng, true)};
        RuleOptions options; // odd cases: the cost-based grad enumeration must be exact too
        options.mode = i % 2 == 0 ? RuleMode::kDeterministic : RuleMode::kCostBased;
        const SpmdInfo info = InferMatmulGrad(mesh, x, y, dy, c.attrs, options);
        SCOPED_TRACE(::testing::Message()
                     << "x " << x.layout.ToString() << " y " << y.layout.ToString() << " dy " << dy.layout.ToString()
                     << " -> dx " << info.outputs[0].layout.ToString() << " dy " << info.outputs[1].layout.ToString());
        const Dense gx = testing::RandomDense(c.x_shape, rng);
        const Dense gy = testing::RandomDense(c.y_shape, rng);
        const Dense gdy = testing::RandomDense(out_shape, rng);
        const std::string dx_labels = GradLabels(c.x_labels, c.x_shape, sizes);
        const std::string dyy_labels = GradLabels(c.y_labels, c.y_shape, sizes);
        const Shards lx = Distribute(mesh, gx, info.Input("x").layout, rng);
        const Shards ly = Distribute(mesh, gy, info.Input("y").layout, rng);
        const Shards ldy = Distribute(mesh, gdy, info.Input("out_grad").layout, rng);
        const Dense want_dx = DenseEinsum({c.out_labels, c.y_labels}, {gdy, gy}, dx_labels);
        const Dense want_dy = DenseEinsum({c.x_labels, c.out_labels}, {gx, gdy}, dyy_labels);
        ASSERT_TRUE(ShardsMatch(mesh, LocalEinsum(mesh, {c.out_labels, c.y_labels}, {ldy, ly}, dx_labels), want_dx,
                                info.Output("x_grad").layout));
        ASSERT_TRUE(ShardsMatch(mesh, LocalEinsum(mesh, {c.x_labels, c.out_labels}, {lx, ldy}, dyy_labels), want_dy,
                                info.Output("y_grad").layout));
    }
}

TEST(LinearPropertyTest, ShardedForwardAndGradsEqualDense) {
    std::mt19937 rng(13);
    for (int i = 0; i < kCases; ++i) {
        SCOPED_TRACE(::testing::Message() << "case " << i);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const int batch_rank = std::uniform_int_distribution<int>(1, 2)(rng);
        std::vector<int64_t> x_shape = RandomShape(rng, batch_rank + 1, 7);
        const std::vector<int64_t> w_shape = {std::uniform_int_distribution<int64_t>(1, 7)(rng), x_shape.back()};
        const std::vector<int64_t> b_shape = {w_shape[0]};
        const std::string batch = std::string("ab").substr(0, batch_rank);
        const std::string xl = batch + "k";
        const std::string ol = batch + "n";
        std::vector<int64_t> out_shape(x_shape.begin(), x_shape.end() - 1);
        out_shape.push_back(w_shape[0]);
        const TensorSpec x{x_shape, testing::RandomLayout(mesh, batch_rank + 1, rng, true)};
        const TensorSpec w{w_shape, testing::RandomLayout(mesh, 2, rng, true)};
        const TensorSpec b{b_shape, testing::RandomLayout(mesh, 1, rng, true)};
        const TensorSpec dy{out_shape, testing::RandomLayout(mesh, batch_rank + 1, rng, true)};
        const Dense gx = testing::RandomDense(x_shape, rng);
        const Dense gw = testing::RandomDense(w_shape, rng);
        const Dense gb = testing::RandomDense(b_shape, rng);
        const Dense gdy = testing::RandomDense(out_shape, rng);

        // Forward: y = x W^T (+ b per rank, or once after the reduction when the output is Partial).
        const SpmdInfo fwd = InferLinearForward(mesh, x, w, b);
        SCOPED_TRACE(::testing::Message() << x.layout.ToString() << " " << w.layout.ToString() << " "
                                          << b.layout.ToString() << " -> " << fwd.outputs[0].layout.ToString());
        Dense want = DenseEinsum({xl, "nk"}, {gx, gw}, ol);
        for (size_t e = 0; e < want.data.size(); ++e) {
            want.data[e] += gb.data[e % w_shape[0]];
        }
        Shards out = LocalEinsum(
            mesh, {xl, "nk"},
            {Distribute(mesh, gx, fwd.inputs[0].layout, rng), Distribute(mesh, gw, fwd.inputs[1].layout, rng)}, ol);
        const Shards lb = Distribute(mesh, gb, fwd.inputs[2].layout, rng);
        EXPECT_EQ(fwd.bias_after_reduction, fwd.outputs[0].layout.IsPartial());
        if (fwd.bias_after_reduction) {
            out = testing::Resolve(mesh, out, fwd.outputs[0].layout);
        }
        for (int64_t r = 0; r < mesh.Size(); ++r) {
            const int64_t n_local = out[r].shape.back();
            ASSERT_EQ(lb[r].shape[0], n_local);
            for (size_t e = 0; e < out[r].data.size(); ++e) {
                out[r].data[e] += lb[r].data[e % n_local];
            }
        }
        ASSERT_TRUE(
            ShardsMatch(mesh, out, want,
                        fwd.bias_after_reduction ? fwd.outputs[0].layout.WithoutPartial() : fwd.outputs[0].layout));

        // Grads: dx = dy W, dW = dy^T x, db = sum dy.
        RuleOptions options; // odd cases: the cost-based grad enumeration must be exact too
        options.mode = i % 2 == 0 ? RuleMode::kDeterministic : RuleMode::kCostBased;
        const SpmdInfo grad = InferLinearGrad(mesh, x, w, b, dy, options);
        SCOPED_TRACE(::testing::Message()
                     << "dy " << dy.layout.ToString() << " -> dx " << grad.Output("x_grad").layout.ToString() << " dW "
                     << grad.Output("weight_grad").layout.ToString() << " db "
                     << grad.Output("bias_grad").layout.ToString());
        const Shards lx = Distribute(mesh, gx, grad.Input("x").layout, rng);
        const Shards lw = Distribute(mesh, gw, grad.Input("weight").layout, rng);
        const Shards ldy = Distribute(mesh, gdy, grad.Input("out_grad").layout, rng);
        ASSERT_TRUE(ShardsMatch(mesh, LocalEinsum(mesh, {ol, "nk"}, {ldy, lw}, xl),
                                DenseEinsum({ol, "nk"}, {gdy, gw}, xl), grad.Output("x_grad").layout));
        ASSERT_TRUE(ShardsMatch(mesh, LocalEinsum(mesh, {ol, xl}, {ldy, lx}, "nk"),
                                DenseEinsum({ol, xl}, {gdy, gx}, "nk"), grad.Output("weight_grad").layout));
        ASSERT_TRUE(ShardsMatch(mesh, LocalEinsum(mesh, {ol}, {ldy}, "n"), DenseEinsum({ol}, {gdy}, "n"),
                                grad.Output("bias_grad").layout));
    }
}

Dense BroadcastBinary(const Dense &x, const Dense &y, const std::vector<int64_t> &out_shape, bool add) {
    Dense out(out_shape);
    const size_t rank = out_shape.size();
    testing::ForEachIndex(out_shape, [&](const std::vector<int64_t> &o) {
        auto index = [&](const Dense &t) {
            std::vector<int64_t> i;
            for (size_t j = 0; j < t.shape.size(); ++j) {
                const int64_t v = o[rank - t.shape.size() + j];
                i.push_back(t.shape[j] == 1 ? 0 : v);
            }
            return i;
        };
        out.At(o) = add ? x.At(index(x)) + y.At(index(y)) : x.At(index(x)) * y.At(index(y));
    });
    return out;
}

TEST(ElementwisePropertyTest, ShardedAddAndMultiplyWithBroadcastEqualDense) {
    std::mt19937 rng(17);
    for (int i = 0; i < kCases; ++i) {
        SCOPED_TRACE(::testing::Message() << "case " << i);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const bool add = i % 2 == 0;
        const int rank = std::uniform_int_distribution<int>(1, 3)(rng);
        const std::vector<int64_t> out_shape = RandomShape(rng, rank, 5);
        std::vector<int64_t> x_shape = out_shape;
        const int y_rank = std::uniform_int_distribution<int>(1, rank)(rng);
        std::vector<int64_t> y_shape(out_shape.end() - y_rank, out_shape.end());
        for (auto &s : x_shape) {
            s = rng() % 3 == 0 ? 1 : s;
        }
        for (auto &s : y_shape) {
            s = rng() % 3 == 0 ? 1 : s;
        }
        const TensorSpec x{x_shape, testing::RandomLayout(mesh, rank, rng, true)};
        const TensorSpec y{y_shape, testing::RandomLayout(mesh, y_rank, rng, true)};
        const std::string op = add ? "add" : "multiply";
        const SpmdInfo info = InferElementwiseForward(mesh, op, {x, y});
        SCOPED_TRACE(::testing::Message() << op << " " << x.layout.ToString() << " " << y.layout.ToString() << " -> "
                                          << info.outputs[0].layout.ToString());
        const Dense gx = testing::RandomDense(x_shape, rng);
        const Dense gy = testing::RandomDense(y_shape, rng);
        const std::vector<int64_t> full = info.outputs[0].shape;
        const Dense want = BroadcastBinary(gx, gy, full, add);
        const Shards lx = Distribute(mesh, gx, info.inputs[0].layout, rng);
        const Shards ly = Distribute(mesh, gy, info.inputs[1].layout, rng);
        Shards out(mesh.Size());
        for (int64_t r = 0; r < mesh.Size(); ++r) {
            const LocalShard s = ComputeLocalShard(mesh, full, info.outputs[0].layout, mesh.CoordinateOfIndex(r));
            out[r] = BroadcastBinary(lx[r], ly[r], s.shape, add);
        }
        ASSERT_TRUE(ShardsMatch(mesh, out, want, info.outputs[0].layout));
    }
}

TEST(ReductionPropertyTest, ShardedSumMeanMaxMinProdEqualDense) {
    std::mt19937 rng(19);
    const ReductionKind kinds[] = {ReductionKind::kSum, ReductionKind::kMean, ReductionKind::kMax, ReductionKind::kMin,
                                   ReductionKind::kProd};
    for (int i = 0; i < kCases; ++i) {
        SCOPED_TRACE(::testing::Message() << "case " << i);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const int rank = std::uniform_int_distribution<int>(1, 3)(rng);
        const std::vector<int64_t> shape = RandomShape(rng, rank, 7);
        ReductionAttrs attrs;
        attrs.kind = kinds[i % 5];
        for (int a = 0; a < rank; ++a) {
            if (rng() % 2 == 0) {
                attrs.axes.push_back(a);
            }
        }
        const ReduceOp partial_op = attrs.kind == ReductionKind::kMax    ? ReduceOp::kMax
                                    : attrs.kind == ReductionKind::kMin  ? ReduceOp::kMin
                                    : attrs.kind == ReductionKind::kProd ? ReduceOp::kProd
                                                                         : ReduceOp::kSum;
        const TensorSpec x{shape, testing::RandomLayout(mesh, rank, rng, true, i % 8 < 4 ? partial_op : RandomOp(rng))};
        const SpmdInfo info = InferReductionForward(mesh, x, attrs);
        SCOPED_TRACE(::testing::Message()
                     << "axes " << attrs.axes.size() << " " << x.layout.ToString() << " -> "
                     << info.inputs[0].layout.ToString() << " -> " << info.outputs[0].layout.ToString());
        const std::string labels = std::string("abc").substr(0, rank);
        std::string out_labels;
        int64_t count = 1;
        for (int a = 0; a < rank; ++a) {
            const bool reduced =
                attrs.axes.empty() || std::find(attrs.axes.begin(), attrs.axes.end(), a) != attrs.axes.end();
            if (reduced) {
                count *= shape[a];
            } else {
                out_labels.push_back(labels[a]);
            }
        }
        const ReduceOp combine = partial_op;
        // prod: factors in [-2, 2], so a product of up to 343 of them stays exact in a double.
        const Dense gx = attrs.kind == ReductionKind::kProd ? testing::RandomDense(shape, rng, -2, 2)
                                                            : testing::RandomDense(shape, rng);
        Dense want = DenseEinsum({labels}, {gx}, out_labels, combine);
        Shards out =
            LocalEinsum(mesh, {labels}, {Distribute(mesh, gx, info.inputs[0].layout, rng)}, out_labels, combine);
        if (attrs.kind == ReductionKind::kMean) {
            // The local kernel divides by the global count.
            for (double &v : want.data) {
                v /= static_cast<double>(count);
            }
            for (Dense &d : out) {
                for (double &v : d.data) {
                    v /= static_cast<double>(count);
                }
            }
        }
        // A local max over an empty shard is not defined: only compare when no shard of x is empty.
        bool empty = false;
        for (int64_t r = 0; r < mesh.Size(); ++r) {
            empty |= testing::Numel(
                         ComputeLocalShard(mesh, shape, info.inputs[0].layout, mesh.CoordinateOfIndex(r)).shape) == 0;
        }
        if (empty && combine != ReduceOp::kSum) {
            continue;
        }
        ASSERT_TRUE(ShardsMatch(mesh, out, want, info.outputs[0].layout, 1e-9));
    }
}

TEST(EmbeddingPropertyTest, ShardedLookupEqualsDense) {
    std::mt19937 rng(23);
    for (int i = 0; i < kCases; ++i) {
        SCOPED_TRACE(::testing::Message() << "case " << i);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const int rank = std::uniform_int_distribution<int>(1, 2)(rng);
        const std::vector<int64_t> ids_shape = RandomShape(rng, rank, 5);
        const std::vector<int64_t> w_shape = RandomShape(rng, 2, 7);
        const TensorSpec ids{ids_shape, testing::RandomLayout(mesh, rank, rng, false)};
        const TensorSpec w{w_shape, testing::RandomLayout(mesh, 2, rng, true)};
        const SpmdInfo info = InferEmbeddingForward(mesh, ids, w);
        SCOPED_TRACE(::testing::Message() << ids.layout.ToString() << " " << w.layout.ToString() << " -> "
                                          << info.outputs[0].layout.ToString());
        const Dense gids = testing::RandomDense(ids_shape, rng, 0, static_cast<int>(w_shape[0]) - 1);
        const Dense gw = testing::RandomDense(w_shape, rng);
        auto lookup = [](const Dense &idv, const Dense &table, int64_t vocab_offset) {
            std::vector<int64_t> shape = idv.shape;
            shape.push_back(table.shape[1]);
            Dense out(shape);
            testing::ForEachIndex(idv.shape, [&](const std::vector<int64_t> &i) {
                const int64_t row = static_cast<int64_t>(idv.At(i)) - vocab_offset;
                for (int64_t h = 0; h < table.shape[1]; ++h) {
                    std::vector<int64_t> o = i;
                    o.push_back(h);
                    out.At(o) = (row >= 0 && row < table.shape[0]) ? table.At({row, h}) : 0.0;
                }
            });
            return out;
        };
        const Dense want = lookup(gids, gw, 0);
        const Shards lids = Distribute(mesh, gids, info.inputs[0].layout, rng);
        const Shards lw = Distribute(mesh, gw, info.inputs[1].layout, rng);
        Shards out(mesh.Size());
        for (int64_t r = 0; r < mesh.Size(); ++r) {
            const LocalShard s = ComputeLocalShard(mesh, w_shape, info.inputs[1].layout, mesh.CoordinateOfIndex(r));
            out[r] = lookup(lids[r], lw[r], s.offset[0]);
        }
        ASSERT_TRUE(ShardsMatch(mesh, out, want, info.outputs[0].layout));
    }
}

} // namespace
} // namespace shardline::spmd
