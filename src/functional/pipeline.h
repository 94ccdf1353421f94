#pragma once

// Private to src/functional: the chunked collective-GEMM pipelines of options.comm_chunks = C > 1 (DESIGN.md §10,
// docs/functional.md "Chunked pipelines"). The sequence (which kernels, which plan) stays in parallel_linear.cc; this
// file runs one plan step in C chunks around a caller's kernel on rows:
//
//   GEMM + reduction (GemmThenReduce): the partial output [M, n] is computed in C chunks of rows and each chunk's
//   all-reduce (reduce-scatter) is issued as soon as its GEMM is queued, the next chunk's GEMM running meanwhile.
//   All-gather + GEMM (GatherThenGemm): the input is all-gathered in C chunks, all issued at once, and each chunk's
//   GEMMs run as soon as it has arrived.
//
// Chunks are ranges of rows (x's leading dims flattened), split as evenly as possible: chunk c of R rows has
// R / C rows, plus one for the first R % C chunks, so C <= R gives C non-empty chunks whatever C and R. Under sequence
// parallelism each chunk is a range *within each rank's block* of the sequence: for a reduce-scatter, chunk c is rows
// [c0, c1) of every rank's block, so its reduce-scatter is an ordinary reduce-scatter of a contiguous buffer [tp, rows,
// n] (rank r's block first) whose result is rows [c0, c1) of this rank's output, contiguous; for an all-gather, chunk c
// is rows [c0, c1) of every rank's input, gathered into a contiguous [tp, rows, n]. The output rows of a chunk are then
// tp blocks at stride R/tp: the kernel runs once per rank block (a plain GEMM on contiguous rows), not as one strided
// GEMM, so every provider and every kernel option (bias, GELU epilogues) serves it unchanged.

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include <shardline/comm/communicator.h>
#include <shardline/comm/device_mesh.h>
#include <shardline/core/tensor.h>
#include <shardline/spmd/redistribute.h>

namespace shardline::functional::detail {

/// A plan that the pipelines run in chunks: exactly one collective, on one mesh dim, that is an all-reduce (sum), or a
/// reduce-scatter (sum) or an all-gather of tensor dim 0 (sequence parallelism).
struct ChunkedCollective {
    spmd::Collective kind = spmd::Collective::kAllReduce;
    comm::Communicator *group = nullptr;
    std::int64_t members = 1; ///< the group's size
    int chunks = 1;
};

/// `plan` as a ChunkedCollective when chunks > 1 and the plan is one the pipelines take (the one eligibility
/// predicate); std::nullopt otherwise: the call moves by the plan, unchunked.
std::optional<ChunkedCollective> ChunkedStep(const spmd::RedistributePlan &plan, comm::DeviceMesh &mesh, int chunks);

/// [begin, end) of chunk c when `rows` are split into `chunks` (the first rows % chunks chunks take one more row).
std::pair<std::int64_t, std::int64_t> ChunkRows(std::int64_t rows, int chunks, int c);

/// Rows [begin, begin + count) of `t` seen as a matrix [rows, t.shape().back()]: a [count, last] view of the same
/// memory (contiguous; it does not own the memory, so `t`'s owner must outlive it).
Tensor RowsOf(const Tensor &t, std::int64_t begin, std::int64_t count);

/// Chunked reductions in flight (GemmThenReduce). Wait() waits for each in issue order (NCCL: event waits on the
/// compute stream, no host wait; MPI: until each completed). Holds the packed partial outputs of a reduce-scatter
/// until then.
class PendingChunks {
public:
    int collectives() const { return static_cast<int>(works_.size()); }
    void Add(comm::WorkHandle work) { works_.push_back(std::move(work)); }
    void Keep(Tensor buffer) { buffer_ = std::move(buffer); }
    void Wait();

private:
    std::vector<comm::WorkHandle> works_;
    Tensor buffer_;
};

/// GEMM + reduction. `kernel(begin, count, out)` writes rows [begin, begin + count) of this rank's partial output (a
/// [count, n] view) into `out`; the partial output has `rows` = members · out's rows for a reduce-scatter, out's rows
/// for an all-reduce. `out`: all-reduce: the partial output itself, reduced in place chunk by chunk; reduce-scatter:
/// the destination, this rank's [rows / members, n] block of the sum (written directly, no copy).
PendingChunks GemmThenReduce(const ChunkedCollective &step, const Tensor &out,
                             const std::function<void(std::int64_t, std::int64_t, Tensor &)> &kernel);

/// All-gather + GEMM of a tensor split on dim 0: `local` is this rank's [R, n] rows, gathered in chunks; as chunk c
/// arrives, `kernel(begin, count, in)` runs once per member's block with `in` the [count, n] rows that are rows
/// [begin, begin + count) of the gathered [members · R, n] tensor. `total`, when defined, receives the whole gathered
/// tensor ([members · R, n], rows copied as they arrive). Waits for every chunk before it returns; returns the number
/// of collectives (chunks).
int GatherThenGemm(const ChunkedCollective &step, const Tensor &local, const Tensor &total,
                   const std::function<void(std::int64_t, std::int64_t, const Tensor &)> &kernel);

/// The options' comm_chunks against the call, before any collective (every rank raises alike): C >= 0; C > 1 only for
/// a Linear (num_experts 0), and C <= `rows`, the rows the call's pipelines split (x's leading dims flattened, divided
/// by tp under sequence parallelism: one rank's block).
void CheckCommChunks(std::string_view op, int chunks, std::int64_t num_experts, std::int64_t rows,
                     bool sequence_parallel);

} // namespace shardline::functional::detail
