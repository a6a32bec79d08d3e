// Matrix aliases, batch views and a small owning tensor.
//
// headmix stores everything row-major, as PyTorch does: a sequence is a
// [T, D] matrix whose rows are positions, and a batch [B, T, D] is B such
// matrices one after another in memory.
#pragma once

#include <Eigen/Core>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace headmix {

using Index = Eigen::Index;

/// A tensor shape small enough to live on the stack, so that validating a
/// call allocates nothing. Holds up to kMaxRank extents; a longer shape
/// (only ever from a hostile file) keeps its rank and its first extents.
class Shape {
 public:
  static constexpr std::size_t kMaxRank = 8;
  Shape() = default;
  Shape(std::initializer_list<Index> dims) { assign(dims.begin(), dims.size()); }
  Shape(const std::vector<Index>& dims) { assign(dims.data(), dims.size()); }  // NOLINT: implicit on purpose

  std::size_t rank() const { return rank_; }
  Index operator[](std::size_t i) const { return i < kMaxRank ? dims_[i] : -1; }
  friend bool operator==(const Shape& a, const Shape& b) {
    if (a.rank_ != b.rank_) return false;
    for (std::size_t i = 0; i < a.rank_ && i < kMaxRank; ++i)
      if (a.dims_[i] != b.dims_[i]) return false;
    return true;
  }

 private:
  void assign(const Index* dims, std::size_t n) {
    rank_ = n;
    for (std::size_t i = 0; i < n && i < kMaxRank; ++i) dims_[i] = dims[i];
  }
  std::array<Index, kMaxRank> dims_{};
  std::size_t rank_ = 0;
};

template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
template <class T>
using MatrixMap = Eigen::Map<Matrix<T>>;
template <class T>
using ConstMatrixMap = Eigen::Map<const Matrix<T>>;
/// A row-major matrix inside a wider one (e.g. one head's columns of Q).
template <class T>
using StridedMap = Eigen::Map<Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using ConstStridedMap = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// A non-owning view of a batch of sequences `[batch, length, width]`,
/// row-major and contiguous. `T` may be const-qualified.
template <class T>
class BatchView {
 public:
  using Scalar = std::remove_const_t<T>;
  using ItemMap = Eigen::Map<std::conditional_t<std::is_const_v<T>, const Matrix<Scalar>, Matrix<Scalar>>>;

  BatchView() = default;
  BatchView(T* data, Index batch, Index length, Index width)
      : data_(data), batch_(batch), length_(length), width_(width) {}
  /// A mutable view converts to a const one.
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  BatchView(const BatchView<U>& other)  // NOLINT(google-explicit-constructor)
      : data_(other.data()), batch_(other.batch()), length_(other.length()), width_(other.width()) {}

  T* data() const { return data_; }
  Index batch() const { return batch_; }
  Index length() const { return length_; }
  Index width() const { return width_; }
  bool empty() const { return data_ == nullptr; }
  Shape shape() const { return {batch_, length_, width_}; }

  /// Sequence `b` as a `[length, width]` matrix.
  ItemMap item(Index b) const { return ItemMap(data_ + b * length_ * width_, length_, width_); }
  /// All rows of all sequences as one `[batch * length, width]` matrix.
  ItemMap rows() const { return ItemMap(data_, batch_ * length_, width_); }

 private:
  T* data_ = nullptr;
  Index batch_ = 0, length_ = 0, width_ = 0;
};

template <class T>
using ConstBatchView = BatchView<const T>;

/// View one sequence `[T, D]` as a batch of one.
template <class Derived>
auto as_batch(Eigen::PlainObjectBase<Derived>& m) {
  static_assert(Derived::IsRowMajor || Derived::ColsAtCompileTime == 1, "headmix wants row-major matrices");
  return BatchView<typename Derived::Scalar>(m.data(), 1, m.rows(), m.cols());
}
template <class Derived>
auto as_batch(const Eigen::PlainObjectBase<Derived>& m) {
  static_assert(Derived::IsRowMajor || Derived::ColsAtCompileTime == 1, "headmix wants row-major matrices");
  return ConstBatchView<typename Derived::Scalar>(m.data(), 1, m.rows(), m.cols());
}

/// A small owning N-d tensor, row-major. Used for batch outputs, attention
/// weights `[B, H, T, S]` and tensors read from files.
///
/// Storage is aligned as Eigen aligns its own matrices: Eigen's vectorised
/// reductions (a mean, a dot product over a row) peel elements until the
/// first aligned packet, so on a buffer of varying alignment the summation
/// order, and the last bit of the result, would follow the address.
template <class T>
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::vector<Index> shape) { resize(std::move(shape)); }
  Tensor(std::initializer_list<Index> shape) : Tensor(std::vector<Index>(shape)) {}

  /// Reshape; storage is reused when the element count does not grow.
  void resize(std::vector<Index> shape) {
    shape_ = std::move(shape);
    data_.resize(static_cast<std::size_t>(count(shape_)));
  }
  void set_zero() { std::fill(data_.begin(), data_.end(), T(0)); }

  const std::vector<Index>& shape() const { return shape_; }
  Index dim(std::size_t axis) const { return shape_.at(axis); }
  Index rank() const { return static_cast<Index>(shape_.size()); }
  Index size() const { return static_cast<Index>(data_.size()); }
  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  T& operator[](Index i) { return data_[static_cast<std::size_t>(i)]; }
  const T& operator[](Index i) const { return data_[static_cast<std::size_t>(i)]; }

  /// A rank-3 tensor as a batch view.
  BatchView<T> batch() { return {data(), dim(0), dim(1), dim(2)}; }
  ConstBatchView<T> batch() const { return {data(), dim(0), dim(1), dim(2)}; }

  static Index count(const std::vector<Index>& shape) {
    Index n = 1;
    for (Index d : shape) n *= d;
    return n;
  }

 private:
  std::vector<Index> shape_;
  std::vector<T, Eigen::aligned_allocator<T>> data_;
};

namespace detail {
/// Elements of E between rows of n elements that a kernel reads side by
/// side (a decoding step's K_hᵀ rows, DCMHA's key-wise factor rows): whole
/// 64-byte lines, at least one spare, an odd number of them, so that up to
/// 64 consecutive rows start in different L1 sets. Rows a multiple of 4 KiB
/// apart share one set: at S = 1000 (a stride of 1024 floats under an
/// earlier rule) DCMHA took 1.15x its time at S = 1024.
template <class E>
constexpr Index odd_line_stride(Index n) {
  constexpr Index line = 64 / static_cast<Index>(sizeof(E));
  const Index lines = (n + line - 1) / line + 1;
  return (lines % 2 == 0 ? lines + 1 : lines) * line;
}
}  // namespace detail

/// Entries [first, first + count) along one axis of a tensor, the other
/// axes whole: the part of a checkpoint tensor one process of a sharded
/// layer reads (rows of a projection, columns of the output projection).
struct AxisSlice {
  std::size_t axis = 0;
  Index first = 0;
  Index count = 0;
};

}  // namespace headmix
