#include "ops_util.h"

#include <fmt/format.h>

#include "../dist_internal.h"

namespace shardline::dist {

spmd::RuleCache &Rules() {
    static spmd::RuleCache cache;
    return cache;
}

std::shared_ptr<const spmd::CachedRule> LookupRule(std::string_view op, comm::DeviceMesh &mesh,
                                                   spmd::RuleRequest request) {
    request.mesh = detail::ProcessMeshOf(mesh);
    // The rule is a pure function of the request, identical on every rank: an error here fails every rank alike,
    // before any collective. A hit copies nothing more (RuleCache::GetOrInfer(RuleRequest)).
    return SHARDLINE_DIST_SPMD(op, Rules().GetOrInfer(std::move(request)));
}

DistTensor MoveToLayout(const DistTensor &t, const spmd::Layout &layout) { return detail::MoveTo(t, layout); }

bool SameLayout(comm::DeviceMesh &mesh, const spmd::Layout &a, const spmd::Layout &b) {
    if (a == b) {
        return true;
    }
    const spmd::ProcessMesh &pm = detail::ProcessMeshOf(mesh);
    return a.Canonical(pm) == b.Canonical(pm);
}

Tensor *GradSink::BufferFor(comm::DeviceMesh *mesh, const spmd::Layout &grad_layout) const {
    if (buffer == nullptr) {
        return nullptr;
    }
    return mesh == nullptr || SameLayout(*mesh, layout, grad_layout) ? buffer : nullptr;
}

void GradSink::Written() const {
    if (zero_pending != nullptr) {
        *zero_pending = false;
    }
}

void GradSink::Materialize() const {
    if (fresh()) {
        buffer->Fill(0.0);
        *zero_pending = false;
    }
}

namespace detail {

comm::DeviceMesh *CommonMesh(std::string_view op, std::initializer_list<const DistTensor *> tensors) {
    comm::DeviceMesh *mesh = nullptr;
    bool first = true;
    for (const DistTensor *t : tensors) {
        if (t == nullptr) {
            continue;
        }
        SHARDLINE_CHECK(t->defined(), op, "an operand is undefined");
        if (first) {
            mesh = t->mesh_ptr();
            first = false;
            continue;
        }
        SHARDLINE_CHECK(t->mesh_ptr() == mesh, op,
                        "every operand must be on the same mesh (or all local), got {} and an operand {}",
                        mesh == nullptr ? std::string("a local operand") : fmt::format("mesh {}", fmt::ptr(mesh)),
                        t->ToString());
    }
    return mesh;
}

DistTensor Prepare(const DistTensor &t, const spmd::TensorSpec &required, const spmd::RedistributePlan &plan) {
    if (t.is_local()) {
        return t;
    }
    if (plan.steps.empty()) {
        return DistTensor::FromTrustedShard(t.local(), t.global_shape(), required.layout, t.mesh_ptr());
    }
    return t.Redistribute(required.layout, plan);
}

DistTensor MoveTo(const DistTensor &t, const spmd::Layout &layout) {
    if (t.is_local() || dist::SameLayout(t.mesh(), t.layout(), layout)) {
        return t.is_local() ? t : DistTensor::FromTrustedShard(t.local(), t.global_shape(), layout, t.mesh_ptr());
    }
    return t.Redistribute(layout);
}

std::int64_t LocalOffset(const DistTensor &t, int dim) {
    if (t.is_local()) {
        return 0;
    }
    const spmd::LocalShard shard =
        spmd::ComputeLocalShard(ProcessMeshOf(t.mesh()), t.global_shape(), t.layout(), t.mesh().coordinate());
    return shard.offset[static_cast<std::size_t>(dim)];
}

} // namespace detail
} // namespace shardline::dist
