#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>

#include <shardline/ckpt/metadata.h>
#include <shardline/core/error.h>

#include "io.h"

namespace shardline::ckpt {
namespace {

template <class T>
T Field(const nlohmann::json &j, const char *key, const std::string &source, const std::string &where) {
    SHARDLINE_CHECK(j.is_object() && j.contains(key), "ckpt::ReadMetadata", "'{}': {} has no field '{}'", source, where,
                    key);
    try {
        return j.at(key).get<T>();
    } catch (const nlohmann::json::exception &e) {
        SHARDLINE_THROW(Error, "ckpt::ReadMetadata", "'{}': field '{}' of {} is malformed: {}", source, key, where,
                        e.what());
    }
}

std::string SafetensorsDType(DType dtype) {
    switch (dtype) {
    case DType::kFloat32:
        return "F32";
    case DType::kFloat16:
        return "F16";
    case DType::kBFloat16:
        return "BF16";
    case DType::kFloat64:
        return "F64";
    case DType::kInt64:
        return "I64";
    }
    return "?";
}

} // namespace

std::int64_t TensorRecord::nbytes() const {
    std::int64_t n = 1;
    for (std::int64_t d : shape) {
        n *= d;
    }
    return n * static_cast<std::int64_t>(ElementSize(dtype));
}

const TensorRecord *Metadata::Find(const std::string &name) const {
    for (const TensorRecord &t : tensors) {
        if (t.name == name) {
            return &t;
        }
    }
    return nullptr;
}

nlohmann::ordered_json ToJson(const Metadata &m) {
    nlohmann::ordered_json j;
    j["format"] = "shardline-checkpoint";
    j["format_version"] = m.format_version;
    j["library_version"] = m.library_version;
    j["step"] = m.step;
    j["world_size"] = m.world_size;
    j["block_bytes"] = m.block_bytes;
    // The saving job's mesh(es), for readers; each tensor names its own below (the load needs only those).
    j["meshes"] = nlohmann::ordered_json::array();
    for (const TensorRecord &t : m.tensors) {
        const nlohmann::ordered_json mesh = {{"shape", t.mesh_shape}, {"dim_names", t.mesh_dim_names}};
        if (!t.mesh_shape.empty() && std::find(j["meshes"].begin(), j["meshes"].end(), mesh) == j["meshes"].end()) {
            j["meshes"].push_back(mesh);
        }
    }
    j["files"] = nlohmann::ordered_json::array();
    for (const FileRecord &f : m.files) {
        j["files"].push_back({{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}});
    }
    j["tensors"] = nlohmann::ordered_json::object();
    for (const TensorRecord &t : m.tensors) {
        nlohmann::ordered_json tj;
        tj["shape"] = t.shape;
        tj["dtype"] = std::string(DTypeName(t.dtype));
        if (t.mesh_shape.empty()) {
            tj["mesh"] = nullptr;
        } else {
            tj["mesh"] = {{"shape", t.mesh_shape}, {"dim_names", t.mesh_dim_names}};
        }
        tj["layout"] = t.layout;
        tj["shards"] = nlohmann::ordered_json::array();
        for (const ShardRecord &s : t.shards) {
            tj["shards"].push_back({{"offset", s.offset},
                                    {"shape", s.shape},
                                    {"file", s.file},
                                    {"byte_offset", s.byte_offset},
                                    {"length", s.length},
                                    {"crc32", s.block_crc32}});
        }
        j["tensors"][t.name] = std::move(tj);
    }
    j["extra"] = m.extra;
    return j;
}

Metadata MetadataFromJson(const nlohmann::json &j, const std::string &source) {
    Metadata m;
    SHARDLINE_CHECK(j.is_object() && j.value("format", std::string()) == "shardline-checkpoint", "ckpt::ReadMetadata",
                    "'{}' is not a shardline checkpoint's metadata (\"format\": \"shardline-checkpoint\" expected)",
                    source);
    m.format_version = Field<int>(j, "format_version", source, "the checkpoint");
    SHARDLINE_CHECK(m.format_version == kFormatVersion, "ckpt::ReadMetadata",
                    "'{}': format_version {} expected, got {} (written by shardline {})", source, kFormatVersion,
                    m.format_version, j.value("library_version", std::string("?")));
    m.library_version = Field<std::string>(j, "library_version", source, "the checkpoint");
    m.step = Field<std::int64_t>(j, "step", source, "the checkpoint");
    m.world_size = Field<int>(j, "world_size", source, "the checkpoint");
    m.block_bytes = Field<std::int64_t>(j, "block_bytes", source, "the checkpoint");
    SHARDLINE_CHECK(m.block_bytes > 0, "ckpt::ReadMetadata", "'{}': block_bytes must be positive, got {}", source,
                    m.block_bytes);
    for (const auto &f : Field<nlohmann::json>(j, "files", source, "the checkpoint")) {
        m.files.push_back({.name = Field<std::string>(f, "name", source, "a file"),
                           .rank = Field<int>(f, "rank", source, "a file"),
                           .bytes = Field<std::int64_t>(f, "bytes", source, "a file")});
    }
    const nlohmann::json tensors = Field<nlohmann::json>(j, "tensors", source, "the checkpoint");
    SHARDLINE_CHECK(tensors.is_object(), "ckpt::ReadMetadata", "'{}': \"tensors\" must be an object", source);
    for (auto it = tensors.begin(); it != tensors.end(); ++it) {
        const std::string where = fmt::format("tensor '{}'", it.key());
        const nlohmann::json &tj = it.value();
        TensorRecord t;
        t.name = it.key();
        t.shape = Field<std::vector<std::int64_t>>(tj, "shape", source, where);
        t.dtype = ParseDType(Field<std::string>(tj, "dtype", source, where));
        if (tj.contains("mesh") && !tj.at("mesh").is_null()) {
            t.mesh_shape = Field<std::vector<std::int64_t>>(tj.at("mesh"), "shape", source, where + "'s mesh");
            t.mesh_dim_names = Field<std::vector<std::string>>(tj.at("mesh"), "dim_names", source, where + "'s mesh");
        }
        t.layout = Field<std::string>(tj, "layout", source, where);
        for (const auto &sj : Field<nlohmann::json>(tj, "shards", source, where)) {
            ShardRecord s{.offset = Field<std::vector<std::int64_t>>(sj, "offset", source, where + "'s shard"),
                          .shape = Field<std::vector<std::int64_t>>(sj, "shape", source, where + "'s shard"),
                          .file = Field<std::string>(sj, "file", source, where + "'s shard"),
                          .byte_offset = Field<std::int64_t>(sj, "byte_offset", source, where + "'s shard"),
                          .length = Field<std::int64_t>(sj, "length", source, where + "'s shard"),
                          .block_crc32 = Field<std::vector<std::uint32_t>>(sj, "crc32", source, where + "'s shard")};
            SHARDLINE_CHECK(s.offset.size() == t.shape.size() && s.shape.size() == t.shape.size(), "ckpt::ReadMetadata",
                            "'{}': a shard of {} has offset/shape of rank {}/{}, the tensor has rank {}", source, where,
                            s.offset.size(), s.shape.size(), t.shape.size());
            std::int64_t numel = 1;
            for (std::size_t d = 0; d < t.shape.size(); ++d) {
                SHARDLINE_CHECK(s.offset[d] >= 0 && s.shape[d] >= 0 && s.offset[d] + s.shape[d] <= t.shape[d],
                                "ckpt::ReadMetadata",
                                "'{}': a shard of {} at offset [{}] shape [{}] leaves the shape [{}]", source, where,
                                fmt::join(s.offset, ","), fmt::join(s.shape, ","), fmt::join(t.shape, ","));
                numel *= s.shape[d];
            }
            SHARDLINE_CHECK(s.length == numel * static_cast<std::int64_t>(ElementSize(t.dtype)) && s.byte_offset >= 0,
                            "ckpt::ReadMetadata",
                            "'{}': a shard of {} holds {} elements of {}, so {} bytes; length is {}", source, where,
                            numel, DTypeName(t.dtype), numel * ElementSize(t.dtype), s.length);
            t.shards.push_back(std::move(s));
        }
        m.tensors.push_back(std::move(t));
    }
    m.extra = j.contains("extra") ? j.at("extra") : nlohmann::json::object();
    return m;
}

Metadata ReadMetadata(const std::string &dir) {
    const std::string path = (std::filesystem::path(dir) / kMetadataFile).string();
    SHARDLINE_CHECK(detail::FileSize(path) >= 0, "ckpt::ReadMetadata", "'{}' is missing: '{}' is no checkpoint", path,
                    dir);
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(detail::ReadText(path));
    } catch (const nlohmann::json::exception &e) {
        SHARDLINE_THROW(Error, "ckpt::ReadMetadata", "'{}' is not valid JSON: {}", path, e.what());
    }
    return MetadataFromJson(j, path);
}

std::vector<std::string> VerifyCheckpoint(const std::string &dir, const Metadata &metadata) {
    std::vector<std::string> problems;
    for (const TensorRecord &t : metadata.tensors) {
        std::int64_t covered = 0;
        for (const ShardRecord &s : t.shards) {
            std::int64_t numel = 1;
            for (std::int64_t d : s.shape) {
                numel *= d;
            }
            covered += numel;
            std::vector<char> buffer;
            std::int64_t begin = 0;
            try {
                detail::ReadShardVerified(dir, s, metadata.block_bytes, t.name, 0, s.length, buffer, begin);
            } catch (const Error &e) {
                problems.emplace_back(e.what());
            }
        }
        const std::int64_t numel = t.nbytes() / static_cast<std::int64_t>(ElementSize(t.dtype));
        if (covered != numel) {
            problems.push_back(fmt::format("tensor '{}': its shards hold {} elements, its shape [{}] has {}", t.name,
                                           covered, fmt::join(t.shape, ","), numel));
        }
    }
    return problems;
}

Tensor ReadFullTensor(const std::string &dir, const Metadata &metadata, const TensorRecord &t) {
    Tensor full = Tensor::Zeros(Shape(t.shape.begin(), t.shape.end()), t.dtype);
    const std::vector<std::int64_t> origin(t.shape.size(), 0);
    std::vector<char> buffer;
    std::vector<std::int64_t> lo;
    std::vector<std::int64_t> hi;
    for (const ShardRecord &s : t.shards) {
        std::int64_t begin = 0;
        detail::ReadShardVerified(dir, s, metadata.block_bytes, t.name, 0, s.length, buffer, begin);
        if (s.length > 0 && detail::Intersect(s.offset, s.shape, origin, t.shape, lo, hi)) {
            detail::CopyBox(buffer.data(), s.offset, s.shape, static_cast<char *>(full.data()), origin, t.shape, lo, hi,
                            ElementSize(t.dtype));
        }
    }
    return full;
}

void ExportSafetensors(const std::string &dir, const std::string &out) {
    const Metadata metadata = ReadMetadata(dir);
    nlohmann::ordered_json header;
    std::int64_t offset = 0;
    for (const TensorRecord &t : metadata.tensors) {
        header[t.name] = {
            {"dtype", SafetensorsDType(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.nbytes()}}};
        offset += t.nbytes();
    }
    // safetensors' __metadata__ maps strings to strings.
    header["__metadata__"] = {{"format", "pt"},
                              {"shardline_step", std::to_string(metadata.step)},
                              {"shardline_extra", metadata.extra.dump()}};
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' '); // the data starts 8-byte aligned
    const std::string tmp = out + ".tmp";
    {
        detail::OutFile file(tmp);
        const std::uint64_t n = text.size();
        unsigned char length[8];
        for (int i = 0; i < 8; ++i) {
            length[i] = static_cast<unsigned char>(n >> (8 * i)); // little-endian
        }
        file.Write(length, 8);
        file.Write(text.data(), text.size());
        for (const TensorRecord &t : metadata.tensors) {
            const Tensor full = ReadFullTensor(dir, metadata, t);
            file.Write(full.data(), full.nbytes());
        }
        file.Close();
    }
    SHARDLINE_CHECK(std::rename(tmp.c_str(), out.c_str()) == 0, "ckpt::ExportSafetensors",
                    "rename '{}' -> '{}' failed: {}", tmp, out, std::strerror(errno));
}

} // namespace shardline::ckpt
