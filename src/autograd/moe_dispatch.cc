// Expert parallelism's token exchange and the MoE layer's bridges between mesh and local Variables
// (autograd/moe_dispatch.h). The exchange moves rows with the Communicator's all-to-all-v; the regroup between the
// source-rank-major order the all-to-all-v delivers and the expert-major order the grouped GEMMs need is a fixed copy
// of row blocks whose offsets are host-known from the plan.

#include <memory>
#include <numeric>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/autograd/function.h>
#include <shardline/autograd/moe_dispatch.h>
#include <shardline/core/error.h>

namespace shardline::autograd {
namespace {

using dist::DistTensor;
using dist::Grad;

constexpr const char *kExchange = "ExpertExchange";

std::int64_t Sum(const std::vector<std::int64_t> &v) { return std::accumulate(v.begin(), v.end(), std::int64_t{0}); }

std::vector<std::int64_t> Times(const std::vector<std::int64_t> &rows, std::int64_t h) {
    std::vector<std::int64_t> out(rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i) {
        out[i] = rows[i] * h;
    }
    return out;
}

/// Rows [first, first + count) of a contiguous [rows, h] tensor, as a view sharing its storage.
Tensor Rows(const Tensor &t, std::int64_t first, std::int64_t count, std::int64_t h) {
    auto *base = static_cast<char *>(t.data());
    return Tensor::FromBlob(base + first * h * static_cast<std::int64_t>(ElementSize(t.dtype())), Shape{count, h},
                            t.dtype(), t.device());
}

/// Copies the received rows between the source-rank-major order of the all-to-all-v (block (r, l): the rows ep rank r
/// sent for local expert l, blocks ordered by r then l) and the expert-major order of the experts (blocks ordered by l
/// then r). `to_expert_major` picks the direction; `from` and `to` are contiguous [received, h].
void Regroup(const ExpertExchangePlan &plan, const Tensor &from, const Tensor &to, bool to_expert_major) {
    const std::int64_t p = plan.ep_size;
    const std::int64_t le = plan.local_experts;
    const std::int64_t h = from.shape().back();
    // Offsets of block (r, l) in both orders.
    std::vector<std::int64_t> rank_major(static_cast<std::size_t>(p * le));
    std::vector<std::int64_t> expert_major(static_cast<std::size_t>(p * le));
    std::int64_t at = 0;
    for (std::int64_t r = 0; r < p; ++r) {
        for (std::int64_t l = 0; l < le; ++l) {
            rank_major[static_cast<std::size_t>(r * le + l)] = at;
            at += plan.recv_counts[static_cast<std::size_t>(r * le + l)];
        }
    }
    at = 0;
    for (std::int64_t l = 0; l < le; ++l) {
        for (std::int64_t r = 0; r < p; ++r) {
            expert_major[static_cast<std::size_t>(r * le + l)] = at;
            at += plan.recv_counts[static_cast<std::size_t>(r * le + l)];
        }
    }
    for (std::size_t b = 0; b < rank_major.size(); ++b) {
        const std::int64_t n = plan.recv_counts[b];
        if (n == 0) {
            continue;
        }
        const std::int64_t src = to_expert_major ? rank_major[b] : expert_major[b];
        const std::int64_t dst = to_expert_major ? expert_major[b] : rank_major[b];
        Tensor out = Rows(to, dst, n, h);
        out.CopyFrom(Rows(from, src, n, h));
    }
}

bool Exchanges(const ExpertExchangePlan &plan, comm::Communicator *ep) { return ep != nullptr && plan.ep_size > 1; }

/// rows [plan.sent(), h] → the local experts' rows [plan.expert_rows(), h], expert-major (the zero pad row when none
/// arrives).
Tensor DispatchRows(const Tensor &rows, const ExpertExchangePlan &plan, comm::Communicator *ep) {
    const std::int64_t h = rows.shape().back();
    Tensor received = rows;
    if (Exchanges(plan, ep)) {
        received = Tensor::Empty({plan.received(), h}, rows.dtype(), rows.device());
        ep->AllToAllV(rows, Times(plan.send_rows, h), received, Times(plan.recv_rows, h))->Wait();
    }
    if (plan.padded()) {
        return Tensor::Zeros({1, h}, rows.dtype(), rows.device());
    }
    if (!Exchanges(plan, ep)) {
        return rows;
    }
    Tensor grouped = Tensor::Empty({plan.received(), h}, rows.dtype(), rows.device());
    Regroup(plan, received, grouped, true);
    return grouped;
}

/// The inverse: the local experts' rows [plan.expert_rows(), h] → [plan.sent(), h] in Permute's order (the pad row
/// is dropped).
Tensor CombineRows(const Tensor &rows, const ExpertExchangePlan &plan, comm::Communicator *ep) {
    const std::int64_t h = rows.shape().back();
    Tensor by_rank = plan.padded() ? Tensor::Empty({0, h}, rows.dtype(), rows.device()) : rows;
    if (!Exchanges(plan, ep)) {
        return by_rank;
    }
    if (!plan.padded()) {
        by_rank = Tensor::Empty({plan.received(), h}, rows.dtype(), rows.device());
        Regroup(plan, rows, by_rank, false);
    }
    Tensor out = Tensor::Empty({plan.sent(), h}, rows.dtype(), rows.device());
    ep->AllToAllV(by_rank, Times(plan.recv_rows, h), out, Times(plan.send_rows, h))->Wait();
    return out;
}

/// ExpertDispatch (combine = false) and ExpertCombine (combine = true): each one's backward is the other's forward.
class ExpertExchangeFunction final : public Function {
public:
    ExpertExchangeFunction(ExpertExchangePlan plan, comm::Communicator *ep, bool combine)
        : plan_(std::move(plan)), ep_(ep), combine_(combine) {}
    std::string name() const override { return combine_ ? "ExpertCombineBackward" : "ExpertDispatchBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs &in) override {
        const Tensor x = in[0].local().Contiguous();
        return {DistTensor::Local(combine_ ? CombineRows(x, plan_, ep_) : DispatchRows(x, plan_, ep_))};
    }
    void SetupContext(const Inputs &, const std::vector<DistTensor> &) override {}
    std::vector<Grad> Backward(const std::vector<DistTensor> &g) override {
        std::vector<Grad> grads(1);
        if (g[0].defined()) {
            const Tensor dy = g[0].local().Contiguous();
            grads[0].value = DistTensor::Local(combine_ ? DispatchRows(dy, plan_, ep_) : CombineRows(dy, plan_, ep_));
        }
        return grads;
    }

private:
    ExpertExchangePlan plan_;
    comm::Communicator *ep_;
    bool combine_;
};

void CheckRows(const char *op, const Variable &x, std::int64_t rows) {
    SHARDLINE_CHECK(x.defined() && x.value().is_local(), op, "takes a local Variable (the permuted rows), got {}",
                    x.defined() ? x.value().ToString() : std::string("undefined"));
    SHARDLINE_CHECK_AS(ShapeError, x.shape().size() == 2 && x.shape()[0] == rows, op,
                       "the rows must be [{}, hidden] as the exchange plan says, got {}", rows,
                       ShapeToString(x.shape()));
}

/// LocalPart: a mesh Variable's local shard as a local Variable (viewed as `shape`); backward the reverse.
class LocalPartFunction final : public Function {
public:
    explicit LocalPartFunction(Shape shape) : shape_(std::move(shape)) {}
    std::string name() const override { return "LocalPartBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs &in) override {
        return {DistTensor::Local(in[0].local().Contiguous().View(shape_))};
    }
    void SetupContext(const Inputs &in, const std::vector<DistTensor> &) override {
        // The input's shapes, layout and mesh: its values are not read, so its memory is not kept.
        local_shape_ = in[0].local().shape();
        global_shape_ = in[0].global_shape();
        layout_ = in[0].layout();
        mesh_ = in[0].mesh_ptr();
    }
    std::vector<Grad> Backward(const std::vector<DistTensor> &g) override {
        std::vector<Grad> grads(1);
        if (g[0].defined()) {
            const Tensor d = g[0].local().Contiguous().View(local_shape_);
            grads[0].value = DistTensor::FromTrustedShard(d, global_shape_, layout_, mesh_);
        }
        return grads;
    }

private:
    Shape shape_;
    Shape local_shape_, global_shape_;
    spmd::Layout layout_;
    comm::DeviceMesh *mesh_ = nullptr;
};

/// AsShard: a local Variable as a mesh DistTensor's shard; backward the reverse.
class AsShardFunction final : public Function {
public:
    AsShardFunction(Shape local_shape, Shape global_shape, spmd::Layout layout, comm::DeviceMesh &mesh)
        : local_shape_(std::move(local_shape)), global_shape_(std::move(global_shape)), layout_(std::move(layout)),
          mesh_(mesh) {}
    std::string name() const override { return "AsShardBackward"; }

protected:
    std::vector<DistTensor> Forward(const Inputs &in) override {
        input_shape_ = in[0].local().shape();
        return {DistTensor::FromTrustedShard(in[0].local().Contiguous().View(local_shape_), global_shape_, layout_,
                                             &mesh_)};
    }
    void SetupContext(const Inputs &, const std::vector<DistTensor> &) override {}
    std::vector<Grad> Backward(const std::vector<DistTensor> &g) override {
        std::vector<Grad> grads(1);
        if (g[0].defined()) {
            const DistTensor d = dist::MoveToLayout(g[0], layout_.WithoutPartial());
            grads[0].value = DistTensor::Local(d.local().Contiguous().View(input_shape_));
        }
        return grads;
    }

private:
    Shape local_shape_;
    Shape global_shape_;
    spmd::Layout layout_;
    comm::DeviceMesh &mesh_;
    Shape input_shape_;
};

} // namespace

std::int64_t ExpertExchangePlan::sent() const { return Sum(send_rows); }
std::int64_t ExpertExchangePlan::received() const { return Sum(recv_rows); }
bool ExpertExchangePlan::padded() const { return received() == 0; }
std::int64_t ExpertExchangePlan::expert_rows() const { return padded() ? 1 : received(); }
std::vector<std::int64_t> ExpertExchangePlan::expert_group_sizes() const {
    std::vector<std::int64_t> sizes = local_group_sizes;
    if (padded()) {
        sizes.front() = 1;
    }
    return sizes;
}

ExpertExchangePlan PlanExpertExchange(const std::vector<std::int64_t> &group_sizes, comm::Communicator *ep) {
    const int p = ep != nullptr ? ep->size() : 1;
    const auto e = static_cast<std::int64_t>(group_sizes.size());
    SHARDLINE_CHECK(e > 0 && e % p == 0, kExchange,
                    "the number of experts ({}) must be positive and divisible by the expert-parallel size ({})", e, p);
    for (std::int64_t s : group_sizes) {
        SHARDLINE_CHECK(s >= 0, kExchange, "the per-expert row counts must be >= 0, got [{}]",
                        fmt::join(group_sizes, ", "));
    }
    ExpertExchangePlan plan;
    plan.ep_size = p;
    plan.num_experts = e;
    plan.local_experts = e / p;
    const std::int64_t le = plan.local_experts;
    plan.send_rows.assign(static_cast<std::size_t>(p), 0);
    for (std::int64_t x = 0; x < e; ++x) {
        plan.send_rows[static_cast<std::size_t>(x / le)] += group_sizes[static_cast<std::size_t>(x)];
    }
    if (p == 1) {
        plan.recv_rows = plan.send_rows;
        plan.recv_counts = group_sizes;
        plan.local_group_sizes = group_sizes;
        return plan;
    }
    // Block r of the counts (rank r's experts) goes to rank r; block r of the answer is what rank r sends this rank.
    const Device device = ep->device();
    const Tensor send =
        Tensor::FromVector(std::vector<double>(group_sizes.begin(), group_sizes.end()), Shape{e}, DType::kInt64)
            .To(device);
    Tensor recv = Tensor::Empty({e}, DType::kInt64, device);
    ep->AllToAll(send, recv)->Wait();
    const Tensor host = recv.To(Device::CPU());
    const auto *counts = host.data_as<std::int64_t>();
    plan.recv_counts.assign(counts, counts + e);
    plan.recv_rows.assign(static_cast<std::size_t>(p), 0);
    plan.local_group_sizes.assign(static_cast<std::size_t>(le), 0);
    for (std::int64_t r = 0; r < p; ++r) {
        for (std::int64_t l = 0; l < le; ++l) {
            const std::int64_t n = plan.recv_counts[static_cast<std::size_t>(r * le + l)];
            plan.recv_rows[static_cast<std::size_t>(r)] += n;
            plan.local_group_sizes[static_cast<std::size_t>(l)] += n;
        }
    }
    return plan;
}

Variable ExpertDispatch(const Variable &tokens, const ExpertExchangePlan &plan, comm::Communicator *ep) {
    CheckRows("ExpertDispatch", tokens, plan.sent());
    if (!Exchanges(plan, ep) && !plan.padded()) {
        return tokens;
    }
    return Function::Apply(std::make_shared<ExpertExchangeFunction>(plan, ep, false), {tokens}).at(0);
}

Variable ExpertCombine(const Variable &expert_rows, const ExpertExchangePlan &plan, comm::Communicator *ep) {
    CheckRows("ExpertCombine", expert_rows, plan.expert_rows());
    if (!Exchanges(plan, ep) && !plan.padded()) {
        return expert_rows;
    }
    return Function::Apply(std::make_shared<ExpertExchangeFunction>(plan, ep, true), {expert_rows}).at(0);
}

Variable LocalPart(const Variable &x, const Shape &local_shape) {
    SHARDLINE_CHECK(x.defined() && !x.value().is_local(), "LocalPart", "takes a Variable on a mesh, got {}",
                    x.defined() ? x.value().ToString() : std::string("undefined"));
    SHARDLINE_CHECK(!x.value().layout().IsPartial(), "LocalPart", "x must not be Partial, got {}",
                    x.value().ToString());
    SHARDLINE_CHECK_AS(ShapeError, Numel(local_shape) == x.local().numel(), "LocalPart",
                       "the local shape {} must hold x's local {} elements ({})", ShapeToString(local_shape),
                       x.local().numel(), x.value().ToString());
    return Function::Apply(std::make_shared<LocalPartFunction>(local_shape), {x}).at(0);
}

Variable AsShard(const Variable &local, const Shape &local_shape, const Shape &global_shape, const spmd::Layout &layout,
                 comm::DeviceMesh &mesh) {
    SHARDLINE_CHECK(local.defined() && local.value().is_local(), "AsShard", "takes a local Variable, got {}",
                    local.defined() ? local.value().ToString() : std::string("undefined"));
    SHARDLINE_CHECK_AS(ShapeError, Numel(local_shape) == local.local().numel(), "AsShard",
                       "the local shape {} must hold the {} elements of {}", ShapeToString(local_shape),
                       local.local().numel(), local.value().ToString());
    return Function::Apply(std::make_shared<AsShardFunction>(local_shape, global_shape, layout, mesh), {local}).at(0);
}

} // namespace shardline::autograd
