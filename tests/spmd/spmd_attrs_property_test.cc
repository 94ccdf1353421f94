// Property tests of issue 19's attributes on the virtual mesh (spmd_test_util.h): random meshes (1-3 dims of size
// 1-3), uneven shapes and random layouts; every rank computes its local op on its shards of the rule's required
// layouts, Partials are resolved and each shard is compared with the dense float64 result. Seeded.

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

Shards LocalEinsum(const ProcessMesh &mesh, const std::vector<std::string> &labels, const std::vector<Shards> &inputs,
                   const std::string &out_labels) {
    Shards out(mesh.Size());
    for (int64_t r = 0; r < mesh.Size(); ++r) {
        std::vector<Dense> operands;
        for (const Shards &s : inputs) {
            operands.push_back(s[r]);
        }
        out[r] = DenseEinsum(labels, operands, out_labels);
    }
    return out;
}

RuleOptions Mode(int c) {
    RuleOptions options;
    options.mode = c % 2 == 0 ? RuleMode::kDeterministic : RuleMode::kCostBased;
    return options;
}

// linear with trans_x / trans_y: y = op(x) op(w) + b, dx, dw, db; the bias once after a reduction.
TEST(LinearAttrsPropertyTest, TransposedForwardAndGradsEqualDense) {
    std::mt19937 rng(191);
    for (int c = 0; c < kCases; ++c) {
        SCOPED_TRACE(::testing::Message() << "case " << c);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const LinearAttrs attrs{.trans_x = rng() % 2 == 0, .trans_y = rng() % 2 == 0};
        const int batch_rank = std::uniform_int_distribution<int>(attrs.trans_x ? 0 : 1, 1)(rng);
        const std::string batch = std::string("ab").substr(0, batch_rank);
        const std::string xl = batch + (attrs.trans_x ? "km" : "k");
        const std::string wl = attrs.trans_y ? "nk" : "kn";
        const std::string ol = batch + (attrs.trans_x ? "mn" : "n");
        std::map<char, int64_t> size;
        for (char l : std::string("abkmn")) {
            size[l] = std::uniform_int_distribution<int64_t>(1, 6)(rng);
        }
        auto shape_of = [&](const std::string &labels) {
            std::vector<int64_t> s;
            for (char l : labels) {
                s.push_back(size[l]);
            }
            return s;
        };
        const TensorSpec x{shape_of(xl), testing::RandomLayout(mesh, static_cast<int>(xl.size()), rng, true)};
        const TensorSpec w{shape_of(wl), testing::RandomLayout(mesh, 2, rng, true)};
        const TensorSpec b{shape_of("n"), testing::RandomLayout(mesh, 1, rng, true)};
        const TensorSpec dy{shape_of(ol), testing::RandomLayout(mesh, static_cast<int>(ol.size()), rng, true)};
        const Dense gx = testing::RandomDense(x.shape, rng);
        const Dense gw = testing::RandomDense(w.shape, rng);
        const Dense gb = testing::RandomDense(b.shape, rng);
        const Dense gdy = testing::RandomDense(dy.shape, rng);

        const SpmdInfo fwd = InferLinearForward(mesh, x, w, b, attrs, Mode(c));
        SCOPED_TRACE(::testing::Message() << "trans_x " << attrs.trans_x << " trans_y " << attrs.trans_y << " "
                                          << x.layout.ToString() << " " << w.layout.ToString() << " "
                                          << b.layout.ToString() << " -> " << fwd.outputs[0].layout.ToString());
        Dense want = DenseEinsum({xl, wl}, {gx, gw}, ol);
        const int64_t n = size['n'];
        for (size_t e = 0; e < want.data.size(); ++e) {
            want.data[e] += gb.data[e % n];
        }
        Shards out = LocalEinsum(
            mesh, {xl, wl},
            {Distribute(mesh, gx, fwd.inputs[0].layout, rng), Distribute(mesh, gw, fwd.inputs[1].layout, rng)}, ol);
        if (fwd.bias_after_reduction) {
            out = testing::Resolve(mesh, out, fwd.outputs[0].layout);
        }
        const Shards lb = Distribute(mesh, gb, fwd.inputs[2].layout, rng);
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

        const SpmdInfo grad = InferLinearGrad(mesh, x, w, b, dy, attrs, Mode(c));
        const Shards lx = Distribute(mesh, gx, grad.Input("x").layout, rng);
        const Shards lw = Distribute(mesh, gw, grad.Input("weight").layout, rng);
        const Shards ldy = Distribute(mesh, gdy, grad.Input("out_grad").layout, rng);
        ASSERT_TRUE(ShardsMatch(mesh, LocalEinsum(mesh, {ol, wl}, {ldy, lw}, xl), DenseEinsum({ol, wl}, {gdy, gw}, xl),
                                grad.Output("x_grad").layout));
        ASSERT_TRUE(ShardsMatch(mesh, LocalEinsum(mesh, {ol, xl}, {ldy, lx}, wl), DenseEinsum({ol, xl}, {gdy, gx}, wl),
                                grad.Output("weight_grad").layout));
        ASSERT_TRUE(ShardsMatch(mesh, LocalEinsum(mesh, {ol}, {ldy}, "n"), DenseEinsum({ol}, {gdy}, "n"),
                                grad.Output("bias_grad").layout));
    }
}

/// out = x * y (broadcast y over x's leading dims) or a unary op, locally on every rank.
Dense Apply(const std::string &op, const Dense &x, const Dense *y) {
    Dense out = x;
    for (size_t e = 0; e < out.data.size(); ++e) {
        if (op == "multiply") {
            out.data[e] *= y->data[e % y->data.size()];
        } else if (op == "abs") {
            out.data[e] = std::abs(out.data[e]);
        }
    }
    return out;
}

// multiply (both operands P(prod) on the same mesh dims, or not), identity and abs with P(prod) inputs
TEST(ProdPartialPropertyTest, ProdPartialsThroughMultiplyAndUnaryOpsEqualDense) {
    std::mt19937 rng(193);
    const char *ops[] = {"multiply", "identity", "abs"};
    int kept = 0; // cases whose output stays P(prod): the ones this test is about
    for (int c = 0; c < kCases; ++c) {
        SCOPED_TRACE(::testing::Message() << "case " << c);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const std::string op = ops[c % 3];
        const int rank = std::uniform_int_distribution<int>(1, 2)(rng);
        const std::vector<int64_t> shape = RandomShape(rng, rank, 5);
        const std::vector<int64_t> y_shape(shape.end() - 1, shape.end()); // broadcast over the leading dim
        const Layout xl = testing::RandomLayout(mesh, rank, rng, true, ReduceOp::kProd);
        // y: the same Partials as x half of the time (then they stay), random ones otherwise.
        Layout yl = testing::RandomLayout(mesh, 1, rng, true, ReduceOp::kProd);
        if (rng() % 2 == 0) {
            std::vector<std::vector<int>> dims(1);
            for (int d : yl.MeshDims(0)) {
                if (!xl.IsPartialOn(d)) {
                    dims[0].push_back(d);
                }
            }
            yl = Layout(dims, xl.Partial());
        }
        std::vector<TensorSpec> inputs = {{shape, xl}};
        if (op == "multiply") {
            inputs.push_back({y_shape, yl});
        }
        const SpmdInfo info = InferElementwiseForward(mesh, op, inputs);
        SCOPED_TRACE(::testing::Message() << op << " " << xl.ToString() << " " << yl.ToString() << " -> "
                                          << info.outputs[0].layout.ToString());
        const Dense gx = testing::RandomDense(shape, rng, -3, 3);
        const Dense gy = testing::RandomDense(y_shape, rng, -3, 3);
        const Shards lx = Distribute(mesh, gx, info.inputs[0].layout, rng);
        const Shards ly = op == "multiply" ? Distribute(mesh, gy, info.inputs[1].layout, rng) : Shards{};
        Shards out(mesh.Size());
        for (int64_t r = 0; r < mesh.Size(); ++r) {
            out[r] = Apply(op, lx[r], op == "multiply" ? &ly[r] : nullptr);
        }
        ASSERT_TRUE(ShardsMatch(mesh, out, Apply(op, gx, &gy), info.outputs[0].layout, 1e-9));
        kept += info.outputs[0].layout.IsPartial() ? 1 : 0;
        const Layout x_canonical = xl.Canonical(mesh);
        if (op == "multiply" && x_canonical.Partial() == yl.Canonical(mesh).Partial() && x_canonical.IsPartial()) {
            // Every shared P(prod) no label claims stays Partial.
            for (const auto &[d, o] : x_canonical.Partial()) {
                if (info.inputs[0].layout.TensorDimOf(d) < 0) {
                    EXPECT_TRUE(info.outputs[0].layout.IsPartialOn(d)) << "mesh dim " << d;
                }
            }
        }
    }
    EXPECT_GT(kept, 50);
}

// embedding sparse grad: an answer is the dense gradient's layout, never Partial, and exact; a refusal is a layout
// whose dense gradient is Partial or whose table shards the vocab.
TEST(EmbeddingSparsePropertyTest, AnsweredGradsAreExactAndRefusedOnesNeedAReduction) {
    std::mt19937 rng(197);
    int answered = 0;
    int refused = 0;
    for (int c = 0; c < kCases; ++c) {
        SCOPED_TRACE(::testing::Message() << "case " << c);
        const ProcessMesh mesh = testing::RandomMesh(rng);
        const std::vector<int64_t> ids_shape = RandomShape(rng, 2, 4);
        const std::vector<int64_t> w_shape = RandomShape(rng, 2, 6);
        const TensorSpec ids{ids_shape, testing::RandomLayout(mesh, 2, rng, false)};
        const TensorSpec w{w_shape, testing::RandomLayout(mesh, 2, rng, false)};
        const TensorSpec dy{{ids_shape[0], ids_shape[1], w_shape[1]}, testing::RandomLayout(mesh, 3, rng, c % 3 == 0)};
        const SpmdInfo dense = InferEmbeddingGrad(mesh, ids, w, dy);
        SpmdInfo sparse;
        try {
            sparse = InferEmbeddingGrad(mesh, ids, w, dy, EmbeddingAttrs{.sparse = true});
        } catch (const SpmdError &) {
            ++refused;
            EXPECT_TRUE(dense.Output("weight_grad").layout.IsPartial() ||
                        !w.layout.Canonical(mesh).MeshDims(0).empty());
            continue;
        }
        ++answered;
        ASSERT_EQ(sparse.Output("weight_grad"), dense.Output("weight_grad"));
        ASSERT_FALSE(sparse.Output("weight_grad").layout.IsPartial());
        // dW[v, h] = sum over lookups of dy: each rank scatters its dy rows into the rows of its table shard.
        const Dense gids = testing::RandomDense(ids_shape, rng, 0, static_cast<int>(w_shape[0]) - 1);
        const Dense gdy = testing::RandomDense(dy.shape, rng);
        auto scatter = [&](const Dense &idv, const Dense &d, const std::vector<int64_t> &table, int64_t v0,
                           int64_t h0) {
            Dense out(table, 0.0);
            testing::ForEachIndex(idv.shape, [&](const std::vector<int64_t> &i) {
                const int64_t row = static_cast<int64_t>(idv.At(i)) - v0;
                for (int64_t h = 0; h < table[1] && row >= 0 && row < table[0]; ++h) {
                    out.At({row, h}) += d.At({i[0], i[1], h});
                }
            });
            (void)h0;
            return out;
        };
        const Dense want = scatter(gids, gdy, w_shape, 0, 0);
        const Shards lids = Distribute(mesh, gids, sparse.Input("ids").layout, rng);
        const Shards ldy = Distribute(mesh, gdy, sparse.Input("out_grad").layout, rng);
        Shards out(mesh.Size());
        for (int64_t r = 0; r < mesh.Size(); ++r) {
            const LocalShard s =
                ComputeLocalShard(mesh, w_shape, sparse.Output("weight_grad").layout, mesh.CoordinateOfIndex(r));
            out[r] = scatter(lids[r], ldy[r], s.shape, s.offset[0], s.offset[1]);
        }
        ASSERT_TRUE(ShardsMatch(mesh, out, want, sparse.Output("weight_grad").layout));
    }
    EXPECT_GT(answered, 20);
    EXPECT_GT(refused, 20);
}

} // namespace
} // namespace shardline::spmd
