// Analytic work counts. Every variant has a `flops(...)` next to it that
// counts the multiply-adds its math needs; the benchmark turns that into
// GFLOP/s (2 FLOPs per multiply-add).
#pragma once

#include <cstdint>

namespace headmix {

struct FlopCount {
  std::int64_t projection_macs = 0;  ///< input and output projections
  std::int64_t attention_macs = 0;   ///< scores, mixing and readout over visible (query, key) pairs
  std::int64_t macs() const { return projection_macs + attention_macs; }
  double flops() const { return 2.0 * static_cast<double>(macs()); }
};

}  // namespace headmix
