// Property tests of softmax / log_softmax, cross-entropy (plain and vocab-parallel), transpose, reshape and the
// elementwise gradients: random meshes (1-3 dims of size 1-3), random uneven shapes and random layouts (co-sharding,
// Partials); every rank is simulated in one process with the rule's required layouts (and its internal
// all-reduces), then Partials are resolved and each rank's shard is compared with the dense op. Seeded: a failure
// prints the case index and reproduces exactly. Odd cases use RuleMode::kCostBased (forward and grad).

#include <cmath>
#include <limits>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "spmd_test_util.h"

namespace shardline::spmd {
namespace {

using testing::Dense;
using testing::Distribute;
using testing::ForEachIndex;
using testing::RandomShape;
using testing::Shards;
using testing::ShardsMatch;

constexpr int kCases = 300;

RuleOptions Mode(int c) {
    RuleOptions options;
    options.mode = c % 2 == 0 ? RuleMode::kDeterministic : RuleMode::kCostBased;
    return options;
}

std::vector<int64_t> Coord(const ProcessMesh &mesh, int64_t r) { return mesh.CoordinateOfIndex(r); }

/// All-reduces every rank's tensor over each mesh dim of `mesh_dims` (the op's internal collectives).
void AllReduce(const ProcessMesh &mesh, Shards &shards, const std::vector<int> &mesh_dims, ReduceOp op) {
    for (int d : mesh_dims) {
        for (const auto &group : testing::GroupsAlong(mesh, d)) {
            std::vector<Dense> parts;
            for (int64_t r : group) {
                parts.push_back(shards[r]);
            }
            const Dense reduced = testing::Reduce(parts, op);
            for (int64_t r : group) {
                shards[r] = reduced;
            }
        }
    }
}

/// Mesh dims of the internal collectives with `op`, in order.
std::vector<int> InternalDims(const SpmdInfo &info, ReduceOp op, const std::string &what_prefix) {
    std::vector<int> dims;
    for (const InternalCollective &c : info.internal) {
        if (c.reduce_op == op && c.what.rfind(what_prefix, 0) == 0) {
            dims.push_back(c.mesh_dim);
        }
    }
    return dims;
}

/// Applies fn(row_index_without_axis, values along axis) -> one statistic per row; the result keeps the axis as 1.
Dense RowStat(const Dense &t, int axis, double init, const std::function<double(double, double)> &combine) {
    std::vector<int64_t> shape = t.shape;
    shape[axis] = 1;
    Dense out(shape, init);
    ForEachIndex(t.shape, [&](const std::vector<int64_t> &i) {
        std::vector<int64_t> o = i;
        o[axis] = 0;
        out.At(o) = combine(out.At(o), t.At(i));
    });
    return out;
}

double RowAt(const Dense &stat, std::vector<int64_t> i, int axis) {
    i[axis] = 0;
    return stat.At(i);
}

/// Softmax / log_softmax of every rank's rows, with the row max and the sum of exponentials all-reduced over
/// `axis_dims` (vocab-parallel; empty when the axis is whole on every rank).
Shards ShardedSoftmax(const ProcessMesh &mesh, const Shards &x, int axis, bool log, const std::vector<int> &max_dims,
                      const std::vector<int> &sum_dims) {
    const double lowest = -std::numeric_limits<double>::infinity();
    Shards m(mesh.Size()), s(mesh.Size()), y(mesh.Size());
    for (int64_t r = 0; r < mesh.Size(); ++r) {
        m[r] = RowStat(x[r], axis, lowest, [](double a, double b) { return std::max(a, b); });
    }
    AllReduce(mesh, m, max_dims, ReduceOp::kMax);
    for (int64_t r = 0; r < mesh.Size(); ++r) {
        Dense e = x[r];
        ForEachIndex(e.shape,
                     [&](const std::vector<int64_t> &i) { e.At(i) = std::exp(e.At(i) - RowAt(m[r], i, axis)); });
        s[r] = RowStat(e, axis, 0.0, [](double a, double b) { return a + b; });
    }
    AllReduce(mesh, s, sum_dims, ReduceOp::kSum);
    for (int64_t r = 0; r < mesh.Size(); ++r) {
        y[r] = x[r];
        ForEachIndex(y[r].shape, [&](const std::vector<int64_t> &i) {
            const double mx = RowAt(m[r], i, axis);
            const double sum = RowAt(s[r], i, axis);
            y[r].At(i) = log ? x[r].At(i) - mx - std::log(sum) : std::exp(x[r].At(i) - mx) / sum;
        });
    }
    return y;
}

Dense DenseSoftmax(const Dense &x, int axis, bool log) {
    ProcessMesh one({1});
    return ShardedSoftmax(one, {x}, axis, log, {}, {})[0];
}

/// A random softmax case: mesh, rank 1..3, shape, axis (in [-rank, rank) when `negative_axis`, else [0, rank)),
/// log or not, vocab parallel or not.
struct RandomSoftmax {
    ProcessMesh mesh;
    int rank = 1;
    std::vector<int64_t> shape;
    SoftmaxAttrs attrs;
};
RandomSoftmax DrawSoftmax(std::mt19937 &rng, bool negative_axis) {
    RandomSoftmax r{.mesh = testing::RandomMesh(rng)};
    r.rank = std::uniform_int_distribution<int>(1, 3)(rng);
    r.shape = RandomShape(rng, r.rank, 6);
    r.attrs.axis = std::uniform_int_distribution<int>(negative_axis ? -r.rank : 0, r.rank - 1)(rng);
    r.attrs.log = rng() % 2 == 0;
    r.attrs.vocab_parallel = rng() % 2 == 0;
    return r;
}

TEST(SoftmaxPropertyTest, ShardedForwardEqualsDense) {
    std::mt19937 rng(29);
    for (int c = 0; c < kCases; ++c) {
        SCOPED_TRACE(::testing::Message() << "case " << c);
        const RandomSoftmax sm = DrawSoftmax(rng, /*negative_axis=*/true);
        const int axis = sm.attrs.axis < 0 ? sm.attrs.axis + sm.rank : sm.attrs.axis;
        const TensorSpec x{sm.shape, testing::RandomLayout(sm.mesh, sm.rank, rng, true)};
        const SpmdInfo info = InferSoftmaxForward(sm.mesh, x, sm.attrs, Mode(c));
        SCOPED_TRACE(::testing::Message()
                     << "axis " << axis << " vp " << sm.attrs.vocab_parallel << " " << x.layout.ToString() << " -> "
                     << info.inputs[0].layout.ToString() << " -> " << info.outputs[0].layout.ToString());
        const Layout &in = info.inputs[0].layout;
        ASSERT_FALSE(in.IsPartial());
        if (!sm.attrs.vocab_parallel) {
            ASSERT_TRUE(in.MeshDims(axis).empty());
        }
        ASSERT_EQ(InternalDims(info, ReduceOp::kMax, "row max"), in.MeshDims(axis));
        const Dense gx = testing::RandomDense(sm.shape, rng);
        const Shards y = ShardedSoftmax(sm.mesh, Distribute(sm.mesh, gx, in, rng), axis, sm.attrs.log,
                                        InternalDims(info, ReduceOp::kMax, "row max"),
                                        InternalDims(info, ReduceOp::kSum, "row sum"));
        ASSERT_TRUE(ShardsMatch(sm.mesh, y, DenseSoftmax(gx, axis, sm.attrs.log), info.outputs[0].layout, 1e-9));
    }
}

TEST(SoftmaxPropertyTest, ShardedGradEqualsDense) {
    // softmax: dx = y * (dy - rowsum(dy * y)); log_softmax: dx = dy - exp(y) * rowsum(dy)
    std::mt19937 rng(31);
    for (int c = 0; c < kCases; ++c) {
        SCOPED_TRACE(::testing::Message() << "case " << c);
        const RandomSoftmax sm = DrawSoftmax(rng, /*negative_axis=*/false);
        const TensorSpec x{sm.shape, testing::RandomLayout(sm.mesh, sm.rank, rng, true)};
        const TensorSpec dy{sm.shape, testing::RandomLayout(sm.mesh, sm.rank, rng, true)};
        const SpmdInfo info = InferSoftmaxGrad(sm.mesh, x, dy, sm.attrs, Mode(c));
        SCOPED_TRACE(::testing::Message()
                     << "axis " << sm.attrs.axis << " vp " << sm.attrs.vocab_parallel << " x " << x.layout.ToString()
                     << " dy " << dy.layout.ToString() << " -> y " << info.Input("out").layout.ToString() << " dy "
                     << info.Input("out_grad").layout.ToString() << " dx " << info.Output("x_grad").layout.ToString());
        ASSERT_FALSE(info.Input("out").layout.IsPartial());
        const Dense gx = testing::RandomDense(sm.shape, rng);
        const Dense gy = DenseSoftmax(gx, sm.attrs.axis, sm.attrs.log);
        const Dense gdy = testing::RandomDense(sm.shape, rng);
        const int axis = sm.attrs.axis;
        auto backward = [&](const ProcessMesh &m, const Shards &y, const Shards &d, const std::vector<int> &dims) {
            Shards t(m.Size());
            for (int64_t r = 0; r < m.Size(); ++r) {
                Dense prod = d[r];
                if (!sm.attrs.log) {
                    for (size_t e = 0; e < prod.data.size(); ++e) {
                        prod.data[e] *= y[r].data[e];
                    }
                }
                t[r] = RowStat(prod, axis, 0.0, [](double a, double b) { return a + b; });
            }
            AllReduce(m, t, dims, ReduceOp::kSum);
            Shards dx(m.Size());
            for (int64_t r = 0; r < m.Size(); ++r) {
                dx[r] = d[r];
                ForEachIndex(dx[r].shape, [&](const std::vector<int64_t> &i) {
                    const double row = RowAt(t[r], i, axis);
                    dx[r].At(i) =
                        sm.attrs.log ? d[r].At(i) - std::exp(y[r].At(i)) * row : y[r].At(i) * (d[r].At(i) - row);
                });
            }
            return dx;
        };
        const Dense want = backward(ProcessMesh({1}), {gy}, {gdy}, {})[0];
        ASSERT_EQ(InternalDims(info, ReduceOp::kSum, "row sum"), info.Input("out").layout.MeshDims(axis));
        const Shards dx = backward(sm.mesh, Distribute(sm.mesh, gy, info.Input("out").layout, rng),
                                   Distribute(sm.mesh, gdy, info.Input("out_grad").layout, rng),
                                   InternalDims(info, ReduceOp::kSum, "row sum"));
        ASSERT_TRUE(ShardsMatch(sm.mesh, dx, want, info.Output("x_grad").layout, 1e-9));
    }
}

struct CrossEntropyCase {
    ProcessMesh mesh;
    std::vector<int64_t> logits_shape, labels_shape;
    CrossEntropyAttrs attrs;
    Dense logits, labels;
    int64_t rows = 1;
    int axis = 0;                        ///< the class dim (the last of the logits)
    TensorSpec logits_spec, labels_spec; ///< random layouts: logits may be partial, labels not
};

CrossEntropyCase RandomCrossEntropy(std::mt19937 &rng) {
    CrossEntropyCase c;
    c.mesh = testing::RandomMesh(rng);
    const int batch_rank = std::uniform_int_distribution<int>(1, 2)(rng);
    c.labels_shape = RandomShape(rng, batch_rank, 5);
    c.logits_shape = c.labels_shape;
    c.logits_shape.push_back(std::uniform_int_distribution<int64_t>(1, 9)(rng));
    const LossReduction reductions[] = {LossReduction::kNone, LossReduction::kMean, LossReduction::kSum};
    c.attrs.reduction = reductions[rng() % 3];
    c.attrs.vocab_parallel = rng() % 4 != 0;
    c.logits = testing::RandomDense(c.logits_shape, rng);
    c.labels = testing::RandomDense(c.labels_shape, rng, 0, static_cast<int>(c.logits_shape.back()) - 1);
    c.rows = testing::Numel(c.labels_shape);
    c.axis = static_cast<int>(c.logits_shape.size()) - 1;
    c.logits_spec = {c.logits_shape, testing::RandomLayout(c.mesh, c.axis + 1, rng, true)};
    c.labels_spec = {c.labels_shape, testing::RandomLayout(c.mesh, c.axis, rng, false)};
    return c;
}

/// Per rank: (softmax of its logits rows with the all-reduced statistics, loss rows); the class offset of a rank's
/// logits shard tells it which target logits it holds (Megatron's vocab-parallel cross-entropy).
std::pair<Shards, Shards> ShardedCrossEntropy(const ProcessMesh &mesh, const std::vector<int64_t> &logits_shape,
                                              const Layout &logits_layout, const Shards &logits, const Shards &labels,
                                              const std::vector<int> &class_dims) {
    const int axis = static_cast<int>(logits_shape.size()) - 1;
    const Shards p = ShardedSoftmax(mesh, logits, axis, /*log=*/true, class_dims, class_dims);
    Shards target(mesh.Size()), loss(mesh.Size());
    for (int64_t r = 0; r < mesh.Size(); ++r) {
        const int64_t offset = ComputeLocalShard(mesh, logits_shape, logits_layout, Coord(mesh, r)).offset[axis];
        const int64_t local = logits[r].shape[axis];
        target[r] = Dense(labels[r].shape, 0.0);
        ForEachIndex(labels[r].shape, [&](const std::vector<int64_t> &i) {
            const int64_t k = static_cast<int64_t>(labels[r].At(i)) - offset;
            if (k >= 0 && k < local) {
                std::vector<int64_t> li = i;
                li.push_back(k);
                target[r].At(i) = p[r].At(li); // log-probability of the target class
            }
        });
    }
    AllReduce(mesh, target, class_dims, ReduceOp::kSum);
    for (int64_t r = 0; r < mesh.Size(); ++r) {
        loss[r] = target[r];
        for (double &v : loss[r].data) {
            v = -v;
        }
    }
    return {p, loss};
}

Dense SumAll(const Dense &t, double scale) {
    Dense out(std::vector<int64_t>{}, 0.0);
    for (double v : t.data) {
        out.data[0] += v;
    }
    out.data[0] *= scale;
    return out;
}

TEST(CrossEntropyPropertyTest, ShardedForwardEqualsDense) {
    std::mt19937 rng(37);
    for (int n = 0; n < kCases; ++n) {
        SCOPED_TRACE(::testing::Message() << "case " << n);
        const CrossEntropyCase c = RandomCrossEntropy(rng);
        const SpmdInfo info = InferCrossEntropyForward(c.mesh, c.logits_spec, c.labels_spec, c.attrs, Mode(n));
        const Layout &ll = info.inputs[0].layout;
        SCOPED_TRACE(::testing::Message()
                     << "vp " << c.attrs.vocab_parallel << " red " << static_cast<int>(c.attrs.reduction) << " "
                     << c.logits_spec.layout.ToString() << " " << c.labels_spec.layout.ToString() << " -> "
                     << ll.ToString() << " " << info.inputs[1].layout.ToString() << " -> "
                     << info.outputs[0].layout.ToString());
        ASSERT_FALSE(ll.IsPartial());
        if (!c.attrs.vocab_parallel) {
            ASSERT_TRUE(ll.MeshDims(c.axis).empty());
        }
        ASSERT_EQ(InternalDims(info, ReduceOp::kMax, "row max"), ll.MeshDims(c.axis));
        ASSERT_EQ(InternalDims(info, ReduceOp::kSum, "target"), ll.MeshDims(c.axis));
        const auto [p, loss] =
            ShardedCrossEntropy(c.mesh, c.logits_shape, ll, Distribute(c.mesh, c.logits, ll, rng),
                                Distribute(c.mesh, c.labels, info.inputs[1].layout, rng), ll.MeshDims(c.axis));
        const ProcessMesh one({1});
        const Dense want_rows =
            ShardedCrossEntropy(one, c.logits_shape, Layout::Replicated(c.axis + 1), {c.logits}, {c.labels}, {})
                .second[0];
        if (c.attrs.reduction == LossReduction::kNone) {
            ASSERT_TRUE(ShardsMatch(c.mesh, loss, want_rows, info.outputs[0].layout, 1e-9));
            continue;
        }
        // mean: the local kernel divides by the global row count; the scalar is P(sum) over the batch mesh dims.
        const double scale = c.attrs.reduction == LossReduction::kMean ? 1.0 / static_cast<double>(c.rows) : 1.0;
        Shards local(c.mesh.Size());
        for (int64_t r = 0; r < c.mesh.Size(); ++r) {
            local[r] = SumAll(loss[r], scale);
        }
        ASSERT_TRUE(ShardsMatch(c.mesh, local, SumAll(want_rows, scale), info.outputs[0].layout, 1e-9));
    }
}

TEST(CrossEntropyPropertyTest, ShardedGradEqualsDense) {
    // dlogits = (softmax(logits) - onehot(label)) * dloss_row, with the forward's (all-reduced) row statistics
    std::mt19937 rng(41);
    for (int n = 0; n < kCases; ++n) {
        SCOPED_TRACE(::testing::Message() << "case " << n);
        const CrossEntropyCase c = RandomCrossEntropy(rng);
        const bool scalar = c.attrs.reduction != LossReduction::kNone;
        const TensorSpec dloss = scalar ? TensorSpec{{}, Layout::Replicated(0)}
                                        : TensorSpec{c.labels_shape, testing::RandomLayout(c.mesh, c.axis, rng, true)};
        const SpmdInfo info = InferCrossEntropyGrad(c.mesh, c.logits_spec, c.labels_spec, dloss, c.attrs, Mode(n));
        const Layout &ll = info.Input("logits").layout;
        SCOPED_TRACE(::testing::Message()
                     << "vp " << c.attrs.vocab_parallel << " red " << static_cast<int>(c.attrs.reduction) << " "
                     << c.logits_spec.layout.ToString() << " dloss " << dloss.layout.ToString() << " -> "
                     << ll.ToString() << " " << info.Input("labels").layout.ToString() << " dloss "
                     << info.Input("loss_grad").layout.ToString() << " -> "
                     << info.Output("logits_grad").layout.ToString());
        ASSERT_FALSE(ll.IsPartial());
        const Dense gdloss = testing::RandomDense(dloss.shape, rng);
        auto backward = [&](const ProcessMesh &m, const Layout &layout, const Shards &lg, const Shards &lb,
                            const Shards &dl, const std::vector<int> &dims) {
            const Shards p = ShardedCrossEntropy(m, c.logits_shape, layout, lg, lb, dims).first;
            Shards out(m.Size());
            for (int64_t r = 0; r < m.Size(); ++r) {
                const int64_t offset = ComputeLocalShard(m, c.logits_shape, layout, Coord(m, r)).offset[c.axis];
                out[r] = p[r];
                ForEachIndex(out[r].shape, [&](const std::vector<int64_t> &i) {
                    const std::vector<int64_t> row(i.begin(), i.end() - 1);
                    const double g = scalar ? dl[r].data[0] * (c.attrs.reduction == LossReduction::kMean
                                                                   ? 1.0 / static_cast<double>(c.rows)
                                                                   : 1.0)
                                            : dl[r].At(row);
                    const double onehot = static_cast<int64_t>(lb[r].At(row)) == i[c.axis] + offset ? 1.0 : 0.0;
                    out[r].At(i) = (std::exp(p[r].At(i)) - onehot) * g;
                });
            }
            return out;
        };
        const ProcessMesh one({1});
        const Dense want = backward(one, Layout::Replicated(c.axis + 1), {c.logits}, {c.labels}, {gdloss}, {})[0];
        const Shards got =
            backward(c.mesh, ll, Distribute(c.mesh, c.logits, ll, rng),
                     Distribute(c.mesh, c.labels, info.Input("labels").layout, rng),
                     Distribute(c.mesh, gdloss, info.Input("loss_grad").layout, rng), ll.MeshDims(c.axis));
        ASSERT_TRUE(ShardsMatch(c.mesh, got, want, info.Output("logits_grad").layout, 1e-9));
    }
}

std::vector<int> RandomPerm(std::mt19937 &rng, int rank) {
    std::vector<int> perm(rank);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    return perm;
}

TEST(TransposePropertyTest, ShardedForwardAndGradEqualDense) {
    std::mt19937 rng(43);
    const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};
    for (int c = 0; c < kCases; ++c) {
        SCOPED_TRACE(::testing::Message() << "case " << c);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const int rank = std::uniform_int_distribution<int>(1, 4)(rng);
        const std::vector<int64_t> shape = RandomShape(rng, rank, 5);
        const std::vector<int> perm = RandomPerm(rng, rank);
        const std::string labels = std::string("abcd").substr(0, rank);
        std::string out_labels;
        std::vector<int64_t> out_shape;
        for (int p : perm) {
            out_labels.push_back(labels[p]);
            out_shape.push_back(shape[p]);
        }
        const TensorSpec x{shape, testing::RandomLayout(mesh, rank, rng, true, ops[c % 4])};
        const SpmdInfo fwd = InferTransposeForward(mesh, x, perm, Mode(c));
        SCOPED_TRACE(::testing::Message() << x.layout.ToString() << " -> " << fwd.inputs[0].layout.ToString() << " -> "
                                          << fwd.outputs[0].layout.ToString());
        const Dense gx = testing::RandomDense(shape, rng);
        const Shards lx = Distribute(mesh, gx, fwd.inputs[0].layout, rng);
        Shards out(mesh.Size());
        for (int64_t r = 0; r < mesh.Size(); ++r) {
            out[r] = testing::DenseEinsum({labels}, {lx[r]}, out_labels);
        }
        ASSERT_TRUE(ShardsMatch(mesh, out, testing::DenseEinsum({labels}, {gx}, out_labels), fwd.outputs[0].layout));

        const TensorSpec dy{out_shape, testing::RandomLayout(mesh, rank, rng, true)};
        const SpmdInfo grad = InferTransposeGrad(mesh, x, dy, perm, Mode(c));
        SCOPED_TRACE(::testing::Message()
                     << "dy " << dy.layout.ToString() << " -> " << grad.Input("out_grad").layout.ToString() << " dx "
                     << grad.Output("x_grad").layout.ToString());
        const Dense gdy = testing::RandomDense(out_shape, rng);
        const Shards ldy = Distribute(mesh, gdy, grad.Input("out_grad").layout, rng);
        Shards dx(mesh.Size());
        for (int64_t r = 0; r < mesh.Size(); ++r) {
            dx[r] = testing::DenseEinsum({out_labels}, {ldy[r]}, labels);
        }
        ASSERT_TRUE(
            ShardsMatch(mesh, dx, testing::DenseEinsum({out_labels}, {gdy}, labels), grad.Output("x_grad").layout));
    }
}

/// Two random contiguous groupings of one list of factors: an input and an output shape with equal products.
std::pair<std::vector<int64_t>, std::vector<int64_t>> RandomReshape(std::mt19937 &rng) {
    const int64_t factors[] = {1, 2, 2, 3, 4, 6};
    std::vector<int64_t> atoms(std::uniform_int_distribution<int>(1, 4)(rng));
    for (auto &a : atoms) {
        a = factors[rng() % 6];
    }
    auto group = [&] {
        std::vector<int64_t> shape = {atoms[0]};
        for (size_t i = 1; i < atoms.size(); ++i) {
            if (rng() % 2 == 0) {
                shape.back() *= atoms[i];
            } else {
                shape.push_back(atoms[i]);
            }
        }
        if (rng() % 5 == 0) {
            shape.insert(shape.begin() + static_cast<long>(rng() % (shape.size() + 1)), 1); // a unit dim
        }
        return shape;
    };
    auto in = group();
    return {in, group()};
}

/// Each rank's buffer, reinterpreted with the local shape its `layout` shard of `shape` has (a local view).
Shards LocalReshape(const ProcessMesh &mesh, const Shards &from, const std::vector<int64_t> &shape,
                    const Layout &layout) {
    Shards out(mesh.Size());
    for (int64_t r = 0; r < mesh.Size(); ++r) {
        out[r] = from[r];
        out[r].shape = ComputeLocalShard(mesh, shape, layout, Coord(mesh, r)).shape;
        EXPECT_EQ(testing::Numel(out[r].shape), static_cast<int64_t>(from[r].data.size())) << "rank " << r;
    }
    return out;
}

Dense Reshaped(Dense t, const std::vector<int64_t> &shape) {
    t.shape = shape;
    return t;
}

TEST(ReshapePropertyTest, ShardedForwardAndGradAreLocalViews) {
    std::mt19937 rng(47);
    for (int c = 0; c < kCases; ++c) {
        SCOPED_TRACE(::testing::Message() << "case " << c);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const auto [in_shape, out_shape] = RandomReshape(rng);
        const TensorSpec x{in_shape, testing::RandomLayout(mesh, static_cast<int>(in_shape.size()), rng, true)};
        const SpmdInfo fwd = InferReshapeForward(mesh, x, out_shape, Mode(c));
        SCOPED_TRACE(::testing::Message()
                     << ShapeToString(in_shape) << " -> " << ShapeToString(out_shape) << " " << x.layout.ToString()
                     << " -> " << fwd.inputs[0].layout.ToString() << " -> " << fwd.outputs[0].layout.ToString());
        const Dense gx = testing::RandomDense(in_shape, rng);
        const Shards out =
            LocalReshape(mesh, Distribute(mesh, gx, fwd.inputs[0].layout, rng), out_shape, fwd.outputs[0].layout);
        ASSERT_FALSE(HasFailure());
        ASSERT_TRUE(ShardsMatch(mesh, out, Reshaped(gx, out_shape), fwd.outputs[0].layout));

        const TensorSpec dy{out_shape, testing::RandomLayout(mesh, static_cast<int>(out_shape.size()), rng, true)};
        const SpmdInfo grad = InferReshapeGrad(mesh, x, dy, out_shape, Mode(c));
        SCOPED_TRACE(::testing::Message()
                     << "dy " << dy.layout.ToString() << " -> " << grad.Input("out_grad").layout.ToString() << " dx "
                     << grad.Output("x_grad").layout.ToString());
        const Dense gdy = testing::RandomDense(out_shape, rng);
        const Shards dx = LocalReshape(mesh, Distribute(mesh, gdy, grad.Input("out_grad").layout, rng), in_shape,
                                       grad.Output("x_grad").layout);
        ASSERT_FALSE(HasFailure());
        ASSERT_TRUE(ShardsMatch(mesh, dx, Reshaped(gdy, in_shape), grad.Output("x_grad").layout));
    }
}

/// d op(x, y) / dx and / dy at one element (unary ops ignore y). gelu stands for any nonlinear pointwise function.
std::pair<double, double> Derivatives(const std::string &op, double x, double y) {
    if (op == "add") {
        return {1.0, 1.0};
    }
    if (op == "subtract") {
        return {1.0, -1.0};
    }
    if (op == "multiply") {
        return {y, x};
    }
    if (op == "divide") {
        return {1.0 / y, -x / (y * y)};
    }
    if (op == "maximum") {
        return {x >= y ? 1.0 : 0.0, x >= y ? 0.0 : 1.0};
    }
    if (op == "relu") {
        return {x > 0 ? 1.0 : 0.0, 0.0};
    }
    if (op == "gelu") {
        return {1.0 / (1.0 + x * x), 0.0};
    }
    if (op == "neg") {
        return {-1.0, 0.0};
    }
    return {std::exp(x), 0.0}; // exp
}

/// dx, dy of out = op(x, y) with numpy broadcasting: the pointwise product with dout, summed over broadcast dims.
std::pair<Dense, Dense> ElementwiseBackward(const std::string &op, const Dense &x, const Dense *y, const Dense &dout) {
    Dense dx(x.shape, 0.0);
    Dense dy = y != nullptr ? Dense(y->shape, 0.0) : Dense();
    const size_t rank = dout.shape.size();
    auto index = [&](const Dense &t, const std::vector<int64_t> &o) {
        std::vector<int64_t> i;
        for (size_t j = 0; j < t.shape.size(); ++j) {
            i.push_back(t.shape[j] == 1 ? 0 : o[rank - t.shape.size() + j]);
        }
        return i;
    };
    ForEachIndex(dout.shape, [&](const std::vector<int64_t> &o) {
        const auto ix = index(x, o);
        const double yv = y != nullptr ? y->At(index(*y, o)) : 0.0;
        const auto [ddx, ddy] = Derivatives(op, x.At(ix), yv);
        dx.At(ix) += dout.At(o) * ddx;
        if (y != nullptr) {
            dy.At(index(*y, o)) += dout.At(o) * ddy;
        }
    });
    return {dx, dy};
}

TEST(ElementwisePropertyTest, ShardedGradsWithBroadcastEqualDense) {
    std::mt19937 rng(53);
    const std::vector<std::string> ops = {"add",  "subtract", "multiply", "divide", "maximum",
                                          "relu", "gelu",     "neg",      "exp"};
    for (int c = 0; c < kCases * 2; ++c) {
        const std::string op = ops[c % ops.size()];
        SCOPED_TRACE(::testing::Message() << "case " << c << " " << op);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const bool binary = ElementwiseArity(op) == 2;
        const int rank = std::uniform_int_distribution<int>(1, 3)(rng);
        const std::vector<int64_t> out_shape = RandomShape(rng, rank, 5);
        std::vector<int64_t> x_shape = out_shape;
        const int y_rank = std::uniform_int_distribution<int>(1, rank)(rng);
        std::vector<int64_t> y_shape(out_shape.end() - y_rank, out_shape.end());
        if (binary) {
            for (auto &s : x_shape) {
                s = rng() % 3 == 0 ? 1 : s;
            }
            for (auto &s : y_shape) {
                s = rng() % 3 == 0 ? 1 : s;
            }
        }
        std::vector<TensorSpec> inputs = {{x_shape, testing::RandomLayout(mesh, rank, rng, true)}};
        if (binary) {
            inputs.push_back({y_shape, testing::RandomLayout(mesh, y_rank, rng, true)});
        }
        // The broadcast output shape (a size-1 dim of both operands stays 1).
        std::vector<int64_t> full = x_shape;
        if (binary) {
            for (int j = 0; j < y_rank; ++j) {
                full[rank - y_rank + j] = std::max(full[rank - y_rank + j], y_shape[j]);
            }
        }
        const TensorSpec dout{full, testing::RandomLayout(mesh, rank, rng, true)};
        const SpmdInfo info = InferElementwiseGrad(mesh, op, inputs, dout, Mode(c));
        SCOPED_TRACE(::testing::Message()
                     << "x " << inputs[0].layout.ToString() << " y " << (binary ? inputs[1].layout.ToString() : "-")
                     << " dout " << dout.layout.ToString() << " -> x " << info.inputs[0].layout.ToString() << " dout "
                     << info.Input("out_grad").layout.ToString() << " dx " << info.outputs[0].layout.ToString());
        const Dense gx = testing::RandomDense(x_shape, rng);
        Dense gy = testing::RandomDense(y_shape, rng, 1, 4);
        for (double &v : gy.data) {
            v = rng() % 2 == 0 ? v : -v; // nonzero: divide
        }
        const Dense gdout = testing::RandomDense(full, rng);
        const auto [want_dx, want_dy] = ElementwiseBackward(op, gx, binary ? &gy : nullptr, gdout);
        const Shards lx = Distribute(mesh, gx, info.inputs[0].layout, rng);
        const Shards ly = binary ? Distribute(mesh, gy, info.inputs[1].layout, rng) : Shards(mesh.Size());
        const Shards ld = Distribute(mesh, gdout, info.Input("out_grad").layout, rng);
        Shards dx(mesh.Size()), dy(mesh.Size());
        for (int64_t r = 0; r < mesh.Size(); ++r) {
            // Every non-broadcast dim of an operand must be sharded as the output gradient is.
            for (int j = 0; j < rank; ++j) {
                ASSERT_TRUE(lx[r].shape[j] == ld[r].shape[j] || x_shape[j] == 1) << "rank " << r << " x dim " << j;
            }
            for (int j = 0; binary && j < y_rank; ++j) {
                ASSERT_TRUE(ly[r].shape[j] == ld[r].shape[rank - y_rank + j] || y_shape[j] == 1)
                    << "rank " << r << " y dim " << j;
            }
            std::tie(dx[r], dy[r]) = ElementwiseBackward(op, lx[r], binary ? &ly[r] : nullptr, ld[r]);
        }
        ASSERT_TRUE(ShardsMatch(mesh, dx, want_dx, info.Output("x_grad").layout, 1e-9));
        if (binary) {
            ASSERT_TRUE(ShardsMatch(mesh, dy, want_dy, info.Output("y_grad").layout, 1e-9));
        }
    }
}

} // namespace
} // namespace shardline::spmd
