// PyTorch baseline of the paired suite (torch_rows.cpp, built when Debian's
// libtorch-dev is found). Kept behind this small interface so that the
// suite's own translation unit never includes libtorch's headers.
#pragma once

#include <functional>
#include <string>

namespace headmix::bench::torch_rows {

/// Which of libtorch's MHA paths a row runs.
enum class Path {
  // at::_native_multi_head_attention: what Python's nn.MultiheadAttention
  // calls in eval / no-grad (fused QKV projection and masked softmax). In
  // torch 1.13 its CPU kernel takes no attention mask, so no causal row.
  fused,
  // torch::nn::MultiheadAttention::forward: the unfused math (separate
  // baddbmm / softmax / bmm), with an additive float mask when causal.
  module,
};

const char* path_name(Path p);

/// One forward of torch's MHA over a random [T, D] sequence (B = 1, float,
/// inference mode) at `threads` threads, weights fixed by a seed. Empty when
/// the path cannot run the shape (fused and causal).
std::function<void()> make_call(Path path, long D, long H, long T, bool causal, int threads);

/// How the torch rows ran: version, kernel, BLAS and threading, as text.
std::string setup();

}  // namespace headmix::bench::torch_rows
