#include <cstdlib>
#include <mutex>

#include <spdlog/sinks/stdout_color_sinks.h>

#include <shardline/core/env.h>
#include <shardline/core/error.h>
#include <shardline/core/logging.h>

namespace shardline {
namespace {

std::shared_ptr<spdlog::logger> MakeLogger() {
    spdlog::level::level_enum level = spdlog::level::info;
    // spdlog::level::from_str reads an unknown word as "off": a typo would silence every message. Parsed before the
    // logger is registered, so that a bad value raises its own message on every call, not spdlog's "logger with name
    // 'shardline' already exists" from the second call on.
    if (const auto name = env::Get("SHARDLINE_LOG_LEVEL")) {
        level = spdlog::level::from_str(env::ParseChoice(
            "SHARDLINE_LOG_LEVEL", *name, {"trace", "debug", "info", "warning", "warn", "error", "critical", "off"}));
    }
    auto logger = spdlog::stderr_color_mt("shardline");
    logger->set_level(level);
    return logger;
}

void ApplyPattern(spdlog::logger& logger) {
    // The rank is baked into the pattern: it changes once per process, never per line.
    logger.set_pattern(fmt::format("[rank {}/{}] [%H:%M:%S.%e] [%^%l%$] %v", ProcessRank(), ProcessWorldSize()));
}

} // namespace

spdlog::logger& Logger() {
    static const std::shared_ptr<spdlog::logger> logger = [] {
        auto l = MakeLogger();
        ApplyPattern(*l);
        return l;
    }();
    return *logger;
}

void RefreshLogPrefix() { ApplyPattern(Logger()); }

} // namespace shardline
