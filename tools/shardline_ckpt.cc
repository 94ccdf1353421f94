// shardline-ckpt: looks into a checkpoint directory (ckpt/checkpoint.h) without MPI or GPUs.
//
//   shardline-ckpt inspect DIR [--json]          tensors, shapes, dtypes, meshes, layouts, sizes, checksum status
//   shardline-ckpt export DIR --format safetensors OUT   every tensor full, in one safetensors file
//   shardline-ckpt diff DIR1 DIR2                the tensors of two checkpoints, bitwise (exit 1 when any differs)
//
// DIR may be a checkpoint or a root with a `latest` pointer. Exit status: 0 sound / equal, 1 a problem was found,
// 2 usage or unreadable input (the message names the file).

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <shardline/ckpt/checkpoint.h>
#include <shardline/ckpt/metadata.h>
#include <shardline/core/error.h>

namespace {

using namespace shardline;
namespace fs = std::filesystem;

std::string Bytes(std::int64_t n) {
    if (n >= (std::int64_t{1} << 30)) {
        return fmt::format("{:.2f} GiB", static_cast<double>(n) / (1 << 30));
    }
    if (n >= (1 << 20)) {
        return fmt::format("{:.2f} MiB", static_cast<double>(n) / (1 << 20));
    }
    return fmt::format("{} B", n);
}

int Inspect(const std::string &path, bool as_json) {
    const std::string dir = ckpt::ResolveCheckpoint(path);
    const ckpt::Metadata m = ckpt::ReadMetadata(dir);
    const std::vector<std::string> problems = ckpt::VerifyCheckpoint(dir, m);
    // Partial saves a crash left behind (never loaded: `latest` names committed ones only).
    std::vector<std::string> partial;
    const fs::path root = fs::path(dir).parent_path();
    if (fs::exists(root)) {
        for (const auto &entry : fs::directory_iterator(root)) {
            const std::string name = entry.path().filename().string();
            if (entry.is_directory() && name.rfind(".tmp_", 0) == 0) {
                partial.push_back(name);
            }
        }
    }
    if (as_json) {
        nlohmann::ordered_json j = ckpt::ToJson(m);
        j["path"] = dir;
        j["checksums"] = problems.empty() ? "ok" : "FAILED";
        j["problems"] = problems;
        j["uncommitted"] = partial;
        std::cout << j.dump(2) << "\n";
        return problems.empty() ? 0 : 1;
    }
    std::int64_t total = 0;
    fmt::print("checkpoint {} (step {}, format {}, shardline {}, saved by {} ranks, {} files, blocks of {})\n", dir,
               m.step, m.format_version, m.library_version, m.world_size, m.files.size(), Bytes(m.block_bytes));
    fmt::print("{:<40} {:>16} {:>9} {:>14} {:>16} {:>7} {:>12}\n", "tensor", "shape", "dtype", "mesh", "layout",
               "shards", "size");
    for (const ckpt::TensorRecord &t : m.tensors) {
        const std::string mesh = t.mesh_shape.empty() ? std::string("local")
                                                      : fmt::format("{}[{}]", fmt::join(t.mesh_dim_names, "x"),
                                                                    fmt::join(t.mesh_shape, "x"));
        fmt::print("{:<40} {:>16} {:>9} {:>14} {:>16} {:>7} {:>12}\n", t.name,
                   fmt::format("[{}]", fmt::join(t.shape, ",")), DTypeName(t.dtype), mesh, t.layout, t.shards.size(),
                   Bytes(t.nbytes()));
        total += t.nbytes();
    }
    fmt::print("{} tensors, {}; checksums: {}\n", m.tensors.size(), Bytes(total),
               problems.empty() ? "ok (every block verified)" : fmt::format("{} problem(s)", problems.size()));
    for (const std::string &p : problems) {
        fmt::print("  {}\n", p);
    }
    for (const std::string &p : partial) {
        fmt::print("uncommitted (a save that crashed before its commit; ignored by loads): {}\n", p);
    }
    if (!m.extra.empty()) {
        fmt::print("extra: {}\n", m.extra.dump());
    }
    return problems.empty() ? 0 : 1;
}

int Diff(const std::string &a_path, const std::string &b_path) {
    const std::string a_dir = ckpt::ResolveCheckpoint(a_path);
    const std::string b_dir = ckpt::ResolveCheckpoint(b_path);
    const ckpt::Metadata a = ckpt::ReadMetadata(a_dir);
    const ckpt::Metadata b = ckpt::ReadMetadata(b_dir);
    int differ = 0;
    for (const ckpt::TensorRecord &t : a.tensors) {
        const ckpt::TensorRecord *u = b.Find(t.name);
        if (u == nullptr) {
            fmt::print("{}: only in {}\n", t.name, a_dir);
            ++differ;
            continue;
        }
        if (u->shape != t.shape || u->dtype != t.dtype) {
            fmt::print("{}: [{}] {} vs [{}] {}\n", t.name, fmt::join(t.shape, ","), DTypeName(t.dtype),
                       fmt::join(u->shape, ","), DTypeName(u->dtype));
            ++differ;
            continue;
        }
        const Tensor x = ckpt::ReadFullTensor(a_dir, a, t);
        const Tensor y = ckpt::ReadFullTensor(b_dir, b, *u);
        if (std::memcmp(x.data(), y.data(), x.nbytes()) != 0) {
            const std::vector<double> xv = x.ToDoubleVector();
            const std::vector<double> yv = y.ToDoubleVector();
            double worst = 0;
            std::int64_t count = 0;
            for (std::size_t i = 0; i < xv.size(); ++i) {
                if (xv[i] != yv[i]) {
                    ++count;
                    worst = std::max(worst, std::fabs(xv[i] - yv[i]));
                }
            }
            fmt::print("{}: {} of {} elements differ, max |difference| {:.3e}\n", t.name, count, xv.size(), worst);
            ++differ;
        }
    }
    for (const ckpt::TensorRecord &u : b.tensors) {
        if (a.Find(u.name) == nullptr) {
            fmt::print("{}: only in {}\n", u.name, b_dir);
            ++differ;
        }
    }
    fmt::print("{} tensors compared: {}\n", a.tensors.size(),
               differ == 0 ? std::string("bitwise equal") : fmt::format("{} differ", differ));
    return differ == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char **argv) {
    CLI::App app{"shardline-ckpt: inspect, verify, export and compare shardline checkpoints"};
    app.require_subcommand(1);
    std::string dir;
    std::string other;
    std::string out;
    std::string format = "safetensors";
    bool as_json = false;
    CLI::App *inspect = app.add_subcommand("inspect", "tensors, shapes, layouts, sizes and checksum status");
    inspect->add_option("DIR", dir, "checkpoint directory (or a root with `latest`)")->required();
    inspect->add_flag("--json", as_json, "the metadata and the verification as JSON");
    CLI::App *exp = app.add_subcommand("export", "write every tensor, full, in another format");
    exp->add_option("DIR", dir, "checkpoint directory (or a root with `latest`)")->required();
    exp->add_option("OUT", out, "output file")->required();
    exp->add_option("--format", format, "safetensors")->check(CLI::IsMember({"safetensors"}));
    CLI::App *diff = app.add_subcommand("diff", "compare the tensors of two checkpoints bitwise");
    diff->add_option("DIR1", dir, "checkpoint")->required();
    diff->add_option("DIR2", other, "checkpoint")->required();
    CLI11_PARSE(app, argc, argv);
    try {
        if (*inspect) {
            return Inspect(dir, as_json);
        }
        if (*exp) {
            ckpt::ExportSafetensors(ckpt::ResolveCheckpoint(dir), out);
            fmt::print("wrote {}\n", out);
            return 0;
        }
        return Diff(dir, other);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "shardline-ckpt: %s\n", e.what());
        return 2;
    }
}
