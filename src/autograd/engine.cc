// The backward engine: dependency counts over the graph reachable from the roots, then a ready queue, so every node
// runs once, after all of its gradients have arrived (torch's engine, single-threaded).

#include <deque>
#include <unordered_map>
#include <unordered_set>

#include <shardline/autograd/engine.h>
#include <shardline/core/error.h>
#include <shardline/dist/ops.h>

#include "accumulate_grad.h"

namespace shardline::autograd {
namespace {

thread_local bool grad_enabled = true;

/// a + b for two gradients of one input (both already in that input's gradient layout).
dist::Grad Combine(dist::Grad a, const dist::Grad &b) {
    a.accumulated = a.accumulated || b.accumulated;
    if (!b.value.defined()) {
        return a;
    }
    if (!a.value.defined()) {
        a.value = b.value;
        return a;
    }
    a.value = dist::Add(a.value, b.value);
    return a;
}

/// Ones in the root's layout without Partial: d root / d root, for every local element.
dist::DistTensor Ones(const dist::DistTensor &root) {
    Tensor ones = Tensor::Full(root.local().shape(), 1.0, root.dtype(), root.device());
    return dist::DistTensor::FromTrustedShard(std::move(ones), root.global_shape(), root.layout().WithoutPartial(),
                                              root.mesh_ptr());
}

} // namespace

bool GradEnabled() { return grad_enabled; }
NoGradGuard::NoGradGuard() : previous_(grad_enabled) { grad_enabled = false; }
NoGradGuard::~NoGradGuard() { grad_enabled = previous_; }

void Backward(const std::vector<Variable> &roots, const std::vector<dist::DistTensor> &grads, bool retain_graph) {
    constexpr const char *kOp = "autograd::Backward";
    SHARDLINE_CHECK(grads.empty() || grads.size() == roots.size(), kOp, "expected one gradient per root ({}), got {}",
                    roots.size(), grads.size());
    std::unordered_map<Node *, std::vector<dist::Grad>> buffers;
    std::unordered_map<Node *, int> dependencies;
    std::vector<std::shared_ptr<Node>> seeds;
    for (std::size_t r = 0; r < roots.size(); ++r) {
        const Variable &root = roots[r];
        SHARDLINE_CHECK(root.defined() && root.requires_grad(), kOp,
                        "root {} does not require grad (nothing to differentiate)", r);
        dist::DistTensor g = r < grads.size() && grads[r].defined() ? grads[r] : Ones(root.value());
        SHARDLINE_CHECK_AS(ShapeError, g.global_shape() == root.shape(), kOp,
                           "the gradient of root {} must have its shape {}, got {}", r, ShapeToString(root.shape()),
                           g.ToString());
        const Edge edge = GradientEdge(root);
        auto &buffer = buffers[edge.node.get()];
        buffer.resize(static_cast<std::size_t>(edge.node->num_inputs()));
        buffer[static_cast<std::size_t>(edge.input_nr)] =
            Combine(buffer[static_cast<std::size_t>(edge.input_nr)], dist::Grad{.value = g});
        seeds.push_back(edge.node);
    }

    // Dependency counts: how many edges of the reachable graph point at each node.
    std::unordered_set<Node *> seen;
    std::vector<Node *> stack;
    for (const auto &s : seeds) {
        if (seen.insert(s.get()).second) {
            stack.push_back(s.get());
        }
    }
    std::vector<Node *> order;
    while (!stack.empty()) {
        Node *node = stack.back();
        stack.pop_back();
        order.push_back(node);
        for (const Edge &e : node->next_edges()) {
            if (!e.valid()) {
                continue;
            }
            ++dependencies[e.node.get()];
            if (seen.insert(e.node.get()).second) {
                stack.push_back(e.node.get());
            }
        }
    }

    std::deque<std::shared_ptr<Node>> ready;
    for (const auto &s : seeds) {
        if (dependencies[s.get()] == 0 && std::find(ready.begin(), ready.end(), s) == ready.end()) {
            ready.push_back(s);
        }
    }
    while (!ready.empty()) {
        std::shared_ptr<Node> node = std::move(ready.front());
        ready.pop_front();
        std::vector<dist::Grad> inputs = std::move(buffers[node.get()]);
        buffers.erase(node.get());
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
            if (i < outputs.size() && outputs[i].defined()) {
                auto &buffer = buffers[e.node.get()];
                buffer.resize(static_cast<std::size_t>(e.node->num_inputs()));
                buffer[static_cast<std::size_t>(e.input_nr)] =
                    Combine(std::move(buffer[static_cast<std::size_t>(e.input_nr)]), outputs[i]);
            }
            if (--dependencies[e.node.get()] == 0) {
                ready.push_back(e.node);
            }
        }
    }
}

} // namespace shardline::autograd
