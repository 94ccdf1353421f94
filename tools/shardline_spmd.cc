// shardline-spmd: reads one JSON request (a file argument, or stdin), prints one JSON answer (docs/spmd.md).
// Exit codes: 0 answered, 2 the request was wrong (the answer is {"error": "..."}), 1 usage.

#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include <shardline/spmd/error.h>
#include <shardline/spmd/json.h>

namespace {

constexpr int kExitRequestError = 2;
constexpr int kExitUsage = 1;

constexpr const char *kUsage = R"(usage: shardline-spmd [--compact] [REQUEST.json | -]

Reads one JSON request from REQUEST.json (or stdin when absent or "-") and prints one JSON answer.
  rule:         {"op": "matmul", "direction": "forward"|"reverse"|"grad", "mesh": {"shape": [2,4]},
                 "inputs": [{"name": "x", "shape": [64,32], "dims_mapping": [0,-1]}, ...], "attrs": {...}}
  redistribute: {"op": "redistribute", "mesh": {...}, "shape": [...], "src": {...}, "dst": {...}}
A wrong request prints {"error": "..."} and exits with 2. See docs/spmd.md for the schema.
)";

int Fail(const std::string &message, int indent) {
    std::cout << nlohmann::json{{"error", message}}.dump(indent) << '\n';
    return kExitRequestError;
}

} // namespace

int main(int argc, char **argv) {
    int indent = 2;
    std::string path;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "-h" || arg == "--help") {
            std::cout << kUsage;
            return 0;
        }
        if (arg == "--compact") {
            indent = -1;
        } else if (!path.empty() || (arg.size() > 1 && arg[0] == '-')) {
            std::cerr << "shardline-spmd: unexpected argument '" << arg << "'\n" << kUsage;
            return kExitUsage;
        } else {
            path = arg;
        }
    }
    try {
        std::string text;
        if (path.empty() || path == "-") {
            text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
        } else {
            std::ifstream file(path);
            if (!file) {
                return Fail("request: cannot open '" + path + "': " + std::strerror(errno), indent);
            }
            text.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
        }
        nlohmann::json request;
        try {
            request = nlohmann::json::parse(text);
        } catch (const nlohmann::json::parse_error &e) {
            return Fail(std::string("request: invalid JSON: ") + e.what(), indent);
        }
        const nlohmann::json answer = shardline::spmd::HandleRequest(request);
        std::cout << answer.dump(indent) << '\n';
        return 0;
    } catch (const shardline::spmd::SpmdError &e) {
        return Fail(e.what(), indent);
    } catch (const nlohmann::json::exception &e) {
        return Fail(std::string("request: ") + e.what(), indent);
    } catch (const std::exception &e) {
        return Fail(std::string("internal error: ") + e.what(), indent);
    }
}
