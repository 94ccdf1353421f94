// The grouped GEMM's per-shape tuning: shape classes, the cache of winners and the counters (host-only; the CUDA
// provider times the candidates). See grouped_tuning.h.

#include "grouped_tuning.h"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <limits>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>

#include <shardline/kernels/gemm_tuning.h>

namespace shardline::kernels {
namespace detail {
namespace {

struct KeyHash {
    std::size_t operator()(const GroupedTuningKey& k) const noexcept {
        std::size_t h = 1469598103934665603ULL;
        auto mix = [&h](std::uint64_t v) { h = (h ^ v) * 1099511628211ULL; };
        mix(static_cast<std::uint64_t>(k.device));
        mix(static_cast<std::uint64_t>(k.trans_a) | static_cast<std::uint64_t>(k.trans_b) << 1 |
            static_cast<std::uint64_t>(k.grouped_dim) << 2 | static_cast<std::uint64_t>(k.bias) << 4 |
            static_cast<std::uint64_t>(k.host_sizes) << 5 | static_cast<std::uint64_t>(k.dgelu) << 6);
        mix(static_cast<std::uint64_t>(k.a_type) | static_cast<std::uint64_t>(k.c_type) << 8);
        mix(static_cast<std::uint64_t>(k.groups));
        mix(static_cast<std::uint64_t>(k.m));
        mix(static_cast<std::uint64_t>(k.n));
        mix(static_cast<std::uint64_t>(k.k));
        mix(static_cast<std::uint64_t>(k.mean_rows_class));
        return h;
    }
};

struct Entry {
    int winner = kLoopCandidate;
    std::vector<std::pair<int, double>> times_us;
};

struct TuningCache {
    std::mutex mutex;
    std::unordered_map<GroupedTuningKey, Entry, KeyHash> winners;
    GroupedGemmTuningStats stats;
};

TuningCache& Cache() {
    static TuningCache cache;
    return cache;
}

thread_local std::string g_last_path;

} // namespace

GroupedTuningKey MakeGroupedTuningKey(const GroupedGemmParams& p) {
    GroupedTuningKey key;
    key.device = p.device.index;
    key.trans_a = p.trans_a;
    key.trans_b = p.trans_b;
    key.grouped_dim = p.grouped_dim;
    key.a_type = p.a_type;
    key.c_type = p.c_type;
    key.bias = p.epilogue == GemmEpilogue::kBias;
    key.dgelu = p.epilogue == GemmEpilogue::kDGelu;
    key.host_sizes = p.sizes_device.is_cpu();
    key.groups = p.group_count;
    key.m = p.m;
    key.n = p.grouped_dim == GroupedDim::kN ? 0 : p.n;
    key.k = p.grouped_dim == GroupedDim::kK ? 0 : p.k;
    const std::uint64_t mean =
        p.group_count > 0 && p.total > 0 ? static_cast<std::uint64_t>(p.total / p.group_count) : 0;
    key.mean_rows_class = static_cast<int>(std::bit_width(mean));
    return key;
}

std::string GroupedTuningKeyString(const GroupedTuningKey& key) {
    const char* layout = key.trans_a ? (key.trans_b ? "tt" : "tn") : (key.trans_b ? "nt" : "nn");
    const std::string rows = key.mean_rows_class == 0
                                 ? std::string("0")
                                 : fmt::format("{}-{}", std::uint64_t{1} << (key.mean_rows_class - 1),
                                               (std::uint64_t{1} << key.mean_rows_class) - 1);
    const std::string dims = key.grouped_dim == GroupedDim::kN ? fmt::format("m={} k={}", key.m, key.k)
                                                               : fmt::format("m={} n={}", key.m, key.n);
    return fmt::format("{} grouped={} groups={} {} rows~{} {}->{}{}{} {}-sizes cuda:{}", layout,
                       key.grouped_dim == GroupedDim::kN ? "n" : "k", key.groups, dims, rows, DTypeName(key.a_type),
                       DTypeName(key.c_type), key.bias ? " bias" : "", key.dgelu ? " dgelu" : "",
                       key.host_sizes ? "host" : "device", key.device);
}

std::string GroupedCandidateName(int candidate) {
    const std::string_view along = CandidateAlongN(candidate) ? " along-n" : "";
    switch (CandidateTile(candidate)) {
    case GroupedGemmTile::kAuto:
        return CandidateAlongN(candidate) ? fmt::format("candidate{}", candidate) : "loop";
    case GroupedGemmTile::k256x128:
        return fmt::format("cooperative256x128{}", along);
    case GroupedGemmTile::k128x128:
        return fmt::format("cooperative128x128{}", along);
    case GroupedGemmTile::kPingpong128x128:
        return fmt::format("pingpong128x128{}", along);
    case GroupedGemmTile::kPingpong128x64:
        return fmt::format("pingpong128x64{}", along);
    case GroupedGemmTile::k128x256:
        return fmt::format("cooperative128x256{}", along);
    }
    return fmt::format("candidate{}", candidate);
}

bool GroupedTuningAllowed(bool capturing) { return !capturing && CurrentGemmTuningOptions().enabled; }

std::optional<int> FindGroupedWinner(const GroupedTuningKey& key, bool count_hit) {
    TuningCache& c = Cache();
    std::lock_guard lock(c.mutex);
    const auto it = c.winners.find(key);
    if (it == c.winners.end()) {
        return std::nullopt;
    }
    if (count_hit) {
        ++c.stats.hits;
    }
    return it->second.winner;
}

std::optional<int> TuneGroupedGemm(const GroupedTuningKey& key, const std::vector<int>& candidates, int preferred,
                                   const std::function<double(int)>& time_us) {
    constexpr double kRefused = -1.0;
    std::vector<double> best(candidates.size(), std::numeric_limits<double>::infinity());
    std::vector<bool> ran(candidates.size(), true);
    // Two passes (A B C A B C): a candidate's time is its better pass, so a clock ramp or a one-off stall on one pass
    // does not decide.
    for (int pass = 0; pass < 2; ++pass) {
        for (std::size_t i = 0; i < candidates.size(); ++i) {
            if (!ran[i]) {
                continue;
            }
            const double us = time_us(candidates[i]);
            if (!(us >= 0.0)) {
                ran[i] = false;
                best[i] = kRefused;
                continue;
            }
            best[i] = std::min(best[i], us);
        }
    }
    std::optional<std::size_t> fastest;
    std::optional<std::size_t> preferred_at;
    for (std::size_t i = 0; i < candidates.size(); ++i) {
        if (!ran[i]) {
            continue;
        }
        if (!fastest || best[i] < best[*fastest]) {
            fastest = i;
        }
        if (candidates[i] == preferred) {
            preferred_at = i;
        }
    }
    if (!fastest) {
        return std::nullopt;
    }
    // The heuristic's pick stays unless another is more than 1 % faster: two processes then agree more often.
    const std::size_t chosen = preferred_at && best[*preferred_at] <= best[*fastest] * 1.01 ? *preferred_at : *fastest;
    Entry entry;
    entry.winner = candidates[chosen];
    for (std::size_t i = 0; i < candidates.size(); ++i) {
        entry.times_us.emplace_back(candidates[i], best[i]);
    }
    TuningCache& c = Cache();
    std::lock_guard lock(c.mutex);
    c.winners[key] = std::move(entry);
    ++c.stats.tuned;
    return candidates[chosen];
}

void CountGroupedUntuned() {
    TuningCache& c = Cache();
    std::lock_guard lock(c.mutex);
    ++c.stats.untuned;
}

void SetLastGroupedGemmPath(std::string path) { g_last_path = std::move(path); }

} // namespace detail

std::string LastGroupedGemmPath() { return detail::g_last_path; }

GroupedGemmTuningStats GetGroupedGemmTuningStats() {
    detail::TuningCache& c = detail::Cache();
    std::lock_guard lock(c.mutex);
    return c.stats;
}

std::vector<GroupedGemmTuningInfo> GroupedGemmTuningInfos() {
    detail::TuningCache& c = detail::Cache();
    std::lock_guard lock(c.mutex);
    std::vector<GroupedGemmTuningInfo> infos;
    for (const auto& [key, entry] : c.winners) {
        GroupedGemmTuningInfo info{.key = detail::GroupedTuningKeyString(key),
                                   .winner = detail::GroupedCandidateName(entry.winner)};
        for (const auto& [candidate, us] : entry.times_us) {
            info.candidates_us.emplace_back(detail::GroupedCandidateName(candidate), us);
        }
        infos.push_back(std::move(info));
    }
    std::sort(infos.begin(), infos.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
    return infos;
}

void ClearGroupedGemmTuning() {
    detail::TuningCache& c = detail::Cache();
    std::lock_guard lock(c.mutex);
    c.winners.clear();
    c.stats = {};
}

} // namespace shardline::kernels
