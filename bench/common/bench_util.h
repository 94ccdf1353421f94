#pragma once

// What every benchmark records with its numbers (shared/BENCHMARKS.md "Output", the project's benchmark rules outside
// this repository): the commit, the date, and the median / p90 of its samples. Header-only, no CUDA, no MPI: shared by
// bench/comm, bench/linear and bench/tp_mlp.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>

#include <shardline/core/env.h>

namespace shardline::bench {

/// SHARDLINE_COMMIT when set (the run scripts export it), else `git rev-parse --short HEAD`, else "unknown".
inline std::string Commit() {
    if (auto env = shardline::env::Get("SHARDLINE_COMMIT")) {
        return *env;
    }
    std::string out;
    if (FILE* pipe = ::popen("git rev-parse --short HEAD 2>/dev/null", "r"); pipe != nullptr) {
        char buf[64];
        while (std::fgets(buf, sizeof(buf), pipe) != nullptr) {
            out += buf;
        }
        ::pclose(pipe);
    }
    while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) {
        out.pop_back();
    }
    return out.empty() ? "unknown" : out;
}

/// Now, UTC, ISO 8601 ("2026-11-21T10:00:00Z").
inline std::string NowUtc() {
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&now, &tm);
    char buf[32];
    std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
    return buf;
}

/// The q-quantile (0 ≤ q ≤ 1) with linear interpolation between order statistics (numpy's default); 0 when empty.
inline double Percentile(std::vector<double> v, double q) {
    if (v.empty()) {
        return 0.0;
    }
    std::sort(v.begin(), v.end());
    const double pos = q * static_cast<double>(v.size() - 1);
    const auto lo = static_cast<std::size_t>(pos);
    const std::size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

} // namespace shardline::bench
