#pragma once

// Private to src/autograd: the engine's entry point without the public form's vectors, so Variable::Backward passes
// its one root and gradient without copying them.

#include <cstddef>

#include <shardline/autograd/variable.h>

namespace shardline::autograd::detail {

/// autograd::Backward over roots[0..n) with grads[r] (null or undefined: ones).
void RunBackward(const Variable *roots, const dist::DistTensor *const *grads, std::size_t n, bool retain_graph);

} // namespace shardline::autograd::detail
