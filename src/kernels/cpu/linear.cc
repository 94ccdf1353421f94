// CPU LinearBackwardBias: the column sum of dy, accumulated in fp64 row by row (dy is read once, in order).

#include <cstdint>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace shardline::kernels::cpu {
namespace {

template <class In, class Out> void ColumnSum(const LinearBackwardBiasArgs &args) {
    const std::int64_t cols = args.dy.shape().back();
    const std::int64_t rows = cols == 0 ? 0 : args.dy.numel() / cols;
    const In *dy = static_cast<const In *>(args.dy.data());
    Out *db = static_cast<Out *>(args.dbias.data());
    std::vector<double> acc(static_cast<std::size_t>(cols), 0.0);
    for (std::int64_t r = 0; r < rows; ++r) {
        const In *row = dy + r * cols;
        for (std::int64_t j = 0; j < cols; ++j) {
            acc[j] += static_cast<double>(row[j]);
        }
    }
    for (std::int64_t j = 0; j < cols; ++j) {
        db[j] = static_cast<Out>(args.accumulate ? static_cast<double>(db[j]) + acc[j] : acc[j]);
    }
}

} // namespace

void LinearBackwardBias(const LinearBackwardBiasArgs &args) {
    // The wrapper admits dy float32/float64 and dbias of dy's dtype or float32.
    const bool dy64 = args.dy.dtype() == DType::kFloat64;
    const bool db64 = args.dbias.dtype() == DType::kFloat64;
    if (dy64 && db64) {
        ColumnSum<double, double>(args);
    } else if (dy64) {
        ColumnSum<double, float>(args);
    } else if (db64) {
        ColumnSum<float, double>(args);
    } else {
        ColumnSum<float, float>(args);
    }
}

} // namespace shardline::kernels::cpu
