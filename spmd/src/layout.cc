#include <algorithm>
#include <cctype>
#include <iterator>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/limits.h>

namespace shardline::spmd {

std::string_view ToString(ReduceOp op) {
    switch (op) {
    case ReduceOp::kSum:
        return "sum";
    case ReduceOp::kAvg:
        return "avg";
    case ReduceOp::kMax:
        return "max";
    case ReduceOp::kMin:
        return "min";
    case ReduceOp::kProd:
        return "prod";
    }
    return "?";
}

bool PartialsCommute(ReduceOp a, ReduceOp b) {
    auto linear = [](ReduceOp op) { return op == ReduceOp::kSum || op == ReduceOp::kAvg; };
    return a == b || (linear(a) && linear(b));
}

ReduceOp ParseReduceOp(std::string_view text) {
    if (text == "sum") {
        return ReduceOp::kSum;
    }
    if (text == "avg" || text == "mean") {
        return ReduceOp::kAvg;
    }
    if (text == "max") {
        return ReduceOp::kMax;
    }
    if (text == "min") {
        return ReduceOp::kMin;
    }
    if (text == "prod") {
        return ReduceOp::kProd;
    }
    throw SpmdError(fmt::format("reduce op: expected one of sum, avg, max, min, prod, got '{}'", text));
}

std::string Placement::ToString() const {
    switch (kind) {
    case Kind::kReplicate:
        return "R";
    case Kind::kShard:
        return order < 0 ? fmt::format("S({})", tensor_dim) : fmt::format("S({})[{}]", tensor_dim, order);
    case Kind::kPartial:
        return fmt::format("P({})", spmd::ToString(reduce_op));
    }
    return "?";
}

namespace {

std::string Strip(std::string_view text) {
    std::string out;
    for (char c : text) {
        if (!std::isspace(static_cast<unsigned char>(c))) {
            out.push_back(c);
        }
    }
    return out;
}

int ParseInt(std::string_view text, std::string_view what) {
    if (text.empty()) {
        throw SpmdError(fmt::format("{}: expected an integer, got ''", what));
    }
    size_t i = 0;
    bool negative = false;
    if (text[0] == '-') {
        negative = true;
        i = 1;
    }
    if (i == text.size()) {
        throw SpmdError(fmt::format("{}: expected an integer, got '{}'", what, text));
    }
    int value = 0;
    for (; i < text.size(); ++i) {
        if (!std::isdigit(static_cast<unsigned char>(text[i])) || value > 100000000) {
            throw SpmdError(fmt::format("{}: expected an integer, got '{}'", what, text));
        }
        value = value * 10 + (text[i] - '0');
    }
    return negative ? -value : value;
}

} // namespace

Placement Placement::Parse(std::string_view raw) {
    const std::string text = Strip(raw);
    if (text == "R") {
        return Replicate();
    }
    if (text.size() >= 4 && text[0] == 'P' && text[1] == '(' && text.back() == ')') {
        return Partial(ParseReduceOp(std::string_view(text).substr(2, text.size() - 3)));
    }
    if (text == "P") {
        return Partial(ReduceOp::kSum);
    }
    if (text.size() >= 4 && text[0] == 'S' && text[1] == '(') {
        const size_t close = text.find(')');
        if (close != std::string::npos) {
            const int dim = ParseInt(std::string_view(text).substr(2, close - 2), "placement");
            if (close + 1 == text.size()) {
                if (dim < 0) {
                    throw SpmdError(fmt::format("placement: tensor dim must be >= 0, got '{}'", text));
                }
                return Shard(dim);
            }
            if (text[close + 1] == '[' && text.back() == ']') {
                const int order =
                    ParseInt(std::string_view(text).substr(close + 2, text.size() - close - 3), "placement order");
                if (dim < 0 || order < 0) {
                    throw SpmdError(fmt::format("placement: tensor dim and order must be >= 0, got '{}'", text));
                }
                return Shard(dim, order);
            }
        }
    }
    throw SpmdError(fmt::format("placement: expected R, S(d), S(d)[order] or P(sum|avg|max|min|prod), got '{}'", raw));
}

Layout::Layout(std::vector<std::vector<int>> dim_mesh_dims, std::map<int, ReduceOp> partial)
    : dims_(std::move(dim_mesh_dims)), partial_(std::move(partial)) {
    std::set<int> seen;
    for (size_t t = 0; t < dims_.size(); ++t) {
        for (int d : dims_[t]) {
            if (d < 0) {
                throw SpmdError(fmt::format("Layout: mesh dim must be >= 0, got {} for tensor dim {}", d, t));
            }
            if (!seen.insert(d).second) {
                throw SpmdError(
                    fmt::format("Layout: mesh dim {} is used twice (each mesh dim shards at most one tensor "
                                "dim once), in {}",
                                d, fmt::format("[{}]", fmt::join(dims_[t], ","))));
            }
        }
    }
    for (const auto &[d, op] : partial_) {
        if (d < 0) {
            throw SpmdError(fmt::format("Layout: partial mesh dim must be >= 0, got {}", d));
        }
        if (!seen.insert(d).second) {
            throw SpmdError(fmt::format("Layout: mesh dim {} is both sharding and partial", d));
        }
    }
}

Layout Layout::Replicated(int tensor_rank) { return Layout(std::vector<std::vector<int>>(tensor_rank)); }

Layout Layout::FromDimsMapping(const std::vector<int> &dims_mapping, std::map<int, ReduceOp> partial) {
    std::vector<std::vector<int>> dims(dims_mapping.size());
    for (size_t t = 0; t < dims_mapping.size(); ++t) {
        if (dims_mapping[t] < -1) {
            throw SpmdError(fmt::format(
                "Layout: dims_mapping entries must be -1 or a mesh dim, got {} at tensor dim {}", dims_mapping[t], t));
        }
        if (dims_mapping[t] >= 0) {
            dims[t].push_back(dims_mapping[t]);
        }
    }
    return Layout(std::move(dims), std::move(partial));
}

Layout Layout::FromPlacements(const std::vector<Placement> &placements, int tensor_rank) {
    // Per tensor dim: (order, mesh dim) pairs; explicit orders must all be given or all omitted.
    std::vector<std::vector<std::pair<int, int>>> by_dim(tensor_rank);
    std::map<int, ReduceOp> partial;
    for (size_t d = 0; d < placements.size(); ++d) {
        const Placement &p = placements[d];
        if (p.kind == Placement::Kind::kShard) {
            if (p.tensor_dim < 0 || p.tensor_dim >= tensor_rank) {
                throw SpmdError(fmt::format("Layout: placement {} on mesh dim {} names tensor dim {}, out of range for "
                                            "a tensor of rank {}",
                                            p.ToString(), d, p.tensor_dim, tensor_rank));
            }
            by_dim[p.tensor_dim].emplace_back(p.order, static_cast<int>(d));
        } else if (p.kind == Placement::Kind::kPartial) {
            partial[static_cast<int>(d)] = p.reduce_op;
        }
    }
    std::vector<std::vector<int>> dims(tensor_rank);
    for (int t = 0; t < tensor_rank; ++t) {
        auto &entries = by_dim[t];
        const bool explicit_order = std::any_of(entries.begin(), entries.end(), [](auto &e) { return e.first >= 0; });
        if (explicit_order) {
            std::vector<int> orders;
            for (auto &[order, d] : entries) {
                orders.push_back(order);
            }
            std::sort(orders.begin(), orders.end());
            for (size_t i = 0; i < orders.size(); ++i) {
                if (orders[i] != static_cast<int>(i)) {
                    throw SpmdError(fmt::format("Layout: the co-shard orders of tensor dim {} must be 0..{} (all given "
                                                "or all omitted), got [{}]",
                                                t, entries.size() - 1, fmt::join(orders, ",")));
                }
            }
            std::sort(entries.begin(), entries.end());
        }
        for (auto &[order, d] : entries) {
            dims[t].push_back(d);
        }
    }
    return Layout(std::move(dims), std::move(partial));
}

namespace {

struct TextParser {
    std::string text;
    size_t pos = 0;

    [[noreturn]] void Fail(std::string_view expected) const {
        throw SpmdError(fmt::format("Layout: cannot parse '{}': expected {} at position {}", text, expected, pos));
    }
    bool Peek(char c) const { return pos < text.size() && text[pos] == c; }
    void Expect(char c) {
        if (!Peek(c)) {
            Fail(fmt::format("'{}'", c));
        }
        ++pos;
    }
    int Int() {
        const size_t start = pos;
        if (Peek('-')) {
            ++pos;
        }
        while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) {
            ++pos;
        }
        if (pos == start) {
            Fail("an integer");
        }
        return ParseInt(std::string_view(text).substr(start, pos - start), "Layout");
    }
};

} // namespace

Layout Layout::Parse(std::string_view raw) {
    TextParser p{Strip(raw)};
    std::vector<std::vector<int>> dims;
    p.Expect('[');
    if (!p.Peek(']')) {
        while (true) {
            std::vector<int> entry;
            if (p.Peek('[')) {
                ++p.pos;
                if (!p.Peek(']')) {
                    while (true) {
                        entry.push_back(p.Int());
                        if (p.Peek(',')) {
                            ++p.pos;
                            continue;
                        }
                        break;
                    }
                }
                p.Expect(']');
            } else {
                const int d = p.Int();
                if (d < -1) {
                    p.Fail("-1 or a mesh dim");
                }
                if (d >= 0) {
                    entry.push_back(d);
                }
            }
            dims.push_back(std::move(entry));
            if (p.Peek(',')) {
                ++p.pos;
                continue;
            }
            break;
        }
    }
    p.Expect(']');
    std::map<int, ReduceOp> partial;
    const std::string_view kPartial = "partial{";
    if (p.pos < p.text.size()) {
        if (p.text.compare(p.pos, kPartial.size(), kPartial) != 0) {
            p.Fail("'partial{'");
        }
        p.pos += kPartial.size();
        if (!p.Peek('}')) {
            while (true) {
                const int d = p.Int();
                ReduceOp op = ReduceOp::kSum;
                if (p.Peek(':')) {
                    ++p.pos;
                    const size_t start = p.pos;
                    while (p.pos < p.text.size() && std::isalpha(static_cast<unsigned char>(p.text[p.pos]))) {
                        ++p.pos;
                    }
                    op = ParseReduceOp(std::string_view(p.text).substr(start, p.pos - start));
                }
                if (!partial.emplace(d, op).second) {
                    p.Fail("each partial mesh dim once");
                }
                if (p.Peek(',')) {
                    ++p.pos;
                    continue;
                }
                break;
            }
        }
        p.Expect('}');
        if (p.pos != p.text.size()) {
            p.Fail("the end of the text");
        }
    }
    return Layout(std::move(dims), std::move(partial));
}

bool Layout::IsReplicated() const {
    return partial_.empty() && std::all_of(dims_.begin(), dims_.end(), [](const auto &v) { return v.empty(); });
}

int Layout::TensorDimOf(int mesh_dim) const {
    for (size_t t = 0; t < dims_.size(); ++t) {
        if (std::find(dims_[t].begin(), dims_[t].end(), mesh_dim) != dims_[t].end()) {
            return static_cast<int>(t);
        }
    }
    return -1;
}

std::vector<int> Layout::UsedMeshDims() const {
    std::vector<int> used;
    for (const auto &v : dims_) {
        used.insert(used.end(), v.begin(), v.end());
    }
    for (const auto &[d, op] : partial_) {
        used.push_back(d);
    }
    std::sort(used.begin(), used.end());
    return used;
}

bool Layout::HasCoShard() const {
    return std::any_of(dims_.begin(), dims_.end(), [](const auto &v) { return v.size() > 1; });
}

std::vector<int> Layout::DimsMapping() const {
    std::vector<int> mapping;
    for (size_t t = 0; t < dims_.size(); ++t) {
        if (dims_[t].size() > 1) {
            throw SpmdError(fmt::format("Layout: tensor dim {} is co-sharded by mesh dims [{}]; a flat dims_mapping "
                                        "cannot express it",
                                        t, fmt::join(dims_[t], ",")));
        }
        mapping.push_back(dims_[t].empty() ? -1 : dims_[t][0]);
    }
    return mapping;
}

std::vector<Placement> Layout::ToPlacements(int mesh_ndim) const {
    for (int d : UsedMeshDims()) {
        if (d >= mesh_ndim) {
            throw SpmdError(
                fmt::format("Layout {}: mesh dim {} out of range for a mesh of {} dims", ToString(), d, mesh_ndim));
        }
    }
    std::vector<Placement> placements(mesh_ndim);
    for (size_t t = 0; t < dims_.size(); ++t) {
        const bool ascending = std::is_sorted(dims_[t].begin(), dims_[t].end());
        for (size_t i = 0; i < dims_[t].size(); ++i) {
            placements[dims_[t][i]] = Placement::Shard(static_cast<int>(t), ascending ? -1 : static_cast<int>(i));
        }
    }
    for (const auto &[d, op] : partial_) {
        placements[d] = Placement::Partial(op);
    }
    return placements;
}

void Layout::Validate(const ProcessMesh &mesh, int tensor_rank, std::string_view what) const {
    if (TensorRank() != tensor_rank) {
        throw SpmdError(fmt::format("{}: layout {} has {} dims, but the tensor has rank {}", what, ToString(),
                                    TensorRank(), tensor_rank));
    }
    for (int d : UsedMeshDims()) {
        if (d >= mesh.NDim()) {
            throw SpmdError(fmt::format("{}: layout {} uses mesh dim {}, out of range for a mesh of {} dims", what,
                                        ToString(), d, mesh.NDim()));
        }
    }
    // A tensor Partial in two ops that do not commute has no single value: which reduction comes first changes it
    // (max_i sum_j != sum_j max_i). Nothing can reduce it exactly, so it is refused wherever a layout enters.
    // (A size-1 mesh dim reduces one term: it never matters.)
    for (auto a = partial_.begin(); a != partial_.end(); ++a) {
        for (auto b = std::next(a); b != partial_.end(); ++b) {
            if (mesh.DimSize(a->first) > 1 && mesh.DimSize(b->first) > 1 && !PartialsCommute(a->second, b->second)) {
                throw SpmdError(fmt::format(
                    "{}: layout {} is Partial with {} on mesh dim {} and {} on mesh dim {}, which "
                    "do not commute (only sum with avg, or one of max, min, prod alone): the "
                    "order of the reductions would change the value",
                    what, ToString(), spmd::ToString(a->second), a->first, spmd::ToString(b->second), b->first));
            }
        }
    }
}

Layout Layout::Canonical(const ProcessMesh &mesh) const {
    std::vector<std::vector<int>> dims(dims_.size());
    for (size_t t = 0; t < dims_.size(); ++t) {
        for (int d : dims_[t]) {
            if (d >= mesh.NDim() || mesh.DimSize(d) > 1) {
                dims[t].push_back(d);
            }
        }
    }
    std::map<int, ReduceOp> partial;
    for (const auto &[d, op] : partial_) {
        if (d >= mesh.NDim() || mesh.DimSize(d) > 1) {
            partial[d] = op;
        }
    }
    return Layout(std::move(dims), std::move(partial));
}

std::string Layout::ToString() const {
    std::vector<std::string> entries;
    for (const auto &v : dims_) {
        if (v.empty()) {
            entries.push_back("-1");
        } else if (v.size() == 1) {
            entries.push_back(std::to_string(v[0]));
        } else {
            entries.push_back(fmt::format("[{}]", fmt::join(v, ",")));
        }
    }
    std::string out = fmt::format("[{}]", fmt::join(entries, ","));
    if (!partial_.empty()) {
        std::vector<std::string> parts;
        for (const auto &[d, op] : partial_) {
            parts.push_back(op == ReduceOp::kSum ? std::to_string(d) : fmt::format("{}:{}", d, spmd::ToString(op)));
        }
        out += fmt::format(" partial{{{}}}", fmt::join(parts, ","));
    }
    return out;
}

std::pair<int64_t, int64_t> ChunkRange(int64_t size, int64_t parts, int64_t index) {
    if (size < 0 || parts < 1 || index < 0 || index >= parts) {
        throw SpmdError(fmt::format("ChunkRange: expected size >= 0, parts >= 1 and 0 <= index < parts, got size {}, "
                                    "parts {}, index {}",
                                    size, parts, index));
    }
    // Written so that nothing overflows for any int64 inputs: chunk * i is only formed when it is <= size.
    const int64_t chunk = size / parts + (size % parts != 0 ? 1 : 0);
    auto position = [&](int64_t i) { return chunk == 0 || i > size / chunk ? size : std::min(size, chunk * i); };
    const int64_t begin = position(index);
    return {begin, position(index + 1) - begin};
}

LocalShard ComputeLocalShard(const ProcessMesh &mesh, const std::vector<int64_t> &global_shape, const Layout &layout,
                             const std::vector<int64_t> &coord) {
    layout.Validate(mesh, static_cast<int>(global_shape.size()), "ComputeLocalShard");
    if (static_cast<int>(coord.size()) != mesh.NDim()) {
        throw SpmdError(
            fmt::format("ComputeLocalShard: coordinate [{}] must have {} entries", fmt::join(coord, ","), mesh.NDim()));
    }
    LocalShard shard{global_shape, std::vector<int64_t>(global_shape.size(), 0)};
    for (size_t t = 0; t < global_shape.size(); ++t) {
        for (int d : layout.MeshDims(static_cast<int>(t))) {
            auto [begin, length] = ChunkRange(shard.shape[t], mesh.DimSize(d), coord[d]);
            shard.offset[t] += begin;
            shard.shape[t] = length;
        }
    }
    return shard;
}

LocalShard ComputeLocalShardOfProcess(const ProcessMesh &mesh, const std::vector<int64_t> &global_shape,
                                      const Layout &layout, int64_t process_id) {
    return ComputeLocalShard(mesh, global_shape, layout, mesh.CoordinateOf(process_id));
}

std::vector<int64_t> MaxLocalShape(const ProcessMesh &mesh, const std::vector<int64_t> &global_shape,
                                   const Layout &layout) {
    return ComputeLocalShard(mesh, global_shape, layout, std::vector<int64_t>(mesh.NDim(), 0)).shape;
}

std::string ShapeToString(const std::vector<int64_t> &shape) { return fmt::format("[{}]", fmt::join(shape, ",")); }

} // namespace shardline::spmd
