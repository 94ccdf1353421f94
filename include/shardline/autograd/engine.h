#pragma once

#include <vector>

#include <shardline/autograd/variable.h>

namespace shardline::autograd {

/// Backpropagates from `roots` with gradients `grads` (one per root; an undefined one means ones). Nodes run in
/// topological order, each once, after every gradient for it has arrived; gradients reaching one input are summed.
/// Saved tensors are released afterwards unless retain_graph.
void Backward(const std::vector<Variable>& roots, const std::vector<dist::DistTensor>& grads = {},
              bool retain_graph = false);

/// Whether Functions record the graph (thread-local; on by default).
bool GradEnabled();

/// Turns graph recording off in a scope (evaluation, optimizer steps).
class NoGradGuard {
public:
    NoGradGuard();
    ~NoGradGuard();
    NoGradGuard(const NoGradGuard&) = delete;
    NoGradGuard& operator=(const NoGradGuard&) = delete;

private:
    bool previous_;
};

} // namespace shardline::autograd
