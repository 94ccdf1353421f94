// ckpt_bench: save and load GB/s of a large model through ckpt::Save / ckpt::Load (one process, world = nullptr), and
// the training stall of an async save against the plain device-to-host copy of the same bytes. The disk's own
// sequential write/read speed is measured by run_ckpt_bench.sh in the same command (dd). One JSON line per run, with
// the phases of the best save and load (CheckpointInfo::timings) and how the load was kept off the page cache: the
// cache dropped (root), else the save's own posix_fadvise(DONTNEED) after its fsync, checked with mincore(2)
// ("resident_before_load": the fraction of the checkpoint's pages in memory when the load starts; ~0 is honest).
//
//   ckpt_bench --dir /nvme/ckpt --gb 4 [--tensors 64] [--dtype bf16] [--device cpu|cuda|auto]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <shardline/ckpt/checkpoint.h>
#include <shardline/config.h>
#include <shardline/core/context.h>
#include <shardline/core/random.h>
#include <shardline/core/tensor.h>

#if SHARDLINE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "common/bench_util.h"

namespace {

using namespace shardline;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

/// Drops the page cache so the load reads the disk (root only; reports whether it could).
bool DropPageCache() {
    std::ofstream f("/proc/sys/vm/drop_caches");
    if (!f.good()) {
        return false;
    }
    ::sync();
    f << "3\n";
    return f.good();
}

/// The fraction of the pages of the files under `dir` that are in the page cache (mincore of a read-only mapping).
double ResidentFraction(const std::string &dir) {
    const long page = ::sysconf(_SC_PAGESIZE);
    std::int64_t pages = 0;
    std::int64_t resident = 0;
    for (const auto &entry : std::filesystem::recursive_directory_iterator(dir)) {
        if (!entry.is_regular_file() || entry.file_size() == 0) {
            continue;
        }
        const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            continue;
        }
        const std::size_t bytes = entry.file_size();
        void *map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
        ::close(fd);
        if (map == MAP_FAILED) {
            continue;
        }
        std::vector<unsigned char> in((bytes + static_cast<std::size_t>(page) - 1) / static_cast<std::size_t>(page));
        if (::mincore(map, bytes, in.data()) == 0) {
            pages += static_cast<std::int64_t>(in.size());
            for (unsigned char c : in) {
                resident += c & 1;
            }
        }
        ::munmap(map, bytes);
    }
    return pages > 0 ? static_cast<double>(resident) / static_cast<double>(pages) : 0.0;
}

} // namespace

int main(int argc, char **argv) {
    CLI::App app{"ckpt_bench: checkpoint save/load GB/s and async-save stall"};
    std::string dir;
    double gb = 4.0;
    int count = 64;
    std::string dtype_name = "bf16";
    std::string device_name = "auto";
    int repeats = 2;
    int stall_repeats = 5;
    app.add_option("--dir", dir, "directory on the disk to measure (emptied)")->required();
    app.add_option("--gb", gb, "model size in GiB");
    app.add_option("--tensors", count, "number of tensors");
    app.add_option("--dtype", dtype_name, "bf16, fp16, fp32");
    app.add_option("--device", device_name, "auto, cpu, cuda");
    app.add_option("--repeats", repeats, "timed repetitions of save and load (the best is reported)");
    app.add_option("--stall-repeats", stall_repeats, "async saves and plain copies timed (the medians are reported)")
        ->check(CLI::PositiveNumber);
    CLI11_PARSE(app, argc, argv);

    const DType dtype = ParseDType(dtype_name);
    const bool cuda = device_name == "cuda" || (device_name == "auto" && CudaDeviceCount() > 0);
    const Device device = cuda ? Device::CUDA(0) : Device::CPU();
    const std::int64_t cols = 4096;
    const std::int64_t total =
        static_cast<std::int64_t>(gb * (1 << 30)) / static_cast<std::int64_t>(ElementSize(dtype));
    const std::int64_t rows = total / cols / count;
    ckpt::TensorList tensors;
    for (int i = 0; i < count; ++i) {
        Tensor t = Tensor::Empty({rows, cols}, dtype, device);
        FillRandom(t, RandomSpec{.seed = 1, .name = fmt::format("w{}", i)});
        tensors.emplace_back(fmt::format("layer{}.weight", i), dist::DistTensor::Local(t));
    }
    Synchronize(device);
    const double bytes = static_cast<double>(rows * cols * count) * static_cast<double>(ElementSize(dtype));
    const double gib = bytes / (1 << 30);

    double save_s = 1e30;
    double load_s = 1e30;
    bool dropped = false;
    double resident = 1.0;
    nlohmann::json save_phases;
    nlohmann::json load_phases;
    for (int r = 0; r < repeats; ++r) {
        std::filesystem::remove_all(dir);
        Synchronize(device);
        auto start = Clock::now();
        const ckpt::CheckpointInfo saved = ckpt::Save(dir, 1, tensors, {}, nullptr);
        const double s = Seconds(start);
        if (s < save_s) {
            save_s = s;
            save_phases = saved.timings;
        }
        dropped = DropPageCache();
        const double resident_now = ResidentFraction(dir);
        start = Clock::now();
        const ckpt::CheckpointInfo loaded = ckpt::Load(dir, tensors, nullptr);
        Synchronize(device);
        const double l = Seconds(start);
        if (l < load_s) {
            load_s = l;
            load_phases = loaded.timings;
            resident = resident_now;
        }
    }

    // The async save's stall (Save() returning) against the plain device-to-host copy of the same bytes into pinned
    // memory: the median of `stall_repeats` of each, taken alternately after one warm-up of each (the saver's pinned
    // buffer and the copy's buffer allocated and touched), so one slow sample (the page cache's writeback of the
    // previous save, another process) neither hides nor fakes a miss. The samples are in the JSON.
    std::vector<double> copy_samples;
    std::vector<double> stall_samples;
    std::vector<double> snapshot_samples;
    std::filesystem::remove_all(dir);
    ckpt::AsyncSaver saver(nullptr);
    saver.Save(dir, 0, tensors, {}); // warm-up: allocates the pinned buffer
    saver.Wait();
#if SHARDLINE_HAVE_CUDA
    void *pinned = nullptr;
    if (cuda && cudaMallocHost(&pinned, static_cast<std::size_t>(bytes)) != cudaSuccess) {
        pinned = nullptr;
    }
    const auto plain_copy = [&] {
        const auto start = Clock::now();
        char *p = static_cast<char *>(pinned);
        const auto stream = static_cast<cudaStream_t>(CudaContext::Get(0).stream());
        for (const auto &entry : tensors) {
            const Tensor &t = entry.second.local();
            cudaMemcpyAsync(p, t.data(), t.nbytes(), cudaMemcpyDeviceToHost, stream);
            p += t.nbytes();
        }
        cudaStreamSynchronize(stream);
        return Seconds(start);
    };
    if (pinned != nullptr) {
        (void)plain_copy(); // warm-up
    }
#endif
    for (int i = 1; i <= stall_repeats; ++i) {
#if SHARDLINE_HAVE_CUDA
        if (pinned != nullptr) {
            copy_samples.push_back(plain_copy());
        }
#endif
        const auto start = Clock::now();
        saver.Save(dir, i, tensors, {});
        stall_samples.push_back(Seconds(start));
        snapshot_samples.push_back(saver.last_snapshot_seconds());
        saver.Wait();
    }
#if SHARDLINE_HAVE_CUDA
    if (pinned != nullptr) {
        cudaFreeHost(pinned);
    }
#endif
    std::filesystem::remove_all(dir);
    const double stall_s = bench::Percentile(stall_samples, 0.5);
    const double copy_s = bench::Percentile(copy_samples, 0.5);
    const auto ms = [](std::vector<double> v) {
        for (double &x : v) {
            x *= 1e3;
        }
        return v;
    };

    const nlohmann::json out = {{"bench", "ckpt"},
                                {"device", cuda ? "cuda" : "cpu"},
                                {"dtype", dtype_name},
                                {"gib", gib},
                                {"tensors", count},
                                {"save_gib_per_s", gib / save_s},
                                {"load_gib_per_s", gib / load_s},
                                {"page_cache_dropped_before_load", dropped},
                                {"load_cache_state", dropped ? "page cache dropped before the load (root)"
                                                             : "not root: the save evicted its files (posix_fadvise "
                                                               "DONTNEED after fsync); see resident_before_load"},
                                {"resident_before_load", resident},
                                {"save_phases", save_phases},
                                {"load_phases", load_phases},
                                {"async_stall_ms", stall_s * 1e3},
                                {"d2h_copy_ms", copy_s * 1e3},
                                {"async_stall_samples_ms", ms(stall_samples)},
                                {"async_snapshot_samples_ms", ms(snapshot_samples)},
                                {"d2h_copy_samples_ms", ms(copy_samples)},
                                {"stall_over_copy", copy_s > 0 ? stall_s / copy_s : 0.0}};
    std::printf("%s\n", out.dump().c_str());
    return 0;
}
