#pragma once

// Private to the library (src/core, src/kernels) and the project's benchmarks: the cuBLAS status check. cuBLAS is no
// part of the public API, so neither its headers nor this check are in include/shardline.

#include <cublasLt.h>
#include <cublas_v2.h>

#include <shardline/core/error.h>

/// cuBLAS / cuBLASLt call: throws CudaError with the call text and the status name.
#define SHARDLINE_CHECK_CUBLAS(call)                                                                                   \
    do {                                                                                                               \
        const cublasStatus_t shardline_status_ = (call);                                                               \
        if (shardline_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                                                 \
            SHARDLINE_THROW(::shardline::CudaError, "cuBLAS", "{} failed: {} ({})", #call,                             \
                            cublasGetStatusName(shardline_status_), cublasGetStatusString(shardline_status_));         \
        }                                                                                                              \
    } while (0)
