#include "io.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <shardline/core/error.h>
#include <shardline/core/logging.h>

namespace shardline::ckpt::detail {
namespace {

std::string Errno() { return std::strerror(errno); }

} // namespace

std::uint32_t Crc32(const void *data, std::size_t bytes) {
    uLong crc = crc32(0L, Z_NULL, 0);
    const auto *p = static_cast<const Bytef *>(data);
    constexpr std::size_t kPiece = 1u << 30; // below uInt's range
    while (bytes > 0) {
        const std::size_t n = std::min(bytes, kPiece);
        crc = crc32(crc, p, static_cast<uInt>(n));
        p += n;
        bytes -= n;
    }
    return static_cast<std::uint32_t>(crc);
}

std::vector<std::uint32_t> BlockCrc32(const void *data, std::int64_t bytes, std::int64_t block_bytes) {
    std::vector<std::uint32_t> crcs;
    const auto *p = static_cast<const char *>(data);
    for (std::int64_t start = 0; start < bytes; start += block_bytes) {
        crcs.push_back(Crc32(p + start, static_cast<std::size_t>(std::min(block_bytes, bytes - start))));
    }
    return crcs;
}

OutFile::OutFile(const std::string &path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    SHARDLINE_CHECK(fd_ >= 0, "ckpt::Save", "could not create '{}': {}", path, Errno());
}

OutFile::~OutFile() {
    if (fd_ >= 0) {
        ::close(fd_);
    }
}

void OutFile::Write(const void *data, std::size_t bytes) {
    const auto *p = static_cast<const char *>(data);
    while (bytes > 0) {
        const ssize_t n = ::write(fd_, p, std::min<std::size_t>(bytes, std::size_t{1} << 30));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        SHARDLINE_CHECK(n > 0, "ckpt::Save", "writing '{}' failed with {} bytes left: {}", path_, bytes, Errno());
        p += n;
        bytes -= static_cast<std::size_t>(n);
    }
}

void OutFile::WriteAt(const void *data, std::size_t bytes, std::int64_t offset) {
    const auto *p = static_cast<const char *>(data);
    while (bytes > 0) {
        const ssize_t n =
            ::pwrite(fd_, p, std::min<std::size_t>(bytes, std::size_t{1} << 30), static_cast<off_t>(offset));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        SHARDLINE_CHECK(n > 0, "ckpt::Save", "writing '{}' at byte {} failed with {} bytes left: {}", path_, offset,
                        bytes, Errno());
        p += n;
        offset += n;
        bytes -= static_cast<std::size_t>(n);
    }
}

void OutFile::StartWriteback(std::int64_t offset, std::int64_t bytes) noexcept {
#ifdef __linux__
    // A hint: the fsync in Close() is what makes the bytes durable.
    (void)::sync_file_range(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes), SYNC_FILE_RANGE_WRITE);
#else
    (void)offset;
    (void)bytes;
#endif
}

void OutFile::Close() {
    SHARDLINE_CHECK(::fsync(fd_) == 0, "ckpt::Save", "fsync of '{}' failed: {}", path_, Errno());
    (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED); // advice only: a failure costs cache, not correctness
    const int fd = fd_;
    fd_ = -1;
    SHARDLINE_CHECK(::close(fd) == 0, "ckpt::Save", "close of '{}' failed: {}", path_, Errno());
}

InFile::InFile(const std::string &path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    SHARDLINE_CHECK(fd_ >= 0, "ckpt::Load", "could not open '{}': {}", path, Errno());
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
        const std::string why = Errno();
        ::close(fd_);
        SHARDLINE_THROW(Error, "ckpt::Load", "could not stat '{}': {}", path, why);
    }
    size_ = static_cast<std::int64_t>(st.st_size);
    (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL); // larger readahead; advice only
}

InFile::~InFile() {
    if (fd_ >= 0) {
        ::close(fd_);
    }
}

void InFile::ReadAt(std::int64_t offset, std::int64_t bytes, void *out) const {
    auto *p = static_cast<char *>(out);
    std::int64_t done = 0;
    while (done < bytes) {
        const ssize_t n =
            ::pread(fd_, p + done, static_cast<std::size_t>(std::min<std::int64_t>(bytes - done, 1 << 30)),
                    static_cast<off_t>(offset + done));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            const std::string why = n < 0 ? Errno() : std::string("end of file");
            SHARDLINE_THROW(Error, "ckpt::Load",
                            "'{}' is truncated or unreadable: expected bytes [{}, {}), read only up to {} ({})", path_,
                            offset, offset + bytes, offset + done, why);
        }
        done += n;
    }
}

void AdviseHugePages(void *data, std::size_t bytes) noexcept {
#ifdef MADV_HUGEPAGE
    const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    const auto begin = (reinterpret_cast<std::uintptr_t>(data) + page - 1) / page * page;
    const auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) / page * page;
    if (end > begin) {
        (void)::madvise(reinterpret_cast<void *>(begin), end - begin, MADV_HUGEPAGE);
    }
#else
    (void)data;
    (void)bytes;
#endif
}

void ReadRange(const std::string &path, std::int64_t offset, std::int64_t bytes, void *out) {
    InFile(path).ReadAt(offset, bytes, out);
}

std::int64_t FileSize(const std::string &path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
        return -1;
    }
    return static_cast<std::int64_t>(st.st_size);
}

void WriteTextSynced(const std::string &path, const std::string &text) {
    OutFile file(path);
    file.Write(text.data(), text.size());
    file.Close();
}

std::string ReadText(const std::string &path) {
    std::ifstream in(path, std::ios::binary);
    SHARDLINE_CHECK(in.good(), "ckpt", "could not open '{}': {}", path, Errno());
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
}

void FsyncDir(const std::string &path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    SHARDLINE_CHECK(fd >= 0, "ckpt::Save", "could not open directory '{}': {}", path, Errno());
    const int rc = ::fsync(fd);
    const std::string why = rc != 0 ? Errno() : std::string();
    ::close(fd);
    SHARDLINE_CHECK(rc == 0, "ckpt::Save", "fsync of directory '{}' failed: {}", path, why);
}

void RenameSynced(const std::string &from, const std::string &to, const std::string &dir) {
    SHARDLINE_CHECK(::rename(from.c_str(), to.c_str()) == 0, "ckpt::Save", "rename '{}' -> '{}' failed: {}", from, to,
                    Errno());
    FsyncDir(dir);
}

void MakeDir(const std::string &path) {
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
    SHARDLINE_CHECK(!ec, "ckpt::Save", "could not create directory '{}': {}", path, ec.message());
}

void RemoveTree(const std::string &path) noexcept {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    if (ec) {
        SHARDLINE_LOG_WARN("ckpt: could not remove '{}': {}", path, ec.message());
    }
}

bool Intersect(const std::vector<std::int64_t> &a_offset, const std::vector<std::int64_t> &a_shape,
               const std::vector<std::int64_t> &b_offset, const std::vector<std::int64_t> &b_shape,
               std::vector<std::int64_t> &lo, std::vector<std::int64_t> &hi) {
    const std::size_t n = a_offset.size();
    lo.assign(n, 0);
    hi.assign(n, 0);
    for (std::size_t d = 0; d < n; ++d) {
        lo[d] = std::max(a_offset[d], b_offset[d]);
        hi[d] = std::min(a_offset[d] + a_shape[d], b_offset[d] + b_shape[d]);
        if (lo[d] >= hi[d]) {
            return false;
        }
    }
    return true;
}

std::int64_t LinearIndexIn(const std::vector<std::int64_t> &index, const std::vector<std::int64_t> &offset,
                           const std::vector<std::int64_t> &shape) {
    std::int64_t linear = 0;
    for (std::size_t d = 0; d < index.size(); ++d) {
        linear = linear * shape[d] + (index[d] - offset[d]);
    }
    return linear;
}

void CopyBox(const char *src, const std::vector<std::int64_t> &src_offset, const std::vector<std::int64_t> &src_shape,
             char *dst, const std::vector<std::int64_t> &dst_offset, const std::vector<std::int64_t> &dst_shape,
             const std::vector<std::int64_t> &lo, const std::vector<std::int64_t> &hi, std::size_t elem) {
    const int n = static_cast<int>(lo.size());
    if (n == 0) {
        std::memcpy(dst, src, elem);
        return;
    }
    // Rows along the last dim are contiguous in both: iterate over the outer indices, one memcpy per row.
    const std::size_t row_bytes = static_cast<std::size_t>(hi[n - 1] - lo[n - 1]) * elem;
    std::vector<std::int64_t> index = lo;
    while (true) {
        const std::int64_t s = LinearIndexIn(index, src_offset, src_shape);
        const std::int64_t t = LinearIndexIn(index, dst_offset, dst_shape);
        std::memcpy(dst + t * static_cast<std::int64_t>(elem), src + s * static_cast<std::int64_t>(elem), row_bytes);
        int d = n - 2;
        for (; d >= 0; --d) {
            if (++index[d] < hi[d]) {
                break;
            }
            index[d] = lo[d];
        }
        if (d < 0) {
            return;
        }
    }
}

void CopyBoxWindow(const char *src, std::int64_t window_begin, std::int64_t window_end,
                   const std::vector<std::int64_t> &src_offset, const std::vector<std::int64_t> &src_shape, char *dst,
                   const std::vector<std::int64_t> &dst_offset, const std::vector<std::int64_t> &dst_shape,
                   const std::vector<std::int64_t> &lo, const std::vector<std::int64_t> &hi, std::size_t elem) {
    const int n = static_cast<int>(lo.size());
    const auto e = static_cast<std::int64_t>(elem);
    if (n == 0) {
        if (window_begin <= 0 && 0 < window_end) {
            std::memcpy(dst, src - window_begin, elem);
        }
        return;
    }
    // The box's rows (outer index r, the last dim contiguous) start at increasing src bytes: find the first row that
    // ends after window_begin, then copy rows, clipped to the window, until one starts at window_end.
    std::int64_t rows = 1;
    for (int d = 0; d + 1 < n; ++d) {
        rows *= hi[d] - lo[d];
    }
    const std::int64_t row_bytes = (hi[n - 1] - lo[n - 1]) * e;
    std::vector<std::int64_t> index(lo.size());
    const auto start_of = [&](std::int64_t r) {
        index[n - 1] = lo[n - 1];
        for (int d = n - 2; d >= 0; --d) {
            const std::int64_t extent = hi[d] - lo[d];
            index[d] = lo[d] + r % extent;
            r /= extent;
        }
        return LinearIndexIn(index, src_offset, src_shape) * e;
    };
    std::int64_t a = 0;
    std::int64_t b = rows;
    while (a < b) {
        const std::int64_t mid = a + (b - a) / 2;
        if (start_of(mid) + row_bytes <= window_begin) {
            a = mid + 1;
        } else {
            b = mid;
        }
    }
    for (std::int64_t r = a; r < rows; ++r) {
        const std::int64_t s = start_of(r); // also sets index to row r
        if (s >= window_end) {
            break;
        }
        const std::int64_t begin = std::max(s, window_begin);
        const std::int64_t end = std::min(s + row_bytes, window_end);
        const std::int64_t t = LinearIndexIn(index, dst_offset, dst_shape) * e + (begin - s);
        std::memcpy(dst + t, src + (begin - window_begin), static_cast<std::size_t>(end - begin));
    }
}

} // namespace shardline::ckpt::detail

namespace shardline::ckpt::detail {

void ReadShardVerified(const std::string &dir, const ShardRecord &shard, std::int64_t block_bytes,
                       const std::string &tensor, std::int64_t begin, std::int64_t end, std::vector<char> &buffer,
                       std::int64_t &buffer_begin) {
    const std::string path = (std::filesystem::path(dir) / shard.file).string();
    const std::int64_t blocks = (shard.length + block_bytes - 1) / block_bytes;
    SHARDLINE_CHECK(static_cast<std::int64_t>(shard.block_crc32.size()) == blocks, "ckpt::Load",
                    "tensor '{}': the shard in '{}' has {} bytes, so {} block checksums of {} bytes, metadata has {}",
                    tensor, path, shard.length, blocks, block_bytes, shard.block_crc32.size());
    const std::int64_t first = begin / block_bytes;
    const std::int64_t last = (end + block_bytes - 1) / block_bytes; // exclusive
    buffer_begin = first * block_bytes;
    const std::int64_t buffer_end = std::min(last * block_bytes, shard.length);
    buffer.resize(static_cast<std::size_t>(buffer_end - buffer_begin));
    const std::int64_t size = FileSize(path);
    SHARDLINE_CHECK(size >= 0, "ckpt::Load", "tensor '{}': its shard file '{}' is missing", tensor, path);
    SHARDLINE_CHECK(
        size >= shard.byte_offset + shard.length, "ckpt::Load",
        "tensor '{}': '{}' is truncated: the shard at global offset {} needs bytes [{}, {}), the file has {}", tensor,
        path, fmt::join(shard.offset, ","), shard.byte_offset, shard.byte_offset + shard.length, size);
    ReadRange(path, shard.byte_offset + buffer_begin, buffer_end - buffer_begin, buffer.data());
    for (std::int64_t b = first; b < last; ++b) {
        const std::int64_t lo = b * block_bytes;
        const std::int64_t hi = std::min(lo + block_bytes, shard.length);
        const std::uint32_t crc = Crc32(buffer.data() + (lo - buffer_begin), static_cast<std::size_t>(hi - lo));
        SHARDLINE_CHECK(crc == shard.block_crc32[static_cast<std::size_t>(b)], "ckpt::Load",
                        "tensor '{}': checksum mismatch in '{}' at bytes [{}, {}) (block {} of the shard at global "
                        "offset [{}]): crc32 {:08x}, metadata.json says {:08x}",
                        tensor, path, shard.byte_offset + lo, shard.byte_offset + hi, b, fmt::join(shard.offset, ","),
                        crc, shard.block_crc32[static_cast<std::size_t>(b)]);
    }
}

} // namespace shardline::ckpt::detail
