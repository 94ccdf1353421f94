#pragma once

// Helpers shared by the spmd tests: text layouts, and a dense CPU simulator that holds every rank's shard in one
// process, executes redistribution plans and local einsums, and compares against dense references.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/spmd/spmd.h>

namespace shardline::spmd::testing {

inline Layout L(const std::string &text) { return Layout::Parse(text); }
inline TensorSpec T(std::vector<int64_t> shape, const std::string &layout) { return {std::move(shape), L(layout)}; }
inline std::string S(const Layout &layout) { return layout.ToString(); }
inline std::string S(const TensorSpec &spec) { return spec.layout.ToString(); }

inline int64_t Numel(const std::vector<int64_t> &shape) {
    return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

/// A dense row-major float64 tensor.
struct Dense {
    std::vector<int64_t> shape;
    std::vector<double> data;

    Dense() = default;
    explicit Dense(std::vector<int64_t> s, double fill = 0.0) : shape(std::move(s)), data(Numel(shape), fill) {}

    int64_t Offset(const std::vector<int64_t> &index) const {
        int64_t off = 0;
        for (size_t i = 0; i < shape.size(); ++i) {
            off = off * shape[i] + index[i];
        }
        return off;
    }
    double &At(const std::vector<int64_t> &index) { return data[Offset(index)]; }
    double At(const std::vector<int64_t> &index) const { return data[Offset(index)]; }
};

/// Calls fn(index) for every index of `shape`, row-major.
inline void ForEachIndex(const std::vector<int64_t> &shape,
                         const std::function<void(const std::vector<int64_t> &)> &fn) {
    if (Numel(shape) == 0) {
        return;
    }
    std::vector<int64_t> index(shape.size(), 0);
    while (true) {
        fn(index);
        int d = static_cast<int>(shape.size()) - 1;
        for (; d >= 0; --d) {
            if (++index[d] < shape[d]) {
                break;
            }
            index[d] = 0;
        }
        if (d < 0) {
            return;
        }
    }
}

inline Dense Block(const Dense &t, const std::vector<int64_t> &offset, const std::vector<int64_t> &shape) {
    Dense out(shape);
    ForEachIndex(shape, [&](const std::vector<int64_t> &i) {
        std::vector<int64_t> g = i;
        for (size_t k = 0; k < g.size(); ++k) {
            g[k] += offset[k];
        }
        out.At(i) = t.At(g);
    });
    return out;
}

inline Dense Concat(const std::vector<Dense> &parts, int dim) {
    std::vector<int64_t> shape = parts.at(0).shape;
    shape[dim] = 0;
    for (const Dense &p : parts) {
        shape[dim] += p.shape[dim];
    }
    Dense out(shape);
    int64_t base = 0;
    for (const Dense &p : parts) {
        ForEachIndex(p.shape, [&](const std::vector<int64_t> &i) {
            std::vector<int64_t> g = i;
            g[dim] += base;
            out.At(g) = p.At(i);
        });
        base += p.shape[dim];
    }
    return out;
}

inline Dense Chunk(const Dense &t, int dim, int64_t parts, int64_t index) {
    auto [begin, length] = ChunkRange(t.shape[dim], parts, index);
    std::vector<int64_t> offset(t.shape.size(), 0);
    std::vector<int64_t> shape = t.shape;
    offset[dim] = begin;
    shape[dim] = length;
    return Block(t, offset, shape);
}

inline double Combine(ReduceOp op, double a, double b) {
    switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
        return a + b;
    case ReduceOp::kMax:
        return std::max(a, b);
    case ReduceOp::kMin:
        return std::min(a, b);
    case ReduceOp::kProd:
        return a * b;
    }
    return 0.0;
}

inline Dense Reduce(const std::vector<Dense> &parts, ReduceOp op) {
    Dense out = parts.at(0);
    for (size_t p = 1; p < parts.size(); ++p) {
        for (size_t i = 0; i < out.data.size(); ++i) {
            out.data[i] = Combine(op, out.data[i], parts[p].data[i]);
        }
    }
    if (op == ReduceOp::kAvg) {
        for (double &v : out.data) {
            v /= static_cast<double>(parts.size());
        }
    }
    return out;
}

inline Dense RandomDense(const std::vector<int64_t> &shape, std::mt19937 &rng, int lo = -8, int hi = 8) {
    Dense t(shape);
    std::uniform_int_distribution<int> dist(lo, hi);
    for (double &v : t.data) {
        v = dist(rng);
    }
    return t;
}

/// Every rank's local tensor, indexed by the mesh's linear index.
using Shards = std::vector<Dense>;

/// Groups of linear indices along mesh dim d.
inline std::vector<std::vector<int64_t>> GroupsAlong(const ProcessMesh &mesh, int d) {
    std::vector<std::vector<int64_t>> groups;
    for (int64_t r = 0; r < mesh.Size(); ++r) {
        std::vector<int64_t> c = mesh.CoordinateOfIndex(r);
        if (c[d] != 0) {
            continue;
        }
        std::vector<int64_t> group;
        for (int64_t i = 0; i < mesh.DimSize(d); ++i) {
            c[d] = i;
            group.push_back(mesh.LinearIndex(c));
        }
        groups.push_back(group);
    }
    return groups;
}

inline uint64_t Mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/// The shards of `global` in `layout`. Partial mesh dims split each value into terms that reduce back exactly
/// (integers for sum, n*v - others for avg, v minus a non-negative offset with one exact term for max, factors of +-1
/// times v for prod). A term
/// depends only on the element, the coordinates on the Partial mesh dims and a seed, so ranks that differ only in
/// Replicate mesh dims hold the same values, as a real Partial tensor does.
inline Shards Distribute(const ProcessMesh &mesh, const Dense &global, const Layout &layout, std::mt19937 &rng) {
    const uint64_t seed = rng();
    Shards shards(mesh.Size());
    for (int64_t r = 0; r < mesh.Size(); ++r) {
        const std::vector<int64_t> coord = mesh.CoordinateOfIndex(r);
        const LocalShard s = ComputeLocalShard(mesh, global.shape, layout, coord);
        shards[r] = Block(global, s.offset, s.shape);
        std::vector<int> done;
        for (const auto &[d, op] : layout.Partial()) {
            const int64_t n = mesh.DimSize(d);
            const int64_t c = coord[d];
            int64_t e = 0;
            ForEachIndex(s.shape, [&](const std::vector<int64_t> &local) {
                std::vector<int64_t> g = local;
                for (size_t k = 0; k < g.size(); ++k) {
                    g[k] += s.offset[k];
                }
                uint64_t key = Mix(seed ^ Mix(static_cast<uint64_t>(global.Offset(g))) ^ Mix(1000 + d));
                for (int p : done) {
                    key = Mix(key ^ Mix(static_cast<uint64_t>(coord[p] * 131 + p)));
                }
                auto term = [&](int64_t k) { return static_cast<double>(static_cast<int64_t>(Mix(key + k) % 9) - 4); };
                auto offset = [&](int64_t k) { return static_cast<double>(Mix(key + 77 + k) % 4); };
                double &v = shards[r].data[e++];
                if (op == ReduceOp::kProd) {
                    auto sign = [&](int64_t k) { return Mix(key + 5 * k) % 2 == 0 ? 1.0 : -1.0; };
                    double rest = 1.0;
                    for (int64_t k = 1; k < n; ++k) {
                        rest *= sign(k);
                    }
                    v = c == 0 ? v * rest : sign(c); // (+-1)^2 = 1: the product is v
                } else if (op == ReduceOp::kSum || op == ReduceOp::kAvg) {
                    double rest = 0.0;
                    for (int64_t k = 1; k < n; ++k) {
                        rest += term(k);
                    }
                    v = c == 0 ? (op == ReduceOp::kSum ? v - rest : static_cast<double>(n) * v - rest) : term(c);
                } else {
                    const int64_t exact = static_cast<int64_t>(Mix(key + 999) % static_cast<uint64_t>(n));
                    if (c != exact) {
                        v = op == ReduceOp::kMax ? v - offset(c) : v + offset(c);
                    }
                }
            });
            done.push_back(d);
        }
    }
    return shards;
}

/// Reduces every Partial mesh dim (all-reduce), so each rank then holds its shard of the global value.
inline Shards Resolve(const ProcessMesh &mesh, Shards shards, const Layout &layout) {
    for (const auto &[d, op] : layout.Partial()) {
        for (const auto &group : GroupsAlong(mesh, d)) {
            std::vector<Dense> parts;
            for (int64_t r : group) {
                parts.push_back(shards[r]);
            }
            const Dense reduced = Reduce(parts, op);
            for (int64_t r : group) {
                shards[r] = reduced;
            }
        }
    }
    return shards;
}

/// Executes one plan step on every rank's shard.
inline void Execute(const ProcessMesh &mesh, const RedistributeStep &step, Shards &shards) {
    const int d = step.mesh_dim;
    const int64_t n = mesh.DimSize(d);
    switch (step.collective) {
    case Collective::kLocalSlice:
        for (int64_t r = 0; r < mesh.Size(); ++r) {
            shards[r] = Chunk(shards[r], step.tensor_dim, n, mesh.CoordinateOfIndex(r)[d]);
        }
        return;
    case Collective::kLocalPartialize:
        // The value on coordinate 0, the op's identity elsewhere (sum 0, prod 1); avg, max and min keep it everywhere.
        for (int64_t r = 0; r < mesh.Size(); ++r) {
            if (mesh.CoordinateOfIndex(r)[d] == 0) {
                continue;
            }
            if (step.reduce_op == ReduceOp::kSum) {
                std::fill(shards[r].data.begin(), shards[r].data.end(), 0.0);
            } else if (step.reduce_op == ReduceOp::kProd) {
                std::fill(shards[r].data.begin(), shards[r].data.end(), 1.0);
            }
        }
        return;
    default:
        break;
    }
    for (const auto &group : GroupsAlong(mesh, d)) {
        std::vector<Dense> parts;
        for (int64_t r : group) {
            parts.push_back(shards[r]);
        }
        for (int64_t i = 0; i < n; ++i) {
            Dense &local = shards[group[i]];
            switch (step.collective) {
            case Collective::kAllReduce:
                local = Reduce(parts, step.reduce_op);
                break;
            case Collective::kAllGather:
                local = Concat(parts, step.tensor_dim);
                break;
            case Collective::kReduceScatter:
                local = Chunk(Reduce(parts, step.reduce_op), step.tensor_dim, n, i);
                break;
            case Collective::kAllToAll:
                local = Chunk(Concat(parts, step.tensor_dim), step.to_tensor_dim, n, i);
                break;
            default:
                break;
            }
        }
    }
}

/// True when every rank holds exactly its `layout` shard of `global` after resolving Partials.
inline ::testing::AssertionResult ShardsMatch(const ProcessMesh &mesh, const Shards &shards, const Dense &global,
                                              const Layout &layout, double tolerance = 1e-9) {
    const Shards resolved = Resolve(mesh, shards, layout);
    for (int64_t r = 0; r < mesh.Size(); ++r) {
        const LocalShard s = ComputeLocalShard(mesh, global.shape, layout, mesh.CoordinateOfIndex(r));
        const Dense want = Block(global, s.offset, s.shape);
        if (resolved[r].shape != want.shape) {
            return ::testing::AssertionFailure() << "rank " << r << " local shape " << ShapeToString(resolved[r].shape)
                                                 << " != " << ShapeToString(want.shape) << " for " << layout.ToString();
        }
        for (size_t i = 0; i < want.data.size(); ++i) {
            if (std::abs(resolved[r].data[i] - want.data[i]) > tolerance) {
                return ::testing::AssertionFailure() << "rank " << r << " element " << i << ": " << resolved[r].data[i]
                                                     << " != " << want.data[i] << " for " << layout.ToString();
            }
        }
    }
    return ::testing::AssertionSuccess();
}

/// Dense einsum: out[o] = combine over contracted labels of the product of the operands; a size-1 operand dim
/// broadcasts. `combine` sum multiplies operands; max/min (single operand reductions) take the extreme.
inline Dense DenseEinsum(const std::vector<std::string> &labels, const std::vector<Dense> &operands,
                         const std::string &out_labels, ReduceOp combine = ReduceOp::kSum) {
    std::map<char, int64_t> sizes;
    for (size_t i = 0; i < operands.size(); ++i) {
        for (size_t j = 0; j < labels[i].size(); ++j) {
            // A size-1 dim broadcasts; any other size (0 for an empty shard) is the label's size.
            auto it = sizes.find(labels[i][j]);
            if (it == sizes.end() || it->second == 1) {
                sizes[labels[i][j]] = operands[i].shape[j];
            }
        }
    }
    std::string all;
    for (const auto &[label, size] : sizes) {
        all.push_back(label);
    }
    std::vector<int64_t> all_shape;
    for (char c : all) {
        all_shape.push_back(sizes[c]);
    }
    std::vector<int64_t> out_shape;
    for (char c : out_labels) {
        if (sizes.count(c) == 0) {
            sizes[c] = 1; // an output-only label: a kept size-1 (broadcast) dim
            all.push_back(c);
            all_shape.push_back(1);
        }
        out_shape.push_back(sizes[c]);
    }
    Dense out(out_shape, 0.0);
    std::vector<bool> seen(out.data.size(), false);
    ForEachIndex(all_shape, [&](const std::vector<int64_t> &idx) {
        auto value_of = [&](char c) { return idx[all.find(c)]; };
        double v = 1.0;
        for (size_t i = 0; i < operands.size(); ++i) {
            std::vector<int64_t> oi;
            for (size_t j = 0; j < labels[i].size(); ++j) {
                oi.push_back(operands[i].shape[j] == 1 ? 0 : value_of(labels[i][j]));
            }
            v *= operands[i].At(oi);
        }
        std::vector<int64_t> o;
        for (char c : out_labels) {
            o.push_back(value_of(c));
        }
        const int64_t off = out.Offset(o);
        if (!seen[off]) {
            out.data[off] = v;
            seen[off] = true;
        } else {
            out.data[off] = Combine(combine == ReduceOp::kAvg ? ReduceOp::kSum : combine, out.data[off], v);
        }
    });
    return out;
}

/// A random layout of a tensor of `rank` dims on `mesh`: each mesh dim shards a random tensor dim (possibly
/// co-sharding, random order), stays Replicate, or (when allow_partial) is Partial with `partial_op`.
inline Layout RandomLayout(const ProcessMesh &mesh, int rank, std::mt19937 &rng, bool allow_partial,
                           ReduceOp partial_op = ReduceOp::kSum) {
    std::vector<std::vector<int>> dims(rank);
    std::map<int, ReduceOp> partial;
    std::vector<int> mesh_dims(mesh.NDim());
    std::iota(mesh_dims.begin(), mesh_dims.end(), 0);
    std::shuffle(mesh_dims.begin(), mesh_dims.end(), rng);
    std::uniform_int_distribution<int> choice(0, rank + 1);
    for (int d : mesh_dims) {
        const int c = choice(rng);
        if (c < rank) {
            dims[c].push_back(d);
        } else if (c == rank + 1 && allow_partial) {
            partial[d] = partial_op;
        }
    }
    return Layout(std::move(dims), std::move(partial));
}

/// A shape of `rank` dims, each of size 1 to `max_size`.
inline std::vector<int64_t> RandomShape(std::mt19937 &rng, int rank, int64_t max_size) {
    std::uniform_int_distribution<int64_t> size(1, max_size);
    std::vector<int64_t> shape(rank);
    for (auto &s : shape) {
        s = size(rng);
    }
    return shape;
}

inline ProcessMesh RandomMesh(std::mt19937 &rng) {
    std::uniform_int_distribution<int> ndim(1, 3);
    std::uniform_int_distribution<int64_t> size(1, 3);
    std::vector<int64_t> shape(ndim(rng));
    for (auto &s : shape) {
        s = size(rng);
    }
    return ProcessMesh(shape);
}

} // namespace shardline::spmd::testing
