// shardline-spmd: reads one JSON request (a file argument, or stdin), prints one JSON answer (docs/spmd.md).
// Exit codes: 0 answered, 2 the request (or the --cost-profile file) was wrong (the answer is {"error": "..."}),
// 1 usage. The answering itself is shardline::spmd::AnswerRequestText, which the fuzz driver (tests/spmd) calls too.

#include <algorithm>
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
#include <shardline/spmd/limits.h>
#include <shardline/spmd/redistribute.h>

namespace {

constexpr int kExitRequestError = 2;
constexpr int kExitUsage = 1;

// The usage line the tests and docs/spmd.md quote (CLI11's own would read "Usage: shardline-spmd [OPTIONS] [request]").
class UsageFormatter : public CLI::Formatter {
public:
    std::string make_usage(const CLI::App *, std::string) const override {
        return "usage: shardline-spmd [--compact] [--cost-profile NAME|FILE.json] [REQUEST.json | -]\n";
    }
};

std::string Dump(const nlohmann::json &j, int indent) {
    // Replace, never throw, on a byte that is not UTF-8 (an error message may quote one).
    return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

int Fail(const std::string &message, int indent) {
    std::cout << Dump(nlohmann::json{{"error", message}}, indent) << '\n';
    return kExitRequestError;
}

/// Reads at most kMaxRequestBytes + 1 bytes: a longer request is refused without being held.
std::string ReadBounded(std::istream &in) {
    std::string text;
    char buffer[1 << 16];
    while (in.read(buffer, sizeof buffer) || in.gcount() > 0) {
        text.append(buffer, static_cast<size_t>(in.gcount()));
        if (static_cast<int64_t>(text.size()) > shardline::spmd::kMaxRequestBytes) {
            break;
        }
    }
    return text;
}

} // namespace

int main(int argc, char **argv) {
    CLI::App app{"Reads one JSON request from REQUEST.json (or stdin when absent or \"-\") and prints one JSON answer.",
                 "shardline-spmd"};
    app.formatter(std::make_shared<UsageFormatter>());
    bool compact = false;
    std::string path;
    std::string profile;
    app.add_flag("--compact", compact, "print the answer on one line");
    app.add_option("--cost-profile", profile,
                   "the cost model before the request's cost_profile / cost_model: a built-in profile name "
                   "(nccl_h200, the default; mpi_cpu) or a profile JSON file")
        ->type_name("NAME|FILE.json");
    app.add_option("request", path, "the request file; \"-\" or absent: stdin")->type_name("REQUEST.json");
    app.footer(R"(Requests:
  rule:         {"op": "matmul", "direction": "forward"|"reverse"|"grad"|"enumerate", "mesh": {"shape": [2,4]},
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
        shardline::spmd::CostModel base;
        if (!profile.empty()) {
            const auto names = shardline::spmd::CostProfileNames();
            base = std::find(names.begin(), names.end(), profile) != names.end()
                       ? shardline::spmd::CostProfile(profile)
                       : shardline::spmd::LoadCostProfile(profile);
        }
        std::string text;
        if (path.empty() || path == "-") {
            text = ReadBounded(std::cin);
        } else {
            std::ifstream file(path, std::ios::binary);
            if (!file) {
                return Fail("request: cannot open '" + path + "': " + std::strerror(errno), indent);
            }
            text = ReadBounded(file);
        }
        const shardline::spmd::RequestAnswer answer = shardline::spmd::AnswerRequestText(text, base);
        std::cout << Dump(answer.answer, indent) << '\n';
        return answer.exit_code;
    } catch (const shardline::spmd::SpmdError &e) {
        return Fail(e.what(), indent); // --cost-profile
    } catch (const std::exception &e) {
        return Fail(std::string("internal error: ") + e.what(), indent);
    }
}
