// shardline-run: starts a shardline program on N ranks through mpirun.
//
//   shardline-run -n N [--cpu] [--timeout S] [--dry-run] -- PROGRAM ARGS...
//
// It execs mpirun with `-n N --bind-to none`, adds `--allow-run-as-root` when run as root and `--oversubscribe` for
// CPU runs (--cpu, or when no GPU is visible), and passes the environment through unchanged: Open MPI forwards the
// caller's environment to local ranks, and every SHARDLINE_*, NCCL_* and NVLink-multicast switch present is also
// named with `-x` so it reaches ranks on other nodes too (NCCL_NVLS_ENABLE=0 must reach every rank on the GPU hosts).
// --cpu additionally sets SHARDLINE_BACKEND=cpu for the ranks. Exit code: mpirun's, or 127 when mpirun is missing.

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <unistd.h>

#include <shardline/core/device.h>
#include <shardline/core/env.h>

extern char **environ;

namespace {

#ifndef SHARDLINE_MPIEXEC
#define SHARDLINE_MPIEXEC ""
#endif

bool IsExecutable(const std::string &path) { return !path.empty() && access(path.c_str(), X_OK) == 0; }

// SHARDLINE_MPIRUN when set (used as given), else `mpirun` on PATH, else the mpiexec found at configure time.
std::string FindMpirun() {
    if (const auto env = shardline::env::Get("SHARDLINE_MPIRUN")) {
        return IsExecutable(*env) ? *env : std::string();
    }
    if (const char *path = std::getenv("PATH"); path != nullptr) {
        std::string_view rest(path);
        while (true) {
            const auto colon = rest.find(':');
            std::string dir(rest.substr(0, colon));
            if (dir.empty()) {
                dir = ".";
            }
            if (const std::string candidate = dir + "/mpirun"; IsExecutable(candidate)) {
                return candidate;
            }
            if (colon == std::string_view::npos) {
                break;
            }
            rest.remove_prefix(colon + 1);
        }
    }
    return IsExecutable(SHARDLINE_MPIEXEC) ? std::string(SHARDLINE_MPIEXEC) : std::string();
}

// Variables named with -x so they also reach remote ranks (local ranks inherit the whole environment anyway).
bool Forwarded(std::string_view name) {
    static constexpr std::string_view kPrefixes[] = {"SHARDLINE_", "NCCL_", "CUDA_VISIBLE_DEVICES",
                                                     "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"};
    for (std::string_view p : kPrefixes) {
        if (name.starts_with(p)) {
            return true;
        }
    }
    return false;
}

std::string Quote(const std::string &s) {
    if (!s.empty() && s.find_first_of(" \t\n'\"\\$`*?[]{}();&|<>!#~") == std::string::npos) {
        return s;
    }
    std::string q = "'";
    for (char c : s) {
        q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    }
    return q + "'";
}

} // namespace

int main(int argc, char **argv) {
    CLI::App app{"shardline-run: start a shardline program on N ranks through mpirun", "shardline-run"};
    int ranks = 1;
    bool cpu = false;
    double timeout = 0;
    bool dry_run = false;
    std::vector<std::string> command;
    app.add_option("-n,--np", ranks, "number of ranks")->required()->check(CLI::PositiveNumber);
    app.add_flag("--cpu", cpu, "CPU run: MPI backend (SHARDLINE_BACKEND=cpu) and --oversubscribe");
    app.add_option("--timeout", timeout, "mpirun --timeout: end the whole job after S seconds")
        ->check(CLI::PositiveNumber);
    app.add_flag("--dry-run", dry_run, "print the mpirun command line and exit");
    app.add_option("command", command, "PROGRAM ARGS... (after --)")->required();
    app.footer("Example: shardline-run -n 4 --cpu -- ./linear_demo --tp 4\n"
               "Environment: SHARDLINE_MPIRUN overrides the mpirun executable.");
    CLI11_PARSE(app, argc, argv);

    const std::string mpirun = FindMpirun();
    if (mpirun.empty()) {
        std::fprintf(stderr,
                     "shardline-run: mpirun not found (looked at $SHARDLINE_MPIRUN, then PATH, then '%s'); install "
                     "Open MPI (apt install openmpi-bin) or set SHARDLINE_MPIRUN\n",
                     SHARDLINE_MPIEXEC);
        return 127;
    }

    const bool gpu_visible = !cpu && shardline::CudaDeviceCount() > 0;
    std::vector<std::string> args = {mpirun, "-n", std::to_string(ranks), "--bind-to", "none"};
    if (geteuid() == 0) {
        args.emplace_back("--allow-run-as-root");
    }
    if (!gpu_visible) {
        args.emplace_back("--oversubscribe");
    }
    if (timeout > 0) {
        args.emplace_back("--timeout");
        args.emplace_back(std::to_string(static_cast<long>(timeout + 0.999)));
    }
    if (cpu) {
        args.emplace_back("-x");
        args.emplace_back("SHARDLINE_BACKEND=cpu");
    }
    for (char **e = environ; *e != nullptr; ++e) {
        const std::string_view entry(*e);
        const std::string_view name = entry.substr(0, entry.find('='));
        if (Forwarded(name) && !(cpu && name == "SHARDLINE_BACKEND")) {
            args.emplace_back("-x");
            args.emplace_back(name);
        }
    }
    args.insert(args.end(), command.begin(), command.end());

    if (dry_run) {
        std::string line;
        for (const auto &a : args) {
            line += (line.empty() ? "" : " ") + Quote(a);
        }
        std::printf("%s\n", line.c_str());
        return 0;
    }
    std::vector<char *> cargs;
    for (auto &a : args) {
        cargs.push_back(a.data());
    }
    cargs.push_back(nullptr);
    execv(mpirun.c_str(), cargs.data());
    std::fprintf(stderr, "shardline-run: could not execute %s: %s\n", mpirun.c_str(), std::strerror(errno));
    return errno == ENOENT ? 127 : 126;
}
