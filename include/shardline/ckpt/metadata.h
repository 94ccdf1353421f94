#pragma once

// The metadata.json of a checkpoint (checkpoint.h) as types, and the whole-checkpoint reads the shardline-ckpt tool
// makes: verification of every block, full tensors, the safetensors export.

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <shardline/core/dtype.h>
#include <shardline/core/tensor.h>

namespace shardline::ckpt {

inline constexpr int kFormatVersion = 1;
inline constexpr const char* kMetadataFile = "metadata.json";

/// One saved shard: the box [offset, offset + shape) of the global tensor, row-major at [byte_offset, byte_offset +
/// length) of `file`; block_crc32[i] is zlib's crc32 of bytes [i·block_bytes, (i+1)·block_bytes) of the shard.
struct ShardRecord {
    std::vector<std::int64_t> offset;
    std::vector<std::int64_t> shape;
    std::string file;
    std::int64_t byte_offset = 0;
    std::int64_t length = 0;
    std::vector<std::uint32_t> block_crc32;
};

struct TensorRecord {
    std::string name;
    std::vector<std::int64_t> shape;
    DType dtype = DType::kFloat32;
    std::vector<std::int64_t> mesh_shape; ///< empty for a local tensor
    std::vector<std::string> mesh_dim_names;
    std::string layout;              ///< spmd::Layout text ("[-1,1]")
    std::vector<ShardRecord> shards; ///< the distinct non-empty shards, together covering the tensor once
    std::int64_t nbytes() const;
};

struct FileRecord {
    std::string name;
    int rank = 0;
    std::int64_t bytes = 0;
};

struct Metadata {
    int format_version = kFormatVersion;
    std::string library_version;
    std::int64_t step = 0;
    int world_size = 1;
    std::int64_t block_bytes = 0;
    std::vector<FileRecord> files;
    std::vector<TensorRecord> tensors;
    nlohmann::json extra;

    const TensorRecord* Find(const std::string& name) const;
};

nlohmann::ordered_json ToJson(const Metadata& metadata);
/// Throws Error naming `source` and the field that is missing or malformed.
Metadata MetadataFromJson(const nlohmann::json& json, const std::string& source);
/// Reads DIR/metadata.json; throws Error naming the file when it is missing or malformed.
Metadata ReadMetadata(const std::string& dir);

/// Every problem of the checkpoint at `dir`: missing or short files, blocks whose crc32 differs, shards that do not
/// cover their tensor exactly once. Empty when it is sound. Reads every byte.
std::vector<std::string> VerifyCheckpoint(const std::string& dir, const Metadata& metadata);

/// The full tensor `name` on the host, assembled from its shards (checksums verified).
Tensor ReadFullTensor(const std::string& dir, const Metadata& metadata, const TensorRecord& tensor);

/// Writes every tensor of the checkpoint, full, as one safetensors file (8-byte little-endian header length, JSON
/// header with dtype, shape and data_offsets, the data), with the step and the extra JSON under "__metadata__".
void ExportSafetensors(const std::string& dir, const std::string& out);

} // namespace shardline::ckpt
