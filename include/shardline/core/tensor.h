#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <shardline/core/device.h>
#include <shardline/core/dtype.h>

namespace shardline {

using Shape = std::vector<std::int64_t>;

/// A block of memory on one device. CPU storage is 64-byte aligned; CUDA storage comes from the device's pool
/// (cudaMallocAsync on the context stream) or, ≤ 1 MiB, its small-block cache, and goes back there on release.
class Storage {
    /// Only Allocate and Borrow make a Storage (the constructor is public for make_shared: one heap block).
    class Key {
        friend class Storage;
        Key() = default;
    };

public:
    /// Allocates `bytes` on `device` (0 bytes gives a null pointer).
    static std::shared_ptr<Storage> Allocate(std::size_t bytes, Device device);
    /// Wraps memory owned by someone else; it is never freed by shardline.
    static std::shared_ptr<Storage> Borrow(void* data, std::size_t bytes, Device device);

    Storage(Key, void* data, std::size_t bytes, Device device, bool owned, std::size_t cache_block_bytes) noexcept
        : data_(data), bytes_(bytes), cache_block_bytes_(cache_block_bytes), device_(device), owned_(owned) {}
    Storage(const Storage&) = delete;
    Storage& operator=(const Storage&) = delete;
    ~Storage();

    void* data() const { return data_; }
    std::size_t bytes() const { return bytes_; }
    Device device() const { return device_; }

private:
    void* data_ = nullptr;
    std::size_t bytes_ = 0;
    std::size_t cache_block_bytes_ = 0; ///< CUDA: the block's rounded size when the small-block cache's, 0: the pool's
    Device device_;
    bool owned_ = false;
};

/// Row-major contiguous strides for a shape.
Shape ContiguousStrides(const Shape& shape);

/// An n-d array view over shared storage: shape, strides (in elements), dtype, device and an element offset.
/// Tensors made by shardline are row-major contiguous; Transpose() makes a strided view, which kernels reject
/// (call Contiguous() first). Copies of a Tensor share storage.
class Tensor {
public:
    Tensor() = default;

    /// Uninitialised tensor.
    static Tensor Empty(Shape shape, DType dtype, Device device = Device::CPU());
    static Tensor Zeros(Shape shape, DType dtype, Device device = Device::CPU());
    static Tensor Full(Shape shape, double value, DType dtype, Device device = Device::CPU());
    /// A CPU tensor from values (row-major), each rounded to dtype as Fill does (int64: truncated toward zero).
    static Tensor FromVector(const std::vector<double>& values, Shape shape, DType dtype = DType::kFloat64);
    /// Wraps caller-owned memory (row-major contiguous); shardline never frees it.
    static Tensor FromBlob(void* data, Shape shape, DType dtype, Device device);

    /// False for a default-constructed Tensor.
    bool defined() const { return defined_; }
    const Shape& shape() const { return shape_; }
    /// Strides in elements, by value. A Transpose view (and its copies, and Contiguous() of one that is already
    /// contiguous, e.g. over a size-1 dim) keeps its own; every other tensor is row-major, stores none, and these are
    /// computed (an allocation: kernels check is_contiguous() instead).
    Shape strides() const { return strides_.empty() ? ContiguousStrides(shape_) : strides_; }
    /// Size of one dimension; negative dims count from the end.
    std::int64_t size(int dim) const;
    int rank() const { return static_cast<int>(shape_.size()); }
    std::int64_t numel() const;
    std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * ElementSize(dtype_); }
    DType dtype() const { return dtype_; }
    Device device() const { return device_; }
    bool is_contiguous() const;
    std::int64_t offset() const { return offset_; }
    const std::shared_ptr<Storage>& storage() const { return storage_; }

    /// Pointer to the first element (storage + offset).
    void* data() const;
    /// Typed pointer; throws DTypeError when T is not this tensor's element type.
    template <class T> T* data_as() const {
        CheckDType(DTypeOf<T>::kValue);
        return static_cast<T*>(data());
    }

    /// Same storage, new shape with the same numel (contiguous tensors only). One dim may be -1.
    Tensor View(Shape shape) const;
    /// Strided view with two dims swapped (no copy).
    Tensor Transpose(int dim0, int dim1) const;
    /// This tensor if contiguous, else a contiguous copy on the same device.
    Tensor Contiguous() const;
    /// A deep copy on `device` (same dtype). Synchronous when the destination is the CPU. From the CPU to a GPU the
    /// copy is queued on the device's stream and the host does not wait for the work queued before it (a training
    /// loop's next batch uploads while the GPU runs); this tensor may be changed or freed as soon as the call returns.
    Tensor To(Device device) const;
    /// A copy converted to `dtype` on the same device. To int64: truncation toward zero; on the CPU a NaN, an infinity
    /// or a value out of the int64 range is a DTypeError, on CUDA it saturates (NaN gives INT64_MIN). From int64:
    /// through double (exact for |v| <= 2^53).
    Tensor To(DType dtype) const;
    Tensor Clone() const { return To(device_); }
    /// Copies src into this tensor (same shape and dtype, any devices).
    void CopyFrom(const Tensor& src);
    /// Fills with one value (int64: truncated toward zero; NaN, infinities and out-of-range values are a DTypeError).
    void Fill(double value);

    /// The values as float64 on the host, row-major (for tests and references).
    std::vector<double> ToDoubleVector() const;

    /// "Tensor[2, 3] bfloat16 cuda:0".
    std::string ToString() const;

private:
    /// A row-major contiguous tensor over the whole of `storage`.
    static Tensor Contiguous(std::shared_ptr<Storage> storage, Shape shape, DType dtype);
    void CheckDType(DType expected) const;

    std::shared_ptr<Storage> storage_;
    Shape shape_;
    Shape strides_; ///< empty means row-major (so that making or copying one allocates none); set by Transpose only
    std::int64_t offset_ = 0;
    DType dtype_ = DType::kFloat32;
    Device device_;
    bool defined_ = false;
};

/// Product of the dims.
std::int64_t Numel(const Shape& shape);
/// "[2, 3]".
std::string ShapeToString(const Shape& shape);

} // namespace shardline
