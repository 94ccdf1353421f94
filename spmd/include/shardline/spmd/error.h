#pragma once

#include <stdexcept>
#include <string>

namespace shardline::spmd {

/// The one error type of the SPMD library. Messages name the op, the values and the expectation, e.g.
/// "matmul: x.shape[1] (32) must equal y.shape[0] (16)". A NUL byte (a request may quote one) is written as \u0000:
/// what() is a C string and would end there.
class SpmdError : public std::runtime_error {
public:
    explicit SpmdError(const std::string &what) : std::runtime_error(Escaped(what)) {}

private:
    static std::string Escaped(const std::string &what) {
        if (what.find('\0') == std::string::npos) {
            return what;
        }
        std::string out;
        for (char c : what) {
            if (c == '\0') {
                out += "\\u0000";
            } else {
                out.push_back(c);
            }
        }
        return out;
    }
};

} // namespace shardline::spmd
