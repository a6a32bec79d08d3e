// PyTorch rows of the paired suite. Two paths (torch_rows.hpp): the fused
// at::_native_multi_head_attention (Python's eval fast path) and the
// module's unfused forward; the suite times headmix against each and names
// the faster as the baseline.
//
// Threads: at::set_num_threads bounds torch's OpenMP workers; its GEMMs run
// in OpenBLAS (libblas.so.3 -> OpenBLAS on Debian), whose own thread count
// is set to the same number here, since OPENBLAS_NUM_THREADS alone would be
// process-wide and at::set_num_threads does not reach it.
#include "torch_rows.hpp"

#include <torch/torch.h>

#include <memory>

extern "C" void openblas_set_num_threads(int);  // torch's BLAS, linked into the suite

namespace headmix::bench::torch_rows {

namespace {

// Set torch's and OpenBLAS's thread counts, only when they change: a
// change rebuilds torch's thread pools.
void use_threads(int threads) {
  static int current = -1;
  openblas_set_num_threads(threads);
  if (threads != current) {
    at::set_num_threads(threads);
    current = threads;
  }
}

struct Row {
  torch::nn::MultiheadAttention mha{nullptr};
  torch::Tensor x, mask;
};

}  // namespace

const char* path_name(Path p) {
  return p == Path::fused ? "torch fused (_native_multi_head_attention)" : "torch unfused (nn::MultiheadAttention)";
}

std::function<void()> make_call(Path path, long D, long H, long T, bool causal, int threads) {
  if (path == Path::fused && causal) return {};
  c10::InferenceMode guard;
  torch::manual_seed(0);
  auto row = std::make_shared<Row>();
  row->mha = torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(D, H));
  row->mha->eval();
  if (path == Path::fused) {
    row->x = torch::randn({1, T, D});  // [B, T, D]
    return [row, D, H, threads] {
      use_threads(threads);
      c10::InferenceMode g;
      auto& m = *row->mha;
      auto out = at::_native_multi_head_attention(row->x, row->x, row->x, D, H, m.in_proj_weight, m.in_proj_bias,
                                                  m.out_proj->weight, m.out_proj->bias, {},
                                                  /*need_weights=*/false);
      torch::Tensor y = std::get<0>(out);
      asm volatile("" : : "r"(y.data_ptr()) : "memory");
    };
  }
  row->x = torch::randn({T, 1, D});  // [T, B, D]: this torch's C++ module has no batch_first
  if (causal)
    row->mask = torch::zeros({T, T}).masked_fill(torch::ones({T, T}, torch::kBool).triu(1), -INFINITY);
  return [row, threads] {
    use_threads(threads);
    c10::InferenceMode g;
    auto out = row->mha->forward(row->x, row->x, row->x, {}, /*need_weights=*/false, row->mask);
    torch::Tensor y = std::get<0>(out);
    asm volatile("" : : "r"(y.data_ptr()) : "memory");
  };
}

std::string setup() {
  const bool openmp = at::get_parallel_info().find("OpenMP") != std::string::npos;
  return std::string("libtorch ") + TORCH_VERSION + ", float, B = 1, eval, c10::InferenceMode; threads: "
         "at::set_num_threads(n) (" + (openmp ? "OpenMP" : "native") + " backend) and openblas_set_num_threads(n) "
         "per row; GEMM: " + (at::hasMKL() ? "MKL" : "BLAS = OpenBLAS (libblas.so.3)") +
         "; causal rows: the module with an additive -inf mask (the fused CPU kernel of this torch takes no "
         "attention mask)";
}

}  // namespace headmix::bench::torch_rows
