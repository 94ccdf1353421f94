#pragma once

// Starts a command, captures its stdout+stderr and exit status, and kills its whole process group when it runs past a
// deadline. For the tests that launch mpirun themselves.

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace shardline::testing {

struct ProcessResult {
    int exit_code = -1;     ///< the exit status, or 128 + signal when killed by one
    bool timed_out = false; ///< killed by RunProcess at the deadline
    double seconds = 0;     ///< wall time from start to exit
    long long end_unix_ms = 0;
    std::string output; ///< stdout and stderr, interleaved
};

/// Runs argv[0] with argv and the current environment plus `extra_env` ("NAME=value"), in its own process group.
ProcessResult RunProcess(const std::vector<std::string> &argv, const std::vector<std::string> &extra_env,
                         std::chrono::milliseconds deadline);

} // namespace shardline::testing
