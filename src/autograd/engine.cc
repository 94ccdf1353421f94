// The backward engine: dependency counts over the graph reachable from the roots, then a ready queue, so every node
// runs once, after all of its gradients have arrived (torch's engine, single-threaded).

#include <algorithm>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include <shardline/autograd/engine.h>
#include <shardline/core/error.h>
#include <shardline/core/per_thread.h>
#include <shardline/dist/ops.h>

#include "accumulate_grad.h"
#include "engine_internal.h"

namespace shardline::autograd {
namespace {

thread_local bool grad_enabled = true;

/// Ones in the root's layout without Partial: d root / d root, for every local element.
dist::DistTensor Ones(const dist::DistTensor &root) {
    Tensor ones = Tensor::Full(root.local().shape(), 1.0, root.dtype(), root.device());
    if (root.is_local()) {
        return dist::DistTensor::Local(std::move(ones));
    }
    return dist::DistTensor::FromTrustedShard(std::move(ones), root.global_shape(), root.layout().WithoutPartial(),
                                              root.mesh_ptr());
}

/// What the engine keeps per node of the reachable graph: one entry per node, instead of a map of buffers, a map of
/// counts and a set of visited nodes.
struct NodeTask {
    int dependencies = 0;           ///< edges of the reachable graph into the node not yet run
    bool visited = false;           ///< reached by the dependency count's walk
    std::vector<dist::Grad> buffer; ///< the gradients arrived so far, one slot per input (sized on first use)
};

/// The tasks of one backward, by node: a flat vector searched linearly while the graph is small (a layer's step has a
/// handful of nodes, and a hash map costs a heap block per node), with a hash index once it grows past kLinear. A
/// reference from operator[] is valid until the next call.
class TaskTable {
public:
    static constexpr std::size_t kLinear = 16;

    TaskTable() { tasks_.reserve(8); }
    NodeTask &operator[](Node *node) {
        if (index_.empty()) {
            for (auto &[n, task] : tasks_) {
                if (n == node) {
                    return task;
                }
            }
            tasks_.emplace_back(node, NodeTask{});
            if (tasks_.size() > kLinear) {
                index_.reserve(2 * tasks_.size());
                for (std::size_t i = 0; i < tasks_.size(); ++i) {
                    index_.emplace(tasks_[i].first, i);
                }
            }
            return tasks_.back().second;
        }
        const auto [it, inserted] = index_.emplace(node, tasks_.size());
        if (inserted) {
            tasks_.emplace_back(node, NodeTask{});
        }
        return tasks_[it->second].second;
    }
    std::size_t size() const { return tasks_.size(); }
    /// Empties the table, keeping its vector's capacity.
    void Clear() {
        tasks_.clear();
        index_.clear();
    }

private:
    std::vector<std::pair<Node *, NodeTask>> tasks_;
    std::unordered_map<Node *, std::size_t> index_; ///< built once the table passes kLinear nodes
};

/// Sums `grad` into input `input_nr` of `node`'s buffer (both already in that input's gradient layout): the first
/// gradient is kept as it is, a second one added out of place.
void Deliver(NodeTask &task, const Node &node, int input_nr, dist::Grad grad) {
    if (task.buffer.empty()) {
        task.buffer.resize(static_cast<std::size_t>(node.num_inputs()));
    }
    dist::Grad &slot = task.buffer[static_cast<std::size_t>(input_nr)];
    slot.accumulated = slot.accumulated || grad.accumulated;
    if (!grad.value.defined()) {
        return;
    }
    if (!slot.value.defined()) {
        slot.value = std::move(grad.value);
        return;
    }
    slot.value = dist::Add(slot.value, grad.value);
}

/// A backward's working storage: the tasks, the seeds, the walk's stack and the ready queue. It is kept per thread
/// between backwards, emptied but with its capacity, so that a step allocates none of it; a backward started while
/// another runs on the same thread (from a hook) leases one of its own.
struct Scratch {
    TaskTable tasks;
    std::vector<std::shared_ptr<Node>> seeds;
    std::vector<Node *> stack;
    std::vector<std::shared_ptr<Node>> ready;
};

/// A thread's idle scratches (detail::PerThread: null once the thread's thread-locals are being destroyed; a backward
/// from such a destructor then uses a scratch of its own).
struct ScratchPool {
    ScratchPool() { idle.reserve(4); } // backwards nested deeper than this make their own scratch each time
    std::vector<std::unique_ptr<Scratch>> idle;
};

class ScratchLease {
public:
    ScratchLease() {
        std::vector<std::unique_ptr<Scratch>> *pool = Pool();
        if (pool != nullptr && !pool->empty()) {
            scratch_ = std::move(pool->back());
            pool->pop_back();
        } else {
            scratch_ = std::make_unique<Scratch>();
        }
    }
    ScratchLease(const ScratchLease &) = delete;
    ScratchLease &operator=(const ScratchLease &) = delete;
    ~ScratchLease() {
        // A graph (or a list of roots) far larger than a layer's step gives its memory back rather than keep it.
        const bool keep = scratch_->tasks.size() <= kKeepNodes && scratch_->seeds.capacity() <= kKeepNodes &&
                          scratch_->stack.capacity() <= kKeepNodes;
        scratch_->tasks.Clear();
        scratch_->seeds.clear();
        scratch_->stack.clear();
        scratch_->ready.clear();
        std::vector<std::unique_ptr<Scratch>> *pool = Pool(); // the constructor's: it allocates nothing here
        if (keep && pool != nullptr && pool->size() < pool->capacity()) { // never allocates here
            pool->push_back(std::move(scratch_));
        }
    }
    Scratch *operator->() const { return scratch_.get(); }

private:
    static std::vector<std::unique_ptr<Scratch>> *Pool() {
        ScratchPool *pool = shardline::detail::PerThread<ScratchPool, ScratchLease>();
        return pool == nullptr ? nullptr : &pool->idle;
    }
    static constexpr std::size_t kKeepNodes = 256;
    std::unique_ptr<Scratch> scratch_;
};

} // namespace

bool GradEnabled() { return grad_enabled; }
NoGradGuard::NoGradGuard() : previous_(grad_enabled) { grad_enabled = false; }
NoGradGuard::~NoGradGuard() { grad_enabled = previous_; }

void Backward(const std::vector<Variable> &roots, const std::vector<dist::DistTensor> &grads, bool retain_graph) {
    SHARDLINE_CHECK(grads.empty() || grads.size() == roots.size(), "autograd::Backward",
                    "expected one gradient per root ({}), got {}", roots.size(), grads.size());
    std::vector<const dist::DistTensor *> given(roots.size(), nullptr);
    for (std::size_t r = 0; r < grads.size(); ++r) {
        given[r] = &grads[r];
    }
    detail::RunBackward(roots.data(), given.data(), roots.size(), retain_graph);
}

namespace detail {

void RunBackward(const Variable *roots, const dist::DistTensor *const *grads, std::size_t n, bool retain_graph) {
    constexpr const char *kOp = "autograd::Backward";
    const ScratchLease scratch;
    TaskTable &tasks = scratch->tasks;
    std::vector<std::shared_ptr<Node>> &seeds = scratch->seeds;
    for (std::size_t r = 0; r < n; ++r) {
        const Variable &root = roots[r];
        SHARDLINE_CHECK(root.defined() && root.requires_grad(), kOp,
                        "root {} does not require grad (nothing to differentiate)", r);
        const bool given = grads[r] != nullptr && grads[r]->defined();
        dist::Grad g{.value = given ? *grads[r] : Ones(root.value())};
        SHARDLINE_CHECK_AS(ShapeError, g.value.global_shape() == root.shape(), kOp,
                           "the gradient of root {} must have its shape {}, got {}", r, ShapeToString(root.shape()),
                           g.value.ToString());
        // A local root's gradient is local, and a root on a mesh takes its gradient on that mesh: the inputs' records
        // keep no grad layout for local values (Function::Apply).
        SHARDLINE_CHECK(g.value.mesh_ptr() == root.value().mesh_ptr(), kOp,
                        "the gradient of root {} must be {}, got {}", r,
                        root.value().is_local() ? "local, as the root is" : "on the root's mesh", g.value.ToString());
        Edge edge = GradientEdge(root);
        Deliver(tasks[edge.node.get()], *edge.node, edge.input_nr, std::move(g));
        seeds.push_back(std::move(edge.node));
    }

    // Dependency counts: how many edges of the reachable graph point at each node.
    std::vector<Node *> &stack = scratch->stack;
    for (const auto &s : seeds) {
        NodeTask &task = tasks[s.get()];
        if (!task.visited) {
            task.visited = true;
            stack.push_back(s.get());
        }
    }
    while (!stack.empty()) {
        Node *node = stack.back();
        stack.pop_back();
        for (const Edge &e : node->next_edges()) {
            if (!e.valid()) {
                continue;
            }
            NodeTask &task = tasks[e.node.get()];
            ++task.dependencies;
            if (!task.visited) {
                task.visited = true;
                stack.push_back(e.node.get());
            }
        }
    }

    // The ready queue: a vector read from the front (every node enters it once).
    std::vector<std::shared_ptr<Node>> &ready = scratch->ready;
    ready.reserve(tasks.size());
    for (const auto &s : seeds) {
        if (tasks[s.get()].dependencies == 0 && std::find(ready.begin(), ready.end(), s) == ready.end()) {
            ready.push_back(s);
        }
    }
    for (std::size_t head = 0; head < ready.size(); ++head) {
        const std::shared_ptr<Node> node = std::move(ready[head]);
        std::vector<dist::Grad> inputs = std::move(tasks[node.get()].buffer);
        inputs.resize(static_cast<std::size_t>(node->num_inputs()));
        std::vector<dist::Grad> outputs = node->Apply(std::move(inputs));
        if (!retain_graph) {
            node->Release();
        }
        const auto &edges = node->next_edges();
        for (std::size_t i = 0; i < edges.size(); ++i) {
            const Edge &e = edges[i];
            if (!e.valid()) {
                continue;
            }
            NodeTask &task = tasks[e.node.get()];
            if (i < outputs.size() && outputs[i].defined()) {
                Deliver(task, *e.node, e.input_nr, std::move(outputs[i]));
            }
            if (--task.dependencies == 0) {
                ready.push_back(e.node);
            }
        }
    }
}

} // namespace detail

} // namespace shardline::autograd
