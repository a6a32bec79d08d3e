// Errors and argument checks.
//
// Public entry points validate once, with the check_* functions below, and
// throw shape_error whose message names the variant, the argument and both
// shapes. Kernels below the entry only use HEADMIX_ASSERT.
#pragma once

#include "headmix/core/types.hpp"

#include <array>
#include <cassert>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifndef HEADMIX_ASSERT
#define HEADMIX_ASSERT(cond) assert(cond)
#endif

namespace headmix {

/// A shape, head count or option does not fit. Derived from
/// std::invalid_argument; the message reads
/// "[variant] argument: expected [a, b], got [c, d]", and each part is a
/// field of its own.
class shape_error : public std::invalid_argument {
 public:
  shape_error(std::string variant, std::string argument, std::string expected, std::string actual)
      : std::invalid_argument("[" + variant + "] " + argument + ": expected " + expected + ", got " + actual),
        variant_(std::move(variant)),
        argument_(std::move(argument)),
        expected_(std::move(expected)),
        actual_(std::move(actual)) {}

  const std::string& variant() const { return variant_; }
  const std::string& argument() const { return argument_; }  ///< a tensor's or an option's name
  const std::string& expected() const { return expected_; }
  const std::string& actual() const { return actual_; }

  /// The same error about another argument name (a tensor as stored).
  shape_error renamed(const std::string& argument) const { return {variant_, argument, expected_, actual_}; }

 private:
  std::string variant_, argument_, expected_, actual_;
};

namespace detail {

inline std::string format_shape(const Shape& shape) {
  std::ostringstream s;
  s << '[';
  for (std::size_t i = 0; i < shape.rank(); ++i) {
    if (i == Shape::kMaxRank) {
      s << ", ... (rank " << shape.rank() << ")";
      break;
    }
    s << (i ? ", " : "") << shape[i];
  }
  s << ']';
  return s.str();
}

[[noreturn]] inline void throw_shape(const std::string& variant, const std::string& arg, const std::string& expected,
                                     const std::string& got) {
  throw shape_error(variant, arg, expected, got);
}

}  // namespace detail

/// `actual` must equal `expected`; a -1 in `expected` accepts any extent.
/// Allocates only when it throws.
inline void check_shape(const char* variant, const char* arg, const Shape& expected, const Shape& actual) {
  bool ok = expected.rank() == actual.rank();
  for (std::size_t i = 0; ok && i < expected.rank(); ++i) ok = expected[i] < 0 || expected[i] == actual[i];
  if (ok) return;
  std::vector<Index> shown;
  for (std::size_t i = 0; i < expected.rank(); ++i)
    shown.push_back(expected[i] < 0 && i < actual.rank() ? actual[i] : expected[i]);
  detail::throw_shape(variant, arg, detail::format_shape(shown), detail::format_shape(actual));
}
inline void check_shape(const std::string& variant, const std::string& arg, const Shape& expected,
                        const Shape& actual) {
  check_shape(variant.c_str(), arg.c_str(), expected, actual);
}

template <class Derived>
Shape shape_of(const Eigen::EigenBase<Derived>& m) {
  if (Derived::ColsAtCompileTime == 1) return {m.rows()};
  return {m.rows(), m.cols()};
}

/// A matrix argument must be `rows x cols`.
template <class Derived>
void check_matrix(const std::string& variant, const std::string& arg, const Eigen::EigenBase<Derived>& m, Index rows,
                  Index cols) {
  check_shape(variant, arg, {rows, cols}, {m.rows(), m.cols()});
}

/// A vector argument must have `n` entries.
template <class Derived>
void check_vector(const std::string& variant, const std::string& arg, const Eigen::EigenBase<Derived>& v, Index n) {
  check_shape(variant, arg, {n}, {v.size()});
}

/// A scalar setting must satisfy `ok`; `expected` says what was wanted.
inline void check_value(bool ok, const char* variant, const char* arg, const char* expected, long long actual) {
  if (!ok) detail::throw_shape(variant, arg, expected, std::to_string(actual));
}
inline void check_value(bool ok, const std::string& variant, const std::string& arg, const std::string& expected,
                        long long actual) {
  if (!ok) detail::throw_shape(variant, arg, expected, std::to_string(actual));
}

}  // namespace headmix
