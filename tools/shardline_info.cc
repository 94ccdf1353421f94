// shardline-info: prints, as JSON, what this copy of shardline was built with and what it sees: version, build
// options, CUDA / cuBLASLt / NCCL / MPI versions, the dtypes and which devices' kernels take them, visible devices, and
// the registered kernels per op, device and provider (with the provider each op would use now).

#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <shardline/config.h>
#include <shardline/core/device.h>
#include <shardline/core/dtype.h>
#include <shardline/core/env.h>
#include <shardline/kernels/ops.h>

#if SHARDLINE_HAVE_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#endif
#if SHARDLINE_WITH_NCCL
#include <nccl.h>
#endif
#if SHARDLINE_WITH_MPI
#include <mpi.h>
#endif

namespace {

using nlohmann::json;

[[maybe_unused]] std::string VersionString(int v, int major_div, int minor_div) {
    return std::to_string(v / major_div) + "." + std::to_string((v % major_div) / minor_div) + "." +
           std::to_string(v % minor_div);
}

json Versions() {
    json v;
    v["shardline"] = SHARDLINE_VERSION;
#if SHARDLINE_HAVE_CUDA
    int runtime = 0;
    int driver = 0;
    v["cuda_runtime"] = cudaRuntimeGetVersion(&runtime) == cudaSuccess ? VersionString(runtime, 1000, 10) : "unknown";
    v["cuda_driver"] =
        cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0 ? VersionString(driver, 1000, 10) : "none";
    v["cublaslt"] = VersionString(static_cast<int>(cublasLtGetVersion()), 10000, 100);
#endif
#if SHARDLINE_WITH_NCCL
    int nccl = 0;
    v["nccl"] = ncclGetVersion(&nccl) == ncclSuccess ? VersionString(nccl, 10000, 100) : "unknown";
    v["nccl_headers"] = VersionString(NCCL_VERSION_CODE, 10000, 100);
#endif
#if SHARDLINE_WITH_MPI
    char mpi[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(mpi, &len); // allowed before MPI_Init
    std::string text(mpi, static_cast<std::size_t>(len));
    if (auto nl = text.find_first_of("\r\n,"); nl != std::string::npos) {
        text.resize(nl);
    }
    v["mpi"] = text;
#endif
    return v;
}

json Devices() {
    json devices = json::array();
#if SHARDLINE_HAVE_CUDA
    const int count = shardline::CudaDeviceCount();
    for (int i = 0; i < count; ++i) {
        cudaDeviceProp prop{};
        if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
            continue;
        }
        devices.push_back({{"index", i},
                           {"name", prop.name},
                           {"compute_capability", std::to_string(prop.major) + "." + std::to_string(prop.minor)},
                           {"multiprocessors", prop.multiProcessorCount},
                           {"memory_bytes", prop.totalGlobalMem}});
    }
#endif
    return devices;
}

/// Every dtype: its size, and the devices whose float kernels take it (int64 is a storage type for ids and labels,
/// read by the embedding and cross-entropy ops, taken by no float kernel).
json DTypes() {
    using shardline::DType;
    json out = json::object();
    for (const DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64, DType::kInt64}) {
        json kernels = json::array();
        if (d == DType::kFloat32 || d == DType::kFloat64) {
            kernels.push_back("cpu");
        }
        if (SHARDLINE_HAVE_CUDA && shardline::IsFloatingPoint(d) && d != DType::kFloat64) {
            kernels.push_back("cuda");
        }
        out[std::string(shardline::DTypeName(d))] = {{"bytes", shardline::ElementSize(d)}, {"float_kernels", kernels}};
    }
    return out;
}

json Kernels() {
    std::map<std::string, json> by_op;
    for (const auto& k : shardline::kernels::RegisteredKernels()) {
        json& entry = by_op[k.op];
        entry["providers"][std::string(shardline::DeviceTypeName(k.device))].push_back(k.provider);
    }
    json out = json::object();
    for (auto& [op, entry] : by_op) {
        entry["selected_provider"] = shardline::kernels::SelectedProvider(op);
        out[op] = entry;
    }
    return out;
}

} // namespace

int main(int argc, char** argv) {
    CLI::App app{"shardline-info: prints, as JSON, what this copy of shardline was built with (version, options, "
                 "CUDA / cuBLASLt / NCCL / MPI versions) and what it sees (dtypes, devices, the registered kernels "
                 "per op, device and provider)",
                 "shardline-info"};
    CLI11_PARSE(app, argc, argv);
    try {
        json info;
        info["versions"] = Versions();
        info["build"] = {{"cuda", static_cast<bool>(SHARDLINE_HAVE_CUDA)},
                         {"nccl", static_cast<bool>(SHARDLINE_WITH_NCCL)},
                         {"mpi", static_cast<bool>(SHARDLINE_WITH_MPI)}};
        info["environment"] = json::object();
        for (const char* name :
             {"SHARDLINE_PROVIDER", "SHARDLINE_LINEAR_IMPL", "SHARDLINE_ALLOW_TF32", "SHARDLINE_CUBLASLT_WORKSPACE_MB",
              "SHARDLINE_CUDA_BLOCK_CACHE", "SHARDLINE_LOG_LEVEL", "NCCL_NVLS_ENABLE"}) {
            if (const auto v = shardline::env::Get(name)) {
                info["environment"][name] = *v;
            }
        }
        info["dtypes"] = DTypes();
        info["devices"] = Devices();
        info["kernels"] = Kernels();
        std::cout << info.dump(2) << "\n";
        return 0;
    } catch (const std::exception& e) {
        std::cerr << "shardline-info: " << e.what() << "\n";
        return 1;
    }
}
