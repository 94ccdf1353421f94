#pragma once

#include <stdexcept>
#include <string>

namespace shardline::spmd {

/// The one error type of the SPMD library. Messages name the op, the values and the expectation, e.g.
/// "matmul: x.shape[1] (32) must equal y.shape[0] (16)".
class SpmdError : public std::runtime_error {
public:
    explicit SpmdError(const std::string &what) : std::runtime_error(what) {}
};

} // namespace shardline::spmd
