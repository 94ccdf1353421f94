// The chunked collective-GEMM pipelines (pipeline.h): one plan step run in C chunks around a kernel on rows.

#include "pipeline.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include <shardline/core/error.h>

namespace shardline::functional::detail {

std::optional<ChunkedCollective> ChunkedStep(const spmd::RedistributePlan &plan, comm::DeviceMesh &mesh, int chunks) {
    if (chunks <= 1 || plan.steps.size() != 1) {
        return std::nullopt;
    }
    // The linear rule's collectives: Partial(sum) outputs reduced whole or onto the sequence, and the sequence
    // gathered. Anything else (a gather of the features, gather_output; another reduce op) moves unchunked.
    const spmd::RedistributeStep &step = plan.steps.front();
    const bool sum = step.reduce_op == spmd::ReduceOp::kSum;
    const bool takes = (step.collective == spmd::Collective::kAllReduce && sum) ||
                       (step.collective == spmd::Collective::kReduceScatter && step.tensor_dim == 0 && sum) ||
                       (step.collective == spmd::Collective::kAllGather && step.tensor_dim == 0);
    if (!takes) {
        return std::nullopt;
    }
    return ChunkedCollective{.kind = step.collective,
                             .group = &mesh.group(step.mesh_dim),
                             .members = mesh.shape()[static_cast<std::size_t>(step.mesh_dim)],
                             .chunks = chunks};
}

std::pair<std::int64_t, std::int64_t> ChunkRows(std::int64_t rows, int chunks, int c) {
    const std::int64_t base = rows / chunks;
    const std::int64_t extra = rows % chunks;
    const std::int64_t begin = c * base + std::min<std::int64_t>(c, extra);
    return {begin, begin + base + (c < extra ? 1 : 0)};
}

Tensor RowsOf(const Tensor &t, std::int64_t begin, std::int64_t count) {
    const std::int64_t width = t.shape().back();
    auto *data = static_cast<char *>(t.data()) + begin * width * static_cast<std::int64_t>(ElementSize(t.dtype()));
    return Tensor::FromBlob(data, {count, width}, t.dtype(), t.device());
}

void PendingChunks::Wait() {
    for (comm::WorkHandle &work : works_) {
        work->Wait();
    }
    works_.clear();
    buffer_ = Tensor();
}

namespace {

/// The rows of a tensor seen as a matrix [rows, last].
std::int64_t Rows(const Tensor &t) { return t.shape().back() == 0 ? 0 : t.numel() / t.shape().back(); }

/// The call's checks (CheckCommChunks, the sequence divisible by tp) leave every chunk of a block a row.
void CheckBlock(const ChunkedCollective &step, std::int64_t block, std::string_view what) {
    SHARDLINE_CHECK(step.chunks >= 1 && step.chunks <= block, "functional pipeline",
                    "{} of {} rows per rank in {} chunks (internal: the call's checks let a short block through)", what,
                    block, step.chunks);
}

} // namespace

PendingChunks GemmThenReduce(const ChunkedCollective &step, const Tensor &out,
                             const std::function<void(std::int64_t, std::int64_t, Tensor &)> &kernel) {
    PendingChunks pending;
    comm::Communicator &group = *step.group;
    if (step.kind == spmd::Collective::kAllReduce) {
        // Chunk c is rows [c0, c1) of the partial output, reduced in place as soon as its GEMM is queued.
        const std::int64_t rows = Rows(out);
        CheckBlock(step, rows, "all-reduce");
        for (int c = 0; c < step.chunks; ++c) {
            const auto [begin, end] = ChunkRows(rows, step.chunks, c);
            Tensor part = RowsOf(out, begin, end - begin);
            kernel(begin, end - begin, part);
            pending.Add(group.AllReduce(part, comm::ReduceOp::kSum));
        }
        return pending;
    }
    // Reduce-scatter onto dim 0: chunk c is rows [c0, c1) of every member's block, computed into a contiguous
    // [members, c1 - c0, n] (member r's rows first, as a reduce-scatter's input is ordered), whose reduce-scatter is
    // rows [c0, c1) of this rank's block of the sum: the destination's own rows, contiguous.
    const std::int64_t block = Rows(out);
    CheckBlock(step, block, "reduce-scatter");
    const std::int64_t n = step.members;
    Tensor packed = Tensor::Empty({n * block, out.shape().back()}, out.dtype(), out.device());
    for (int c = 0; c < step.chunks; ++c) {
        const auto [begin, end] = ChunkRows(block, step.chunks, c);
        const std::int64_t count = end - begin;
        Tensor chunk = RowsOf(packed, n * begin, n * count);
        for (std::int64_t r = 0; r < n; ++r) {
            Tensor part = RowsOf(chunk, r * count, count);
            kernel(r * block + begin, count, part);
        }
        Tensor dst = RowsOf(out, begin, count);
        pending.Add(group.ReduceScatter(chunk, dst, comm::ReduceOp::kSum));
    }
    pending.Keep(std::move(packed));
    return pending;
}

int GatherThenGemm(const ChunkedCollective &step, const Tensor &local, const Tensor &total,
                   const std::function<void(std::int64_t, std::int64_t, const Tensor &)> &kernel) {
    const std::int64_t n = step.members;
    const std::int64_t block = Rows(local);
    CheckBlock(step, block, "all-gather");
    comm::Communicator &group = *step.group;
    // Every chunk's all-gather is issued first: on NCCL they queue on the communication stream and chunk c + 1 moves
    // while chunk c's GEMMs run; chunk c of member r lands at rows [r·count, (r+1)·count) of its [members, count, n].
    Tensor packed = Tensor::Empty({n * block, local.shape().back()}, local.dtype(), local.device());
    std::vector<comm::WorkHandle> works;
    works.reserve(static_cast<std::size_t>(step.chunks));
    for (int c = 0; c < step.chunks; ++c) {
        const auto [begin, end] = ChunkRows(block, step.chunks, c);
        Tensor chunk = RowsOf(packed, n * begin, n * (end - begin));
        works.push_back(group.AllGather(RowsOf(local, begin, end - begin), chunk));
    }
    for (int c = 0; c < step.chunks; ++c) {
        const auto [begin, end] = ChunkRows(block, step.chunks, c);
        const std::int64_t count = end - begin;
        works[static_cast<std::size_t>(c)]->Wait(); // NCCL: the compute stream waits for this chunk only
        const Tensor chunk = RowsOf(packed, n * begin, n * count);
        for (std::int64_t r = 0; r < n; ++r) {
            const Tensor in = RowsOf(chunk, r * count, count);
            if (total.defined()) {
                RowsOf(total, r * block + begin, count).CopyFrom(in);
            }
            kernel(r * block + begin, count, in);
        }
    }
    return step.chunks;
}

void CheckCommChunks(std::string_view op, int chunks, std::int64_t num_experts, std::int64_t rows,
                     bool sequence_parallel) {
    SHARDLINE_CHECK(chunks >= 0, op, "comm_chunks must be >= 0 (0 or 1: no pipeline), got {}", chunks);
    if (chunks <= 1) {
        return;
    }
    SHARDLINE_CHECK(num_experts == 0, op,
                    "comm_chunks ({}) pipelines a Linear's rows; a grouped layer (num_experts {}) takes 0 or 1", chunks,
                    num_experts);
    SHARDLINE_CHECK_AS(ShapeError, chunks <= rows, op,
                       "comm_chunks ({}) must be <= the rows it splits, {} ({}), so that every chunk has a row", chunks,
                       rows,
                       sequence_parallel ? "x's leading dims flattened, over tp: one rank's block of the sequence"
                                         : "x's leading dims flattened");
}

} // namespace shardline::functional::detail
