#pragma once

// Shared by the functional layer's dist tests (functional_*_test.cc): meshes built once per process, full tensors
// from one seed, the dense float64 problem, exact collective counts, and RunColumn / RunRow, which run one
// column/row-parallel Linear forward + backward through the functional API and compare every output and gradient with
// the dense reference. BACKEND cpu (MPI) and BACKEND cuda (NCCL; SHARDLINE_FUNCTIONAL_TEST_CUDA) build them.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include <shardline/comm/device_mesh.h>
#include <shardline/core/tensor.h>
#include <shardline/functional/parallel_linear.h>

#include "dist_test.h"
#include "reference.h"

#if SHARDLINE_FUNCTIONAL_TEST_CUDA
#include <cuda_runtime_api.h>
#define SHARDLINE_FUNCTIONAL_TEST_BACKEND() SHARDLINE_DIST_REQUIRE_CUDA()
#else
#define SHARDLINE_FUNCTIONAL_TEST_BACKEND()                                                                            \
    do {                                                                                                               \
    } while (0)
#endif

namespace shardline::functional_test {

using comm::DeviceMesh;
using functional::ColumnParallelLinearBackward;
using functional::ColumnParallelLinearForward;
using functional::ColumnParallelLinearOptions;
using functional::GradMode;
using functional::RowParallelLinearBackward;
using functional::RowParallelLinearForward;
using functional::RowParallelLinearOptions;
using functional::TensorParallelGroup;
using functional::TensorView;
using testing::Values;

constexpr std::int64_t kIn = 16;  // K: divides by 1, 2 and 4
constexpr std::int64_t kOut = 24; // N: divides by 1, 2 and 4

comm::Communicator &World();
Device TestDevice();

// ---- meshes: built once per process (an NCCL split costs ~1 s on 4 ranks), torn down before the environment
// ----------

enum class MeshKind {
    kTp,   ///< [W] {"tp"}: every rank in one tp group
    kDpTp, ///< [W/2, 2] {"dp", "tp"}, tp_dim 1 ([1, 1] on one rank)
    kTpDp, ///< [2, W/2] {"tp", "dp"}, tp_dim 0 ([1, 1] on one rank)
};

struct MeshAndDim {
    DeviceMesh &mesh;
    int tp_dim;
    std::int64_t tp() const { return mesh.shape()[static_cast<std::size_t>(tp_dim)]; }
    /// This rank's coordinate on the mesh dim that is not tp (0 on a 1-D mesh): the data-parallel replica.
    std::int64_t replica() const {
        return mesh.ndim() == 1 ? 0 : mesh.coordinate()[static_cast<std::size_t>(1 - tp_dim)];
    }
    TensorParallelGroup group() const { return TensorParallelGroup{.mesh = &mesh, .tp_dim = tp_dim}; }
};

MeshAndDim GetMesh(MeshKind kind);

// ---- tensors
// ---------------------------------------------------------------------------------------------------------

enum class Data { kInteger, kRandom };
std::string DataName(Data data);

/// A full tensor, the same on every rank of one data-parallel replica: a pure function of (seed, name, index).
Tensor MakeFull(const Shape &shape, std::string_view name, Data data, DType dtype, std::uint64_t seed);

/// An output buffer filled with NaN, so an element the call does not write fails every comparison.
Tensor Poisoned(const Shape &shape, DType dtype);

/// This rank's part of `full` split on `tensor_dim` over tp (a copy; -1: the whole tensor, copied).
Tensor Shard(const Tensor &full, int tensor_dim, const MeshAndDim &m);

/// The full tensor from every tp rank's `local` split on `tensor_dim` (all-gathers over tp; -1: local is full).
Tensor Gather(const Tensor &local, const Shape &global, int tensor_dim, const MeshAndDim &m);

TensorView ViewOf(const Tensor &t);
Shape WithLast(Shape shape, std::int64_t last);
Values Plus(Values a, const Values &b);

/// Bitwise for integer data, CompareValues (rtol by dtype) for random data. `reduced_over` is the number of ranks whose
/// half-precision partial results were summed into `got` (row y, column dx): each partial is rounded to the dtype and
/// the reduction rounds each of its additions (NCCL reduces in the dtype), about 2·tp roundings instead of the one of a
/// local GEMM, so a half type's rtol is multiplied by tp there (simulated on these shapes: fp16 at tp 4 reaches 2.5x
/// its rtol, bf16 1.1x). float32's rtol (1e-5, some 170 roundings) needs no scaling.
::testing::AssertionResult Matches(const Tensor &got, const Values &want, Data data, DType dtype,
                                   std::int64_t reduced_over = 1);

/// Byte-for-byte equality of two tensors (host copies; both undefined is equal), so NaN poison or a -0/+0 difference
/// fails: what the overlapped and pipelined paths promise against the plain one.
::testing::AssertionResult Bitwise(const Tensor &a, const Tensor &b);

// ---- collective counts
// -----------------------------------------------------------------------------------------------

struct Calls {
    std::int64_t all_reduce = 0;
    std::int64_t all_gather = 0;
    std::int64_t reduce_scatter = 0;
};

/// Zeroes the counters of every group of the mesh (creating them: every rank asks in the same order).
void ResetCounts(const MeshAndDim &m);

/// The tp group ran exactly `want` (nothing when tp = 1); every other group and the world ran nothing.
void ExpectCalls(const MeshAndDim &m, Calls want, std::string_view what);

// ---- the dense problem
// -------------------------------------------------------------------------------------------------

struct Problem {
    Shape lead; ///< global leading dims [s, ...]
    Data data = Data::kInteger;
    DType dtype = DType::kFloat32;
    std::uint64_t seed = 1;
};

struct Dense {
    Tensor x, w, b, dy;   ///< full tensors on the test device
    Values y, dx, dw, db; ///< float64 references
};
Dense MakeDense(const Problem &p, const MeshAndDim &m);

/// Which gradients a backward asks for, and how the parameter grads are written.
struct Wants {
    bool dx = true;
    bool dweight = true;
    bool dbias = true;
    GradMode mode = GradMode::kOverwrite;
};

/// Three fp32 problems: integer [8, 2], random [8, 2], integer [12].
const std::vector<Problem> &Fp32Problems();

// ---- one column / row-parallel Linear forward + backward against the dense problem, with its collectives
// -----------

struct ColumnCase {
    MeshKind mesh = MeshKind::kTp;
    Problem problem{};
    bool bias = true;
    bool gather_output = false;
    bool sequence_parallel = false;
    bool keep_x_total = true; ///< sequence_parallel: the forward fills x_total and the backward reuses it
    Wants wants{};
};
void RunColumn(const ColumnCase &c);

struct RowCase {
    MeshKind mesh = MeshKind::kTp;
    Problem problem{};
    bool bias = true;
    bool input_is_parallel = true;
    bool sequence_parallel = false;
    Wants wants{};
};
void RunRow(const RowCase &c);

} // namespace shardline::functional_test
