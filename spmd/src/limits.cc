#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/spmd/error.h>
#include <shardline/spmd/layout.h>
#include <shardline/spmd/limits.h>

namespace shardline::spmd {

int64_t CheckedMul(int64_t a, int64_t b, std::string_view what) {
    int64_t out = 0;
    if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &out)) {
        throw SpmdError(fmt::format("{}: {} * {} exceeds the int64 range", what, a, b));
    }
    return out;
}

int64_t CheckedAdd(int64_t a, int64_t b, std::string_view what) {
    int64_t out = 0;
    if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &out)) {
        throw SpmdError(fmt::format("{}: {} + {} exceeds the int64 range", what, a, b));
    }
    return out;
}

int64_t CheckedProduct(const std::vector<int64_t> &values, std::string_view what) {
    int64_t product = 1;
    for (int64_t v : values) {
        product = CheckedMul(product, v, what);
    }
    return product;
}

void CheckShape(const std::vector<int64_t> &shape, std::string_view what) {
    if (shape.size() > static_cast<size_t>(kMaxTensorRank)) {
        throw SpmdError(fmt::format("{}: a tensor has at most {} dims, got {}", what, kMaxTensorRank, shape.size()));
    }
    int64_t elements = 1;
    for (int64_t s : shape) {
        if (s < 0) {
            throw SpmdError(fmt::format("{}: dims must be >= 0, got {}", what, ShapeToString(shape)));
        }
        // Bounded before the product can overflow: elements <= kMaxElements (2^50) and s <= kMaxElements.
        if (s > kMaxElements || (s > 0 && elements > kMaxElements / s)) {
            throw SpmdError(fmt::format("{}: {} has more than {} elements (2^50; a 0-size dim counted as 1)", what,
                                        ShapeToString(shape), kMaxElements));
        }
        elements *= s > 0 ? s : 1;
    }
}

} // namespace shardline::spmd
