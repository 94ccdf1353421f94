#include <atomic>

#include <shardline/core/error.h>
#include <shardline/core/logging.h>

namespace shardline {
namespace {
std::atomic<int> g_rank{0};
std::atomic<int> g_world_size{1};
} // namespace

void SetProcessRank(int rank, int world_size) {
    g_rank = rank;
    g_world_size = world_size;
    RefreshLogPrefix();
}
int ProcessRank() { return g_rank; }
int ProcessWorldSize() { return g_world_size; }

namespace detail {

std::string_view BaseName(const char* path) {
    std::string_view p(path);
    const auto slash = p.find_last_of('/');
    return slash == std::string_view::npos ? p : p.substr(slash + 1);
}

std::string FormatError(const char* file, int line, std::string_view op, std::string_view message) {
    if (g_world_size > 1) {
        return fmt::format("[rank {}/{}] {}:{} {}: {}", g_rank.load(), g_world_size.load(), BaseName(file), line, op,
                           message);
    }
    return fmt::format("{}:{} {}: {}", BaseName(file), line, op, message);
}

} // namespace detail
} // namespace shardline
