#pragma once

// Runs the built shardline-spmd (its path is compiled in as SHARDLINE_SPMD_TOOL) and checks answers and exit codes.
//
// Exit-code convention (tools/shardline_spmd.cc): 0 answered; 2 the request was wrong, stdout is one JSON object
// {"error": "<field>: <what>"}; 1 the command line was wrong, stdout is empty and the usage goes to stderr.

#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

namespace shardline::spmd::cli_testing {

using nlohmann::json;

inline constexpr int kExitAnswered = 0;
inline constexpr int kExitUsage = 1;
inline constexpr int kExitRequestError = 2;

struct Result {
    int exit_code = -1;
    std::string out;
    json answer;
};

/// Runs `shardline-spmd --compact <args>` (stdout only) and parses stdout when it is JSON.
inline Result RunCommand(const std::string &args) {
    const std::string command = std::string(SHARDLINE_SPMD_TOOL) + " --compact " + args + " 2>/dev/null";
    FILE *pipe = popen(command.c_str(), "r");
    Result result;
    char buffer[4096];
    while (pipe != nullptr && fgets(buffer, sizeof(buffer), pipe) != nullptr) {
        result.out += buffer;
    }
    const int status = pipe != nullptr ? pclose(pipe) : -1;
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    result.answer = json::parse(result.out, nullptr, false);
    return result;
}

inline std::string WriteRequest(const std::string &request, const std::string &name) {
    const std::string path = ::testing::TempDir() + "spmd_cli_" + name + ".json";
    std::ofstream(path) << request;
    return path;
}

/// The request on stdin.
inline Result RunTool(const std::string &request, const std::string &name) {
    return RunCommand("< " + WriteRequest(request, name));
}

inline Result RunJson(const json &request, const std::string &name) { return RunTool(request.dump(), name); }

/// Exit 2 and exactly {"error": "..."} whose message starts with `field` followed by ':' and contains `what`.
inline ::testing::AssertionResult IsError(const Result &r, const std::string &field, const std::string &what = "") {
    if (r.exit_code != kExitRequestError) {
        return ::testing::AssertionFailure() << "exit code " << r.exit_code << ", output " << r.out;
    }
    if (!r.answer.is_object() || r.answer.size() != 1 || !r.answer.contains("error") ||
        !r.answer["error"].is_string()) {
        return ::testing::AssertionFailure() << "not an {\"error\": ...} object: " << r.out;
    }
    const std::string message = r.answer["error"];
    if (message.rfind(field + ":", 0) != 0) {
        return ::testing::AssertionFailure() << "error does not start with '" << field << ":': " << message;
    }
    if (message.find(what) == std::string::npos) {
        return ::testing::AssertionFailure() << "error lacks '" << what << "': " << message;
    }
    return ::testing::AssertionSuccess();
}

} // namespace shardline::spmd::cli_testing
