#pragma once
// The command line the two MoE benches share (shardline-moe-bench at ep 1, shardline-moe-ep-bench with ep = the
// world): case selection, iteration counts, the JSON file and --list-cases. Header-only.

#include <cstdlib>
#include <set>
#include <string>

#include <CLI/CLI.hpp>

#include "common/cli.h"

namespace shardline::bench {

struct MoeBenchOptions {
    std::set<std::string> cases; ///< empty: all
    int warmup = 5;
    int iters = 10;
    int rounds = 3;
    std::string json_path;
    bool list_cases = false;
};

/// Parses the options (exits on --help or a parse error); `warmup` is the default number of warm-up iterations.
inline MoeBenchOptions ParseMoeBench(int argc, char **argv, const std::string &description, int warmup) {
    MoeBenchOptions o;
    o.warmup = warmup;
    CLI::App app{description};
    UseBenchDefaults(app);
    std::string cases;
    app.add_option("--cases", cases, "comma list of case names (default: all)");
    app.add_option("--warmup", o.warmup, "warm-up iterations")->check(CLI::PositiveNumber);
    app.add_option("--iters", o.iters, "timed iterations per measurement per round")->check(CLI::PositiveNumber);
    app.add_option("--rounds", o.rounds, "interleaved rounds")->check(CLI::PositiveNumber);
    app.add_option("--json", o.json_path, "append one JSON record per case to this file");
    app.add_flag("--list-cases", o.list_cases, "print the cases as JSON and exit");
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError &e) {
        std::exit(app.exit(e));
    }
    for (const std::string &c : SplitList(cases)) {
        o.cases.insert(c);
    }
    return o;
}

} // namespace shardline::bench
