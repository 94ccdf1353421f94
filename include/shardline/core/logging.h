#pragma once

#include <spdlog/spdlog.h>

namespace shardline {

/// The library's logger. Lines read "[rank r/N] [level] message" once SetProcessRank has been called;
/// the level comes from SHARDLINE_LOG_LEVEL (trace, debug, info, warn, error, off; default info).
spdlog::logger& Logger();

/// Re-reads the rank for the line prefix (called by SetProcessRank).
void RefreshLogPrefix();

} // namespace shardline

#define SHARDLINE_LOG_DEBUG(...) ::shardline::Logger().debug(__VA_ARGS__)
#define SHARDLINE_LOG_INFO(...) ::shardline::Logger().info(__VA_ARGS__)
#define SHARDLINE_LOG_WARN(...) ::shardline::Logger().warn(__VA_ARGS__)
#define SHARDLINE_LOG_ERROR(...) ::shardline::Logger().error(__VA_ARGS__)
