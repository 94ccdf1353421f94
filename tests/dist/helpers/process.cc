#include "process.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

namespace shardline::testing {

ProcessResult RunProcess(const std::vector<std::string> &argv, const std::vector<std::string> &extra_env,
                         std::chrono::milliseconds deadline) {
    ProcessResult result;
    int fds[2];
    if (pipe(fds) != 0) {
        result.output = std::string("pipe failed: ") + std::strerror(errno);
        return result;
    }
    const auto start = std::chrono::steady_clock::now();
    const pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        dup2(fds[1], STDOUT_FILENO);
        dup2(fds[1], STDERR_FILENO);
        close(fds[0]);
        close(fds[1]);
        for (const auto &kv : extra_env) {
            const auto eq = kv.find('=');
            setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
        }
        std::vector<char *> args;
        for (const auto &a : argv) {
            args.push_back(const_cast<char *>(a.c_str()));
        }
        args.push_back(nullptr);
        execv(args[0], args.data());
        std::fprintf(stderr, "execv %s failed: %s\n", args[0], std::strerror(errno));
        std::_Exit(126);
    }
    close(fds[1]);
    setpgid(pid, pid);
    char buffer[4096];
    int status = 0;
    bool exited = false;
    std::chrono::steady_clock::time_point end{};
    // Read until the launcher has exited (a stopped or orphaned rank may hold the pipe open much longer), then drain
    // what is left for a moment.
    while (true) {
        const auto now = std::chrono::steady_clock::now();
        if (!exited && waitpid(pid, &status, WNOHANG) == pid) {
            exited = true;
            end = now;
            result.end_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count();
        }
        if (exited && now - end > std::chrono::milliseconds(300)) {
            break;
        }
        if (!exited && now - start > deadline) {
            result.timed_out = true;
            kill(-pid, SIGKILL);
            waitpid(pid, &status, 0);
            exited = true;
            end = std::chrono::steady_clock::now();
            continue;
        }
        pollfd p{.fd = fds[0], .events = POLLIN, .revents = 0};
        if (poll(&p, 1, 20) > 0) {
            const ssize_t got = read(fds[0], buffer, sizeof buffer);
            if (got > 0) {
                result.output.append(buffer, static_cast<std::size_t>(got));
            } else if (got == 0 && exited) {
                break; // every writer has closed the pipe
            } else if (got == 0) {
                usleep(1000);
            }
        }
    }
    result.seconds = std::chrono::duration<double>(end - start).count();
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    close(fds[0]);
    return result;
}

} // namespace shardline::testing
