// shardline-spmd-mpi-probe: measures MPI collectives on CPU buffers and prints a cost profile for shardline-spmd
// (docs/spmd.md 7): call_us, alpha_us and bandwidth_gb_per_s fitted to the planner's cost formula, flops_per_us from
// cblas_sgemm. Run with the ranks of the mesh dim it should describe, e.g.
//     mpirun -n 2 shardline-spmd-mpi-probe > mpi_cpu.json
// Each size: 5 warm-ups, then `--iters` timed calls per round, 3 rounds; a call's time is the slowest rank's
// (MPI_MAX), the figure the median over calls and rounds.

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include <cblas.h>
#include <mpi.h>

namespace {

enum class Op { kAllReduce, kAllGather, kReduceScatter };

const char *Name(Op op) {
    switch (op) {
    case Op::kAllReduce:
        return "all_reduce";
    case Op::kAllGather:
        return "all_gather";
    case Op::kReduceScatter:
        return "reduce_scatter";
    }
    return "?";
}

struct Point {
    Op op;
    long long bytes = 0;  ///< the full tensor (all_reduce input, all_gather output, reduce_scatter input)
    double steps = 0;     ///< ring steps of the planner's formula
    double bus_bytes = 0; ///< bytes per rank of the planner's formula
    double median_us = 0;
};

double Median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

/// One timed call of `op` on `bytes` (a multiple of 4 * n).
double TimeCall(Op op, std::vector<float> &in, std::vector<float> &out, int n) {
    const int count = static_cast<int>(in.size());
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    switch (op) {
    case Op::kAllReduce:
        MPI_Allreduce(in.data(), out.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    case Op::kAllGather:
        MPI_Allgather(in.data(), count / n, MPI_FLOAT, out.data(), count / n, MPI_FLOAT, MPI_COMM_WORLD);
        break;
    case Op::kReduceScatter:
        MPI_Reduce_scatter_block(in.data(), out.data(), count / n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    }
    double us = (MPI_Wtime() - start) * 1e6;
    MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return us;
}

/// Least squares for t = call + steps * alpha + bus_bytes / (bw * 1e3), each equation divided by its t (relative
/// errors: small and large messages weigh alike). Returns {call_us, alpha_us, bandwidth_gb_per_s}.
std::array<double, 3> Fit(const std::vector<Point> &points) {
    double a[3][4] = {};
    for (const Point &p : points) {
        const double row[3] = {1.0 / p.median_us, p.steps / p.median_us, p.bus_bytes / 1e3 / p.median_us};
        for (int i = 0; i < 3; ++i) {
            for (int j = 0; j < 3; ++j) {
                a[i][j] += row[i] * row[j];
            }
            a[i][3] += row[i] * 1.0;
        }
    }
    for (int c = 0; c < 3; ++c) {
        int pivot = c;
        for (int r = c + 1; r < 3; ++r) {
            if (std::abs(a[r][c]) > std::abs(a[pivot][c])) {
                pivot = r;
            }
        }
        std::swap(a[c], a[pivot]);
        for (int r = 0; r < 3; ++r) {
            if (r != c) {
                const double f = a[r][c] / a[c][c];
                for (int k = c; k < 4; ++k) {
                    a[r][k] -= f * a[c][k];
                }
            }
        }
    }
    const double call = a[0][3] / a[0][0];
    const double alpha = a[1][3] / a[1][1];
    const double inverse_bw = a[2][3] / a[2][2];
    return {call, alpha, 1.0 / inverse_bw};
}

double SgemmFlopsPerUs() {
    const int m = 512;
    std::vector<float> a(m * m, 1.0f), b(m * m, 0.5f), c(m * m, 0.0f);
    std::vector<double> us;
    for (int i = 0; i < 7; ++i) {
        const auto start = std::chrono::steady_clock::now();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.0f, a.data(), m, b.data(), m, 0.0f, c.data(),
                    m);
        us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    }
    return 2.0 * m * m * m / Median(us);
}

std::string CpuModel() {
    std::ifstream cpuinfo("/proc/cpuinfo");
    std::string line;
    while (std::getline(cpuinfo, line)) {
        if (line.rfind("model name", 0) == 0) {
            return line.substr(line.find(':') + 2);
        }
    }
    return "unknown CPU";
}

} // namespace

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank = 0;
    int n = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    int iters = 20;
    for (int i = 1; i + 1 < argc; ++i) {
        if (std::strcmp(argv[i], "--iters") == 0) {
            iters = std::max(1, std::atoi(argv[i + 1]));
        }
    }
    if (n < 2) {
        std::fprintf(stderr, "shardline-spmd-mpi-probe: run with at least 2 ranks (mpirun -n 2 ...)\n");
        MPI_Finalize();
        return 1;
    }
    std::vector<Point> points;
    for (long long bytes = 4LL * 16; bytes <= (64LL << 20); bytes *= 8) {
        const long long count = bytes / 4 / n * n;
        for (Op op : {Op::kAllReduce, Op::kAllGather, Op::kReduceScatter}) {
            std::vector<float> in(static_cast<size_t>(count), 1.0f);
            std::vector<float> out(static_cast<size_t>(op == Op::kReduceScatter ? count / n : count), 0.0f);
            if (op == Op::kAllGather) {
                in.resize(static_cast<size_t>(count)); // only the first count / n are sent
            }
            for (int w = 0; w < 5; ++w) {
                TimeCall(op, in, out, n);
            }
            std::vector<double> times;
            for (int round = 0; round < 3; ++round) {
                for (int i = 0; i < iters; ++i) {
                    times.push_back(TimeCall(op, in, out, n));
                }
            }
            Point p{op, count * 4};
            const double share = static_cast<double>(count * 4) / n;
            p.steps = op == Op::kAllReduce ? 2.0 * (n - 1) : n - 1;
            p.bus_bytes = op == Op::kAllReduce ? 2.0 * (n - 1) * share : (n - 1) * share;
            p.median_us = Median(times);
            points.push_back(p);
        }
    }
    if (rank == 0) {
        const auto [call, alpha, bw] = Fit(points);
        const double flops = SgemmFlopsPerUs();
        char date[32];
        const std::time_t now = std::time(nullptr);
        std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
        std::printf("{\n  \"name\": \"mpi_cpu\",\n");
        std::printf("  \"description\": \"MPI collectives on CPU float32 buffers, %d ranks on one host (%s), %s; "
                    "shardline-spmd-mpi-probe: medians of the slowest rank per call, fitted by relative least "
                    "squares; flops_per_us from a 512^3 cblas_sgemm\",\n",
                    n, CpuModel().c_str(), date);
        std::printf("  \"call_us\": %.3g,\n  \"alpha_us\": %.3g,\n  \"bandwidth_gb_per_s\": %.3g,\n", call,
                    std::max(alpha, 0.0), bw);
        std::printf("  \"flops_per_us\": %.3g,\n  \"measurements\": [\n", flops);
        for (size_t i = 0; i < points.size(); ++i) {
            const Point &p = points[i];
            std::printf("    {\"op\": \"%s\", \"bytes\": %lld, \"us\": %.4g}%s\n", Name(p.op), p.bytes, p.median_us,
                        i + 1 < points.size() ? "," : "");
        }
        std::printf("  ]\n}\n");
    }
    MPI_Finalize();
    return 0;
}
