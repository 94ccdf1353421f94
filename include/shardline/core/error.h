#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace shardline {

/// The root of every exception shardline throws. Messages read
/// "[rank r/N] <file>:<line> <op>: <what was expected>, got <values>".
class Error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};
/// Shapes or sizes that do not fit the op.
class ShapeError : public Error {
public:
    using Error::Error;
};
/// Element types that do not fit the op or the device.
class DTypeError : public Error {
public:
    using Error::Error;
};
/// Tensors on the wrong device, or a device that is not available.
class DeviceError : public Error {
public:
    using Error::Error;
};
/// A CUDA runtime, cuBLAS or cuBLASLt call failed.
class CudaError : public Error {
public:
    using Error::Error;
};
/// A collective failed, timed out or was aborted.
class CommError : public Error {
public:
    using Error::Error;
};

/// This process's place in a distributed job, used to prefix errors and log lines. Set by the launcher.
void SetProcessRank(int rank, int world_size);
int ProcessRank();
int ProcessWorldSize();

namespace detail {
/// "[rank r/N] file:line op: message" (the rank prefix only once a world size > 1 is known).
std::string FormatError(const char* file, int line, std::string_view op, std::string_view message);
std::string_view BaseName(const char* path);
} // namespace detail

} // namespace shardline

/// Throws ErrorType with the file, line, op and a fmt-formatted message.
#define SHARDLINE_THROW(ErrorType, op, ...)                                                                            \
    throw ErrorType(::shardline::detail::FormatError(__FILE__, __LINE__, (op), ::fmt::format(__VA_ARGS__)))

/// Throws shardline::Error (or the given subclass) unless cond holds. The message says what was expected and
/// what was found: SHARDLINE_CHECK(k == n, "LinearForward", "in_features {} must equal x.shape[-1] {}", n, k).
#define SHARDLINE_CHECK(cond, op, ...)                                                                                 \
    do {                                                                                                               \
        if (!(cond)) [[unlikely]] {                                                                                    \
            SHARDLINE_THROW(::shardline::Error, op, __VA_ARGS__);                                                      \
        }                                                                                                              \
    } while (0)
#define SHARDLINE_CHECK_AS(ErrorType, cond, op, ...)                                                                   \
    do {                                                                                                               \
        if (!(cond)) [[unlikely]] {                                                                                    \
            SHARDLINE_THROW(ErrorType, op, __VA_ARGS__);                                                               \
        }                                                                                                              \
    } while (0)

// The checks below expand where they are used, so the caller includes the library's own header
// (cuda_runtime_api.h, nccl.h, mpi.h) and core needs none of them. cuBLAS is no part of the public API: its check,
// SHARDLINE_CHECK_CUBLAS, is in a private header of src/core/cuda.

/// CUDA runtime call: throws CudaError with the call text and cudaGetErrorString.
#define SHARDLINE_CHECK_CUDA(call)                                                                                     \
    do {                                                                                                               \
        const cudaError_t shardline_status_ = (call);                                                                  \
        if (shardline_status_ != cudaSuccess) [[unlikely]] {                                                           \
            SHARDLINE_THROW(::shardline::CudaError, "CUDA", "{} failed: {} ({})", #call,                               \
                            cudaGetErrorName(shardline_status_), cudaGetErrorString(shardline_status_));               \
        }                                                                                                              \
    } while (0)

/// NCCL call: ncclSuccess and ncclInProgress (non-blocking communicators) pass; anything else throws CommError
/// with the call text, ncclGetErrorString and ncclGetLastError.
#define SHARDLINE_CHECK_NCCL(call)                                                                                     \
    do {                                                                                                               \
        const ncclResult_t shardline_status_ = (call);                                                                 \
        if (shardline_status_ != ncclSuccess && shardline_status_ != ncclInProgress) [[unlikely]] {                    \
            SHARDLINE_THROW(::shardline::CommError, "NCCL", "{} failed: {} ({})", #call,                               \
                            ncclGetErrorString(shardline_status_), ncclGetLastError(nullptr));                         \
        }                                                                                                              \
    } while (0)

/// MPI call: throws CommError with the call text and MPI_Error_string.
#define SHARDLINE_CHECK_MPI(call)                                                                                      \
    do {                                                                                                               \
        const int shardline_status_ = (call);                                                                          \
        if (shardline_status_ != MPI_SUCCESS) [[unlikely]] {                                                           \
            char shardline_msg_[MPI_MAX_ERROR_STRING];                                                                 \
            int shardline_len_ = 0;                                                                                    \
            MPI_Error_string(shardline_status_, shardline_msg_, &shardline_len_);                                      \
            SHARDLINE_THROW(::shardline::CommError, "MPI", "{} failed: {}", #call,                                     \
                            std::string_view(shardline_msg_, shardline_len_));                                         \
        }                                                                                                              \
    } while (0)
