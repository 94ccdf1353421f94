// A GPU timeline without Nsight Systems (the GPU hosts have Nsight Compute only, which serialises kernels and times
// each alone): a CUPTI activity tracer that the CUDA driver loads into an unchanged program through
// CUDA_INJECTION64_PATH (bench/timeline/trace.sh sets it). One CSV line per kernel (K), memcpy (C), memset (S) and CUDA
// runtime API call (R; driver calls D with CUPTI_TRACE_DRIVER=1) goes to $CUPTI_TRACE_OUT:
//     kind,start_ns,end_ns,stream_id (GPU records) or thread_id (API records),"name"
// Records are written as CUPTI hands over its buffers and flushed at exit. The record structs are CUDA 13's CUPTI
// (CUpti_ActivityKernel10, Memcpy6, Memset4): build against the toolkit of the host that runs it.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include <cupti.h>

namespace {
FILE *out = nullptr;
std::mutex mu;
constexpr size_t kBuf = 8 << 20;

void CUPTIAPI Requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = static_cast<uint8_t *>(aligned_alloc(8, kBuf));
    *size = kBuf;
    *max_records = 0;
}

void CUPTIAPI Completed(CUcontext, uint32_t, uint8_t *buffer, size_t, size_t valid) {
    std::lock_guard lock(mu);
    CUpti_Activity *r = nullptr;
    while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
        switch (r->kind) {
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
        case CUPTI_ACTIVITY_KIND_KERNEL: {
            auto *k = reinterpret_cast<CUpti_ActivityKernel10 *>(r);
            fprintf(out, "K,%llu,%llu,%u,\"%s\"\n", (unsigned long long)k->start, (unsigned long long)k->end,
                    k->streamId, k->name);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            auto *m = reinterpret_cast<CUpti_ActivityMemcpy6 *>(r);
            fprintf(out, "C,%llu,%llu,%u,\"memcpy kind %u %llu B\"\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, m->streamId, (unsigned)m->copyKind, (unsigned long long)m->bytes);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            auto *m = reinterpret_cast<CUpti_ActivityMemset4 *>(r);
            fprintf(out, "S,%llu,%llu,%u,\"memset %llu B\"\n", (unsigned long long)m->start, (unsigned long long)m->end,
                    m->streamId, (unsigned long long)m->bytes);
            break;
        }
        case CUPTI_ACTIVITY_KIND_RUNTIME:
        case CUPTI_ACTIVITY_KIND_DRIVER: {
            const bool runtime = r->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
            auto *a = reinterpret_cast<CUpti_ActivityAPI *>(r);
            const char *name = nullptr;
            cuptiGetCallbackName(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name);
            fprintf(out, "%c,%llu,%llu,%u,\"%s\"\n", runtime ? 'R' : 'D', (unsigned long long)a->start,
                    (unsigned long long)a->end, a->threadId, name != nullptr ? name : "?");
            break;
        }
        default:
            break;
        }
    }
    free(buffer);
}

void Flush() {
    cuptiActivityFlushAll(1);
    std::lock_guard lock(mu);
    if (out != nullptr) {
        fflush(out);
    }
}
} // namespace

extern "C" int InitializeInjection(void) {
    const char *path = getenv("CUPTI_TRACE_OUT");
    out = fopen(path != nullptr ? path : "cupti_trace.csv", "w");
    if (out == nullptr) {
        return 0;
    }
    cuptiActivityRegisterCallbacks(Requested, Completed);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME);
    if (getenv("CUPTI_TRACE_DRIVER") != nullptr) {
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER);
    }
    atexit(Flush);
    return 1;
}
