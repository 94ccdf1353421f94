#include "side_stream.h"

#include <unordered_map>

#include <shardline/core/error.h>

namespace shardline::kernels::cuda {

SideStream &SideStreamOf(int device) {
    static std::mutex mutex;
    static auto *sides = new std::unordered_map<int, SideStream>();
    std::lock_guard lock(mutex);
    SideStream &side = (*sides)[device];
    if (side.stream == nullptr) {
        int least = 0;
        int greatest = 0;
        SHARDLINE_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
        SHARDLINE_CHECK_CUDA(cudaStreamCreateWithPriority(&side.stream, cudaStreamNonBlocking, greatest));
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&side.fork, cudaEventDisableTiming));
        SHARDLINE_CHECK_CUDA(cudaEventCreateWithFlags(&side.join, cudaEventDisableTiming));
    }
    return side;
}

void ForkSideStream(SideStream &side, cudaStream_t main) {
    SHARDLINE_CHECK_CUDA(cudaEventRecord(side.fork, main));
    SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(side.stream, side.fork, 0));
}

void JoinSideStream(SideStream &side, cudaStream_t main, bool on_error) {
    if (on_error) {
        (void)cudaEventRecord(side.join, side.stream);
        (void)cudaStreamWaitEvent(main, side.join, 0);
        return;
    }
    SHARDLINE_CHECK_CUDA(cudaEventRecord(side.join, side.stream));
    SHARDLINE_CHECK_CUDA(cudaStreamWaitEvent(main, side.join, 0));
}

} // namespace shardline::kernels::cuda
