// shardline_spmd_fuzz: a seeded random / mutating request generator for shardline-spmd (AnswerRequestText, the
// tool's whole answering path, in process). Built with AddressSanitizer and UBSan (tests/spmd/CMakeLists.txt), so a
// memory error or undefined behaviour aborts the run. It fails (exit 1) on any finding: an answer that is not a JSON
// object, an exit-2 answer that is not exactly {"error": "<field>: ..."}, an exception the code did not expect, or
// a request slower than --slow-ms; a request running longer than --hang-s aborts the run (exit 3) after printing it.
//
//     shardline_spmd_fuzz [--seconds S] [--requests N] [--seed N] [--slow-ms M] [--hang-s H] [--write-seeds DIR]
//
// It prints one JSON summary: requests, seconds, requests_per_s, answered, errors, findings, slow (> --slow-ms),
// the slowest requests with their text, and the peak resident memory.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <sys/resource.h>

#include "spmd_fuzz.h"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

struct Options {
    double seconds = 20.0;
    int64_t requests = -1; ///< -1: until --seconds
    uint64_t seed = 1;
    double slow_ms = 1000.0;
    double hang_s = 30.0;
    std::string write_seeds;
};

Options Parse(int argc, char **argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "shardline_spmd_fuzz: %s needs a value\n", arg.c_str());
                std::exit(2);
            }
            return argv[++i];
        };
        if (arg == "--seconds") {
            o.seconds = std::stod(value());
        } else if (arg == "--requests") {
            o.requests = std::stoll(value());
        } else if (arg == "--seed") {
            o.seed = std::stoull(value());
        } else if (arg == "--slow-ms") {
            o.slow_ms = std::stod(value());
        } else if (arg == "--hang-s") {
            o.hang_s = std::stod(value());
        } else if (arg == "--write-seeds") {
            o.write_seeds = value();
        } else {
            std::fprintf(stderr, "usage: shardline_spmd_fuzz [--seconds S] [--requests N] [--seed N] [--slow-ms M] "
                                 "[--hang-s H] [--write-seeds DIR]\n");
            std::exit(2);
        }
    }
    return o;
}

/// Aborts the process when one request runs longer than the limit (a hang): the request is printed first.
class Watchdog {
public:
    explicit Watchdog(double limit_s) : limit_(std::chrono::duration<double>(limit_s)) {
        thread_ = std::thread([this] { Run(); });
    }
    ~Watchdog() {
        {
            std::lock_guard lock(mutex_);
            stop_ = true;
        }
        cv_.notify_all();
        thread_.join();
    }
    void Start(const std::string &text) {
        std::lock_guard lock(mutex_);
        current_ = text;
        started_ = Clock::now();
        running_ = true;
    }
    void Stop() {
        std::lock_guard lock(mutex_);
        running_ = false;
    }

private:
    void Run() {
        std::unique_lock lock(mutex_);
        while (!stop_) {
            cv_.wait_for(lock, std::chrono::milliseconds(100));
            if (running_ && Clock::now() - started_ > limit_) {
                std::fprintf(stderr, "shardline_spmd_fuzz: HANG, a request ran over %.0f s:\n%s\n", limit_.count(),
                             current_.c_str());
                std::fflush(stderr);
                std::_Exit(3);
            }
        }
    }

    std::chrono::duration<double> limit_;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::thread thread_;
    std::string current_;
    Clock::time_point started_;
    bool running_ = false;
    bool stop_ = false;
};

struct Timed {
    double ms = 0.0;
    std::string text;
};

} // namespace

int main(int argc, char **argv) {
    const Options options = Parse(argc, argv);
    if (!options.write_seeds.empty()) {
        // A corpus for the libFuzzer target (spmd_libfuzzer.cc).
        const auto &seeds = shardline::spmd::fuzz::SeedRequests();
        for (size_t i = 0; i < seeds.size(); ++i) {
            std::ofstream(options.write_seeds + "/seed_" + std::to_string(i) + ".json") << seeds[i];
        }
        return 0;
    }
    shardline::spmd::fuzz::Mutator mutator(options.seed);
    Watchdog watchdog(options.hang_s);
    int64_t requests = 0;
    int64_t answered = 0;
    int64_t errors = 0;
    std::vector<std::string> findings;
    std::vector<Timed> slowest;
    int64_t slow = 0;
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::duration<double>(options.seconds);
    while (options.requests >= 0 ? requests < options.requests : Clock::now() < deadline) {
        const std::string text = mutator.Next();
        watchdog.Start(text);
        const auto t0 = Clock::now();
        const shardline::spmd::fuzz::Outcome outcome = shardline::spmd::fuzz::RunOne(text);
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        watchdog.Stop();
        ++requests;
        if (outcome.exit_code == 0) {
            ++answered;
            mutator.Remember(text);
        } else {
            ++errors;
        }
        if (!outcome.finding.empty() && findings.size() < 20) {
            findings.push_back(outcome.finding + "\n  request: " + text.substr(0, 600));
        }
        slow += ms > options.slow_ms ? 1 : 0;
        if (slowest.size() < 5 || ms > slowest.back().ms) {
            slowest.push_back({ms, text.substr(0, 600)});
            std::sort(slowest.begin(), slowest.end(), [](const Timed &a, const Timed &b) { return a.ms > b.ms; });
            slowest.resize(std::min<size_t>(slowest.size(), 5));
        }
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    json summary{{"seed", options.seed}, {"requests", requests},
                 {"seconds", seconds},   {"requests_per_s", static_cast<double>(requests) / std::max(seconds, 1e-9)},
                 {"answered", answered}, {"errors", errors},
                 {"findings", findings}, {"slow_ms_threshold", options.slow_ms},
                 {"slow", slow},         {"peak_rss_mb", static_cast<double>(usage.ru_maxrss) / 1024.0}};
    json top = json::array();
    for (const Timed &t : slowest) {
        top.push_back({{"ms", t.ms}, {"request", t.text}});
    }
    summary["slowest"] = top;
    std::cout << summary.dump(2, ' ', false, json::error_handler_t::replace) << std::endl;
    return findings.empty() && slow == 0 ? 0 : 1;
}
