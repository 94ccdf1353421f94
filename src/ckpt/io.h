#pragma once

// Private to src/ckpt: POSIX file I/O with errors that name the file, zlib's crc32, and the copy of a box between two
// row-major arrays.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardline::ckpt::detail {

/// zlib's crc32 of `bytes` bytes (any size: fed in pieces zlib's uInt can count).
std::uint32_t Crc32(const void* data, std::size_t bytes);
/// crc32 of every `block_bytes` block of [data, data + bytes) (the last block may be short).
std::vector<std::uint32_t> BlockCrc32(const void* data, std::int64_t bytes, std::int64_t block_bytes);

/// An open file, written front to back (Write) or at offsets from several threads (WriteAt); Close() fsyncs once.
/// Errors name the path and strerror.
class OutFile {
public:
    explicit OutFile(const std::string& path);
    ~OutFile();
    OutFile(const OutFile&) = delete;
    OutFile& operator=(const OutFile&) = delete;
    void Write(const void* data, std::size_t bytes);
    /// pwrite(2) of all `bytes` at `offset`; thread-safe.
    void WriteAt(const void* data, std::size_t bytes, std::int64_t offset);
    /// Starts the writeback of bytes written already (Linux: sync_file_range WRITE, which returns once the I/O is
    /// queued), so the disk works while later chunks are produced instead of only at the fsync, when the page cache
    /// holds the whole file below the background-writeback threshold. Called in file order, it keeps the writeback
    /// (and the filesystem's delayed block allocation) sequential. Thread-safe; a hint, never fails.
    void StartWriteback(std::int64_t offset, std::int64_t bytes) noexcept;
    /// fsync and close; then drops the file's (now clean) pages from the page cache (posix_fadvise DONTNEED): a
    /// checkpoint is rarely read back soon, and keeping it cached would evict the trainer's data.
    void Close();

private:
    std::string path_;
    int fd_ = -1;
};

/// A file opened for reading at offsets from several threads. Errors name the path.
class InFile {
public:
    /// Throws Error naming `path` when it cannot be opened.
    explicit InFile(const std::string& path);
    ~InFile();
    InFile(const InFile&) = delete;
    InFile& operator=(const InFile&) = delete;
    std::int64_t size() const { return size_; }
    const std::string& path() const { return path_; }
    /// pread(2) of [offset, offset + bytes) into `out`; thread-safe. Throws Error naming the file when it is shorter.
    void ReadAt(std::int64_t offset, std::int64_t bytes, void* out) const;

private:
    std::string path_;
    int fd_ = -1;
    std::int64_t size_ = 0;
};

/// Advises the kernel to back [data, data + bytes) with transparent huge pages (fewer page faults when a load fills
/// gigabytes of fresh staging). Advice only: never fails.
void AdviseHugePages(void* data, std::size_t bytes) noexcept;

/// Reads [offset, offset + bytes) of `path` into `out`; throws Error naming the file when it is missing or shorter.
void ReadRange(const std::string& path, std::int64_t offset, std::int64_t bytes, void* out);
/// Size of `path` in bytes, or -1 when it does not exist.
std::int64_t FileSize(const std::string& path);
/// Writes `text` to `path` and fsyncs it.
void WriteTextSynced(const std::string& path, const std::string& text);
std::string ReadText(const std::string& path);
/// fsync of a directory (makes the names created, renamed or removed in it durable).
void FsyncDir(const std::string& path);
/// rename(2) then fsync of the destination's directory.
void RenameSynced(const std::string& from, const std::string& to, const std::string& dir);
void MakeDir(const std::string& path);
/// rm -r; never throws (best effort: logs what it could not remove).
void RemoveTree(const std::string& path) noexcept;

/// Copies the intersection box of two row-major arrays of `elem` bytes per element: `src` holds the box
/// [src_offset, src_offset + src_shape), `dst` the box [dst_offset, dst_offset + dst_shape), both in global indices;
/// `lo`/`hi` bound the intersection. src_base is the global index of src's first byte's element row start (the whole
/// src box), likewise dst.
void CopyBox(const char* src, const std::vector<std::int64_t>& src_offset, const std::vector<std::int64_t>& src_shape,
             char* dst, const std::vector<std::int64_t>& dst_offset, const std::vector<std::int64_t>& dst_shape,
             const std::vector<std::int64_t>& lo, const std::vector<std::int64_t>& hi, std::size_t elem);

/// CopyBox restricted to the elements whose bytes in the src box lie in [window_begin, window_end): `src` points at
/// byte window_begin of the src box (a chunk read from a saved shard). Rows are clipped at the window's ends, so the
/// windows of one box copy each element once.
void CopyBoxWindow(const char* src, std::int64_t window_begin, std::int64_t window_end,
                   const std::vector<std::int64_t>& src_offset, const std::vector<std::int64_t>& src_shape, char* dst,
                   const std::vector<std::int64_t>& dst_offset, const std::vector<std::int64_t>& dst_shape,
                   const std::vector<std::int64_t>& lo, const std::vector<std::int64_t>& hi, std::size_t elem);

/// The intersection [lo, hi) of two boxes; false when it is empty.
bool Intersect(const std::vector<std::int64_t>& a_offset, const std::vector<std::int64_t>& a_shape,
               const std::vector<std::int64_t>& b_offset, const std::vector<std::int64_t>& b_shape,
               std::vector<std::int64_t>& lo, std::vector<std::int64_t>& hi);

/// Row-major linear index of global element `index` inside the box at `offset` of `shape`.
std::int64_t LinearIndexIn(const std::vector<std::int64_t>& index, const std::vector<std::int64_t>& offset,
                           const std::vector<std::int64_t>& shape);

} // namespace shardline::ckpt::detail

#include <shardline/ckpt/metadata.h>

namespace shardline::ckpt::detail {

/// Reads the whole blocks of saved shard `shard` (of tensor `tensor`, in checkpoint `dir`) that cover its bytes
/// [begin, end), verifying each block's crc32. On return `buffer` holds shard bytes from `buffer_begin` on (a block
/// boundary). Throws Error naming the file, the tensor and the block on a missing or short file or a wrong checksum.
void ReadShardVerified(const std::string& dir, const ShardRecord& shard, std::int64_t block_bytes,
                       const std::string& tensor, std::int64_t begin, std::int64_t end, std::vector<char>& buffer,
                       std::int64_t& buffer_begin);

} // namespace shardline::ckpt::detail
