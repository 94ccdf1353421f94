#include <cstdlib>
#include <cstring>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <shardline/core/error.h>
#include <shardline/core/logging.h>
#include <shardline/core/tensor.h>

#include "cuda_backend.h"
#include "host_convert.h"

namespace shardline {
namespace {

constexpr std::size_t kCpuAlignment = 64;

void CheckDeviceAvailable(Device device, std::string_view op) {
    if (device.is_cpu()) {
        return;
    }
#if SHARDLINE_HAVE_CUDA
    const int count = CudaDeviceCount();
    SHARDLINE_CHECK_AS(DeviceError, device.index >= 0 && device.index < count, op,
                       "device {} is not available ({} CUDA device(s) visible)", ToString(device), count);
#else
    SHARDLINE_THROW(DeviceError, op, "device {} needs a build with CUDA (SHARDLINE_WITH_CUDA=ON)", ToString(device));
#endif
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------------
// Storage

std::shared_ptr<Storage> Storage::Allocate(std::size_t bytes, Device device) {
    CheckDeviceAvailable(device, "Storage::Allocate");
    void* data = nullptr;
    std::size_t cache_block_bytes = 0;
    if (bytes > 0) {
        if (device.is_cpu()) {
            const std::size_t rounded = (bytes + kCpuAlignment - 1) / kCpuAlignment * kCpuAlignment;
            data = std::aligned_alloc(kCpuAlignment, rounded);
            SHARDLINE_CHECK(data != nullptr, "Storage::Allocate", "could not allocate {} bytes on the host", bytes);
        } else {
#if SHARDLINE_HAVE_CUDA
            data = detail::CudaAllocate(bytes, device.index, &cache_block_bytes);
#endif
        }
    }
    try {
        return std::make_shared<Storage>(Key(), data, bytes, device, /*owned=*/true, cache_block_bytes);
    } catch (...) {
        // No room on the host for the Storage: this one, on the stack, gives the memory back as the error leaves.
        const Storage release(Key(), data, bytes, device, /*owned=*/true, cache_block_bytes);
        throw;
    }
}

std::shared_ptr<Storage> Storage::Borrow(void* data, std::size_t bytes, Device device) {
    return std::make_shared<Storage>(Key(), data, bytes, device, /*owned=*/false, 0);
}

Storage::~Storage() {
    if (!owned_ || data_ == nullptr) {
        return;
    }
    if (device_.is_cpu()) {
        std::free(data_);
    } else {
#if SHARDLINE_HAVE_CUDA
        detail::CudaFree(data_, device_.index, cache_block_bytes_);
#endif
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Shapes

Shape ContiguousStrides(const Shape& shape) {
    Shape strides(shape.size(), 1);
    for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    return strides;
}

std::int64_t Numel(const Shape& shape) {
    return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}

std::string ShapeToString(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// ---------------------------------------------------------------------------------------------------------------------
// Tensor

Tensor Tensor::Empty(Shape shape, DType dtype, Device device) {
    for (std::int64_t d : shape) {
        SHARDLINE_CHECK_AS(ShapeError, d >= 0, "Tensor::Empty", "dims must be >= 0, got shape {}",
                           ShapeToString(shape));
    }
    auto storage = Storage::Allocate(static_cast<std::size_t>(Numel(shape)) * ElementSize(dtype), device);
    return Contiguous(std::move(storage), std::move(shape), dtype);
}

Tensor Tensor::Zeros(Shape shape, DType dtype, Device device) { return Full(std::move(shape), 0.0, dtype, device); }

Tensor Tensor::Full(Shape shape, double value, DType dtype, Device device) {
    Tensor t = Empty(std::move(shape), dtype, device);
    t.Fill(value);
    return t;
}

Tensor Tensor::FromVector(const std::vector<double>& values, Shape shape, DType dtype) {
    SHARDLINE_CHECK_AS(ShapeError, static_cast<std::int64_t>(values.size()) == Numel(shape), "Tensor::FromVector",
                       "{} values do not fill shape {} ({} elements)", values.size(), ShapeToString(shape),
                       Numel(shape));
    Tensor t = Empty(std::move(shape), dtype, Device::CPU());
    for (std::size_t i = 0; i < values.size(); ++i) {
        detail::StoreFromDouble(t.data(), dtype, static_cast<std::int64_t>(i), values[i]);
    }
    return t;
}

Tensor Tensor::FromBlob(void* data, Shape shape, DType dtype, Device device) {
    auto storage = Storage::Borrow(data, static_cast<std::size_t>(Numel(shape)) * ElementSize(dtype), device);
    return Contiguous(std::move(storage), std::move(shape), dtype);
}

Tensor Tensor::Contiguous(std::shared_ptr<Storage> storage, Shape shape, DType dtype) {
    Tensor t;
    t.device_ = storage->device();
    t.storage_ = std::move(storage);
    t.shape_ = std::move(shape);
    t.dtype_ = dtype;
    t.defined_ = true;
    return t;
}

std::int64_t Tensor::size(int dim) const {
    const int r = rank();
    const int d = dim < 0 ? dim + r : dim;
    SHARDLINE_CHECK_AS(ShapeError, d >= 0 && d < r, "Tensor::size", "dim {} out of range for a rank-{} tensor", dim, r);
    return shape_[d];
}

std::int64_t Tensor::numel() const { return Numel(shape_); }

bool Tensor::is_contiguous() const {
    if (strides_.empty()) {
        return true; // row-major (a strided view keeps its strides even where they happen to be row-major)
    }
    std::int64_t expected = 1;
    for (int d = rank() - 1; d >= 0; --d) {
        if (shape_[d] != 1 && strides_[d] != expected) {
            return false;
        }
        expected *= shape_[d];
    }
    return true;
}

void* Tensor::data() const {
    if (storage_ == nullptr || storage_->data() == nullptr) {
        return nullptr;
    }
    return static_cast<char*>(storage_->data()) + offset_ * static_cast<std::int64_t>(ElementSize(dtype_));
}

void Tensor::CheckDType(DType expected) const {
    SHARDLINE_CHECK_AS(DTypeError, dtype_ == expected, "Tensor::data_as", "requested {} but the tensor is {}",
                       DTypeName(expected), DTypeName(dtype_));
}

Tensor Tensor::View(Shape shape) const {
    SHARDLINE_CHECK_AS(ShapeError, is_contiguous(), "Tensor::View", "needs a contiguous tensor, got {} with strides {}",
                       ToString(), ShapeToString(strides()));
    int infer = -1;
    std::int64_t known = 1;
    for (std::size_t d = 0; d < shape.size(); ++d) {
        if (shape[d] == -1) {
            SHARDLINE_CHECK_AS(ShapeError, infer < 0, "Tensor::View", "only one dim may be -1, got {}",
                               ShapeToString(shape));
            infer = static_cast<int>(d);
        } else {
            known *= shape[d];
        }
    }
    if (infer >= 0) {
        SHARDLINE_CHECK_AS(ShapeError, known > 0 && numel() % known == 0, "Tensor::View",
                           "cannot view {} elements as {}", numel(), ShapeToString(shape));
        shape[infer] = numel() / known;
    }
    SHARDLINE_CHECK_AS(ShapeError, Numel(shape) == numel(), "Tensor::View",
                       "cannot view shape {} ({} elements) as {} ({} elements)", ShapeToString(shape_), numel(),
                       ShapeToString(shape), Numel(shape));
    Tensor t = *this;
    t.strides_.clear(); // row-major
    t.shape_ = std::move(shape);
    return t;
}

Tensor Tensor::Transpose(int dim0, int dim1) const {
    const int r = rank();
    const int d0 = dim0 < 0 ? dim0 + r : dim0;
    const int d1 = dim1 < 0 ? dim1 + r : dim1;
    SHARDLINE_CHECK_AS(ShapeError, d0 >= 0 && d0 < r && d1 >= 0 && d1 < r, "Tensor::Transpose",
                       "dims ({}, {}) out of range for a rank-{} tensor", dim0, dim1, r);
    Tensor t = *this;
    if (t.strides_.empty()) {
        t.strides_ = ContiguousStrides(shape_);
    }
    std::swap(t.shape_[d0], t.shape_[d1]);
    std::swap(t.strides_[d0], t.strides_[d1]);
    return t;
}

Tensor Tensor::Contiguous() const {
    if (is_contiguous()) {
        return *this;
    }
    SHARDLINE_CHECK_AS(ShapeError, rank() <= 8, "Tensor::Contiguous", "supports rank <= 8, got {}", rank());
    Tensor out = Empty(shape_, dtype_, device_);
    // Not contiguous: strides_ holds the view's strides.
    if (device_.is_cpu()) {
        const std::size_t es = ElementSize(dtype_);
        const char* src = static_cast<const char*>(data());
        char* dst = static_cast<char*>(out.data());
        const std::int64_t n = numel();
        for (std::int64_t i = 0; i < n; ++i) {
            std::int64_t rem = i;
            std::int64_t off = 0;
            for (int d = rank() - 1; d >= 0; --d) {
                off += (rem % shape_[d]) * strides_[d];
                rem /= shape_[d];
            }
            std::memcpy(dst + i * es, src + off * static_cast<std::int64_t>(es), es);
        }
    } else {
#if SHARDLINE_HAVE_CUDA
        detail::StridedCopyDesc desc{};
        desc.rank = rank();
        for (int d = 0; d < rank(); ++d) {
            desc.shape[d] = shape_[d];
            desc.stride[d] = strides_[d];
        }
        detail::CudaStridedCopy(data(), out.data(), dtype_, desc, device_.index);
#endif
    }
    return out;
}

Tensor Tensor::To(Device device) const {
    SHARDLINE_CHECK(defined(), "Tensor::To", "called on an undefined tensor");
    const Tensor src = Contiguous();
    Tensor out = Empty(shape_, dtype_, device);
    out.CopyFrom(src);
    return out;
}

void Tensor::CopyFrom(const Tensor& src) {
    SHARDLINE_CHECK_AS(ShapeError, src.shape_ == shape_ && src.dtype_ == dtype_, "Tensor::CopyFrom",
                       "source {} must match destination {}", src.ToString(), ToString());
    SHARDLINE_CHECK_AS(ShapeError, is_contiguous(), "Tensor::CopyFrom", "destination must be contiguous, got {}",
                       ToString());
    const Tensor s = src.Contiguous();
    if (nbytes() == 0) {
        return;
    }
    if (device_.is_cpu() && s.device_.is_cpu()) {
        std::memmove(data(), s.data(), nbytes());
        return;
    }
#if SHARDLINE_HAVE_CUDA
    detail::CudaMemcpy(data(), device_, s.data(), s.device_, nbytes());
#else
    SHARDLINE_THROW(DeviceError, "Tensor::CopyFrom", "CUDA tensors need a build with CUDA");
#endif
}

Tensor Tensor::To(DType dtype) const {
    const Tensor src = Contiguous();
    if (dtype == dtype_) {
        return src.Clone();
    }
    Tensor out = Empty(shape_, dtype, device_);
    const std::int64_t n = numel();
    if (device_.is_cpu()) {
        for (std::int64_t i = 0; i < n; ++i) {
            detail::StoreFromDouble(out.data(), dtype, i, detail::LoadAsDouble(src.data(), dtype_, i));
        }
    } else {
#if SHARDLINE_HAVE_CUDA
        detail::CudaCast(src.data(), dtype_, out.data(), dtype, n, device_.index);
#endif
    }
    return out;
}

void Tensor::Fill(double value) {
    SHARDLINE_CHECK_AS(ShapeError, is_contiguous(), "Tensor::Fill", "needs a contiguous tensor, got {}", ToString());
    if (dtype_ == DType::kInt64) {
        (void)detail::DoubleToInt64(value); // the device kernel cannot raise: check here, for both devices
    }
    const std::int64_t n = numel();
    if (n == 0) {
        return;
    }
    if (device_.is_cpu()) {
        for (std::int64_t i = 0; i < n; ++i) {
            detail::StoreFromDouble(data(), dtype_, i, value);
        }
    } else {
#if SHARDLINE_HAVE_CUDA
        detail::CudaFillValue(data(), dtype_, n, value, device_.index);
#endif
    }
}

std::vector<double> Tensor::ToDoubleVector() const {
    const Tensor host = device_.is_cpu() ? Contiguous() : To(Device::CPU());
    std::vector<double> values(static_cast<std::size_t>(numel()));
    for (std::int64_t i = 0; i < numel(); ++i) {
        values[static_cast<std::size_t>(i)] = detail::LoadAsDouble(host.data(), dtype_, i);
    }
    return values;
}

std::string Tensor::ToString() const {
    if (!defined()) {
        return "Tensor(undefined)";
    }
    return fmt::format("Tensor{} {} {}", ShapeToString(shape_), DTypeName(dtype_), shardline::ToString(device_));
}

} // namespace shardline
