// ckpt_bench: save and load GB/s of a large model through ckpt::Save / ckpt::Load (one process, world = nullptr), and
// the training stall of an async save against the plain device-to-host copy of the same bytes. The disk's own
// sequential write/read speed is measured by run_ckpt_bench.sh in the same command (dd). One JSON line per run.
//
//   ckpt_bench --dir /nvme/ckpt --gb 4 [--tensors 64] [--dtype bf16] [--device cuda]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
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
    for (int r = 0; r < repeats; ++r) {
        std::filesystem::remove_all(dir);
        auto start = Clock::now();
        ckpt::Save(dir, 1, tensors, {}, nullptr);
        save_s = std::min(save_s, Seconds(start));
        dropped = DropPageCache();
        start = Clock::now();
        ckpt::Load(dir, tensors, nullptr);
        Synchronize(device);
        load_s = std::min(load_s, Seconds(start));
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
                                {"async_stall_ms", stall_s * 1e3},
                                {"d2h_copy_ms", copy_s * 1e3},
                                {"stall_over_copy", copy_s > 0 ? stall_s / copy_s : 0.0}};
    std::printf("%s\n", out.dump().c_str());
    return 0;
}
