// The smallest real use of headmix: one self-attention call.
#include <headmix/headmix.hpp>

#ifdef NLOHMANN_JSON_VERSION_MAJOR
#error "headmix/headmix.hpp should not need nlohmann/json: only headmix/io.hpp does"
#endif

#include <iostream>

int main() {
  headmix::MhaWeights<float> w;
  for (auto* lin : {&w.q, &w.k, &w.v, &w.o}) lin->weight = headmix::Matrix<float>::Identity(8, 8);
  headmix::MhaOptions opt;
  opt.num_heads = 2;
  headmix::Mha<float> attn(w, opt);
  headmix::Matrix<float> x = headmix::Matrix<float>::Ones(3, 8);
  headmix::Matrix<float> y = attn.forward(x);
  // Every query sees identical keys, so the output equals the input.
  const float err = (y - x).cwiseAbs().maxCoeff();
  std::cout << "consumer: max |y - x| = " << err << "\n";
  return err < 1e-6f ? 0 : 1;
}
