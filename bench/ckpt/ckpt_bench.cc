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
    app.add_option("--dir", dir, "directory on the disk to measure (emptied)")->required();
    app.add_option("--gb", gb, "model size in GiB");
    app.add_option("--tensors", count, "number of tensors");
    app.add_option("--dtype", dtype_name, "bf16, fp16, fp32");
    app.add_option("--device", device_name, "auto, cpu, cuda");
    app.add_option("--repeats", repeats, "timed repetitions (the best is reported)");
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

    // The async save's stall (Save() returning) against the plain device-to-host copy into pinned memory.
    double copy_s = 0;
#if SHARDLINE_HAVE_CUDA
    if (cuda) {
        void *pinned = nullptr;
        if (cudaMallocHost(&pinned, static_cast<std::size_t>(bytes)) == cudaSuccess) {
            const auto start = Clock::now();
            char *p = static_cast<char *>(pinned);
            for (const auto &entry : tensors) {
                const Tensor &t = entry.second.local();
                cudaMemcpyAsync(p, t.data(), t.nbytes(), cudaMemcpyDeviceToHost,
                                static_cast<cudaStream_t>(CudaContext::Get(0).stream()));
                p += t.nbytes();
            }
            cudaStreamSynchronize(static_cast<cudaStream_t>(CudaContext::Get(0).stream()));
            copy_s = Seconds(start);
            cudaFreeHost(pinned);
        }
    }
#endif
    std::filesystem::remove_all(dir);
    ckpt::AsyncSaver saver(nullptr);
    saver.Save(dir, 1, tensors, {}); // first save: allocates the pinned buffer
    saver.Wait();
    auto start = Clock::now();
    saver.Save(dir, 2, tensors, {});
    const double stall_s = Seconds(start);
    saver.Wait();
    std::filesystem::remove_all(dir);

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
                                {"stall_over_copy", copy_s > 0 ? stall_s / copy_s : 0.0}};
    std::printf("%s\n", out.dump().c_str());
    return 0;
}
