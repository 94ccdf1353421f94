// shardline-spmd: reads one JSON request (a file argument, or stdin), prints one JSON answer (docs/spmd.md).
// Exit codes: 0 answered, 2 the request was wrong (the answer is {"error": "..."}), 1 usage.

#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <shardline/spmd/error.h>
#include <shardline/spmd/json.h>

namespace {

constexpr int kExitRequestError = 2;
constexpr int kExitUsage = 1;

// The usage line the tests and docs/spmd.md quote (CLI11's own would read "Usage: shardline-spmd [OPTIONS] [request]").
class UsageFormatter : public CLI::Formatter {
public:
    std::string make_usage(const CLI::App *, std::string) const override {
        return "usage: shardline-spmd [--compact] [REQUEST.json | -]\n";
    }
};

int Fail(const std::string &message, int indent) {
    std::cout << nlohmann::json{{"error", message}}.dump(indent) << '\n';
    return kExitRequestError;
}

} // namespace

int main(int argc, char **argv) {
    CLI::App app{"Reads one JSON request from REQUEST.json (or stdin when absent or \"-\") and prints one JSON answer.",
                 "shardline-spmd"};
    app.formatter(std::make_shared<UsageFormatter>());
    bool compact = false;
    std::string path;
    app.add_flag("--compact", compact, "print the answer on one line");
    app.add_option("request", path, "the request file; \"-\" or absent: stdin")->type_name("REQUEST.json");
    app.footer(R"(Requests:
  rule:         {"op": "matmul", "direction": "forward"|"reverse"|"grad", "mesh": {"shape": [2,4]},
                 "inputs": [{"name": "x", "shape": [64,32], "dims_mapping": [0,-1]}, ...], "attrs": {...}}
  redistribute: {"op": "redistribute", "mesh": {...}, "shape": [...], "src": {...}, "dst": {...}}
A wrong request prints {"error": "..."} and exits with 2; a wrong command line exits with 1. See docs/spmd.md.)");
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp &e) {
        return app.exit(e);
    } catch (const CLI::ParseError &e) {
        // stdout stays empty (it carries only JSON answers); the message and the usage go to stderr.
        std::cerr << "shardline-spmd: " << e.what() << "\n" << app.help();
        return kExitUsage;
    }
    const int indent = compact ? -1 : 2;
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
