#include <algorithm>

#include <fmt/format.h>

#include <shardline/comm/communicator.h>
#include <shardline/core/error.h>
#include <shardline/nn/grad_sync.h>

namespace shardline::nn {

struct GradSync::State {
    struct Bucket {
        Tensor buffer; ///< flat fp32
        std::vector<autograd::Variable> params;
        std::vector<int> dims; ///< the data-parallel mesh dims it reduces over (those of more than one rank)
        int ready = 0;
        bool launched = false;
        comm::WorkHandle work;
    };
    comm::DeviceMesh *mesh = nullptr;
    bool enabled = true;
    std::vector<Bucket> buckets;

    void Launch(Bucket &b) {
        // Over one rank the sum is the bucket itself: no collective (the grads are complete as they are).
        if (b.launched || b.dims.empty()) {
            return;
        }
        b.launched = true;
        for (auto &p : b.params) {
            p.grad(); // a main grad whose zeroing is still pending (it got no gradient) becomes zeros
        }
        // Two dims (dp and ep): the second all-reduce must follow the first on the same buffer.
        for (std::size_t i = 0; i < b.dims.size(); ++i) {
            if (b.work) {
                b.work->Wait();
            }
            b.work = mesh->group(b.dims[i]).AllReduce(b.buffer, comm::ReduceOp::kSum);
        }
    }
    void OnReady(std::size_t bucket) {
        if (!enabled) {
            return;
        }
        Bucket &b = buckets[bucket];
        if (++b.ready == static_cast<int>(b.params.size())) {
            Launch(b);
        }
    }
};

GradSync::GradSync(std::vector<autograd::Variable> parameters, comm::DeviceMesh &mesh, const GradSyncOptions &options)
    : state_(std::make_shared<State>()) {
    constexpr const char *kOp = "GradSync";
    state_->mesh = &mesh;
    std::vector<int> dp_dims;
    for (const std::string &name :
         options.dp_dims.empty() ? std::vector<std::string>{options.dp_dim} : options.dp_dims) {
        const int d = mesh.dim_index(name);
        SHARDLINE_CHECK(std::find(dp_dims.begin(), dp_dims.end(), d) == dp_dims.end(), kOp,
                        "data-parallel dim '{}' is named twice", name);
        dp_dims.push_back(d);
    }
    SHARDLINE_CHECK(options.bucket_bytes > 0, kOp, "bucket_bytes must be positive, got {}", options.bucket_bytes);
    // A parameter reduces over the data-parallel dims that shard none of its dims (an expert parameter is sharded over
    // ep: its other ep ranks hold other experts).
    // A parameter's extra data-parallel dims (options.extra_dp_dims), by its variable.
    std::vector<std::pair<const autograd::VariableImpl *, std::vector<int>>> extra;
    for (const auto &[p, names] : options.extra_dp_dims) {
        SHARDLINE_CHECK(p.defined(), kOp, "extra_dp_dims names an undefined parameter");
        std::vector<int> dims;
        for (const std::string &name : names) {
            dims.push_back(mesh.dim_index(name));
        }
        extra.emplace_back(p.impl().get(), std::move(dims));
    }
    auto reduce_dims = [&](const autograd::Variable &p) {
        std::vector<int> candidates = dp_dims;
        for (const auto &[impl, dims] : extra) {
            if (impl == p.impl().get()) {
                candidates.insert(candidates.end(), dims.begin(), dims.end());
            }
        }
        std::vector<int> dims;
        const std::vector<int> used = p.value().layout().UsedMeshDims();
        for (int d : candidates) {
            if (std::find(used.begin(), used.end(), d) == used.end() &&
                std::find(dims.begin(), dims.end(), d) == dims.end()) {
                dims.push_back(d);
            }
        }
        return dims;
    };
    // Reverse registration order: the order in which backward completes the gradients.
    std::reverse(parameters.begin(), parameters.end());
    std::vector<std::vector<autograd::Variable>> groups;
    std::vector<std::vector<int>> group_dims;
    std::int64_t bytes = 0;
    Device device;
    for (auto &p : parameters) {
        SHARDLINE_CHECK(p.defined() && p.is_leaf() && !p.value().is_local() && &p.value().mesh() == &mesh, kOp,
                        "parameter '{}' must be a leaf on the GradSync's mesh", p.defined() ? p.name() : "undefined");
        SHARDLINE_CHECK(!p.value().layout().IsPartial(), kOp, "parameter '{}' must not be Partial, got {}", p.name(),
                        p.value().ToString());
        const std::int64_t b = p.local().numel() * 4;
        const std::vector<int> dims = reduce_dims(p);
        if (groups.empty() || bytes + b > options.bucket_bytes || p.device() != device || dims != group_dims.back()) {
            if (groups.empty() || !groups.back().empty()) {
                groups.emplace_back();
                group_dims.emplace_back();
            }
            bytes = 0;
            device = p.device();
            group_dims.back() = dims;
        }
        groups.back().push_back(p);
        bytes += b;
    }
    for (std::size_t g = 0; g < groups.size(); ++g) {
        auto &group = groups[g];
        State::Bucket bucket;
        bucket.dims = group_dims[g];
        // Each main grad starts on a 256-byte boundary, as a fresh allocation would: the GEMMs that write them
        // (cuBLASLt plans are chosen for aligned pointers) and the vectorised kernels need 16 bytes, and a parameter of
        // an odd size (a vocab-parallel head of 43 rows) would otherwise misalign every one after it (measured on
        // 4×H200: cudaErrorMisalignedAddress at dp 2 × tp 2 with 86 classes). The padding is zeros and is reduced with
        // the rest.
        constexpr std::int64_t kAlignElements = 256 / 4;
        const auto aligned = [](std::int64_t n) { return (n + kAlignElements - 1) / kAlignElements * kAlignElements; };
        std::int64_t total = 0;
        for (auto &p : group) {
            total = aligned(total) + p.local().numel();
        }
        bucket.buffer = Tensor::Zeros({total}, DType::kFloat32, group.front().device());
        std::int64_t at = 0;
        for (auto &p : group) {
            at = aligned(at);
            // The main grad is a view into the bucket, so the bucket's one all-reduce reduces every gradient in it.
            void *data = static_cast<char *>(bucket.buffer.data()) + at * 4;
            p.set_deferred_partial(bucket.dims);
            p.AllocateMainGrad(DType::kFloat32, Tensor::FromBlob(data, p.local().shape(), DType::kFloat32, p.device()));
            at += p.local().numel();
        }
        bucket.params = group;
        // Dims of one rank reduce nothing: no collective over them.
        std::erase_if(bucket.dims, [&](int d) { return mesh.shape()[static_cast<std::size_t>(d)] == 1; });
        state_->buckets.push_back(std::move(bucket));
    }
    for (std::size_t i = 0; i < state_->buckets.size(); ++i) {
        for (auto &p : state_->buckets[i].params) {
            std::weak_ptr<State> weak = state_;
            p.AddPostAccumulateHook([weak, i](autograd::Variable &) {
                if (auto s = weak.lock()) {
                    s->OnReady(i);
                }
            });
        }
    }
}

GradSync::~GradSync() {
    // Parameters outlive the buckets: give each its own copy of its main grad (it was a view into a bucket).
    for (auto &b : state_->buckets) {
        for (auto &p : b.params) {
            if (p.impl() == nullptr) {
                continue;
            }
            try {
                const dist::DistTensor g = p.grad();
                Tensor own = p.impl()->main_grad.Clone();
                p.impl()->main_grad = own;
                p.impl()->grad = dist::DistTensor::FromTrustedShard(own, g.global_shape(), g.layout(), g.mesh_ptr());
            } catch (...) {
            }
        }
    }
}

void GradSync::Finish() {
    for (auto &b : state_->buckets) {
        state_->Launch(b);
    }
    for (auto &b : state_->buckets) {
        if (b.work) {
            b.work->Wait();
            b.work.reset();
        }
        b.launched = false;
        b.ready = 0;
        for (auto &p : b.params) {
            const dist::DistTensor &v = p.value();
            p.impl()->grad = dist::DistTensor::FromTrustedShard(p.impl()->main_grad, v.global_shape(),
                                                                v.layout().WithoutPartial(), v.mesh_ptr());
        }
    }
}

void GradSync::ZeroGrad() {
    for (auto &b : state_->buckets) {
        SHARDLINE_CHECK(!b.work, "GradSync::ZeroGrad", "a bucket's all-reduce is in flight: call Finish first");
        b.ready = 0;
        b.launched = false;
        for (auto &p : b.params) {
            p.ZeroGrad();
        }
    }
}

void GradSync::set_enabled(bool enabled) { state_->enabled = enabled; }
int GradSync::num_buckets() const { return static_cast<int>(state_->buckets.size()); }

std::vector<std::vector<int>> GradSync::BucketDims() const {
    std::vector<std::vector<int>> out;
    for (auto &b : state_->buckets) {
        out.push_back(b.dims);
    }
    return out;
}

std::vector<std::vector<std::string>> GradSync::BucketNames() const {
    std::vector<std::vector<std::string>> out;
    for (auto &b : state_->buckets) {
        out.emplace_back();
        for (auto &p : b.params) {
            out.back().push_back(p.name());
        }
    }
    return out;
}

} // namespace shardline::nn
