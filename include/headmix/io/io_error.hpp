// The error of reading weights: a malformed file, an unreadable path, a
// missing tensor, a stored tensor the layer does not have. Its own header so
// that core/linear.hpp's from_tensors helpers can throw it without pulling in
// the safetensors reader.
#pragma once

#include <stdexcept>

namespace headmix::io {

/// A malformed file, an unreadable path, a missing tensor, or a value that
/// does not fit the requested element type.
class io_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace headmix::io
