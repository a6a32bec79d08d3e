// headmix::io: a layer saved to a safetensors file and loaded back.
#include <headmix/headmix.hpp>
#include <headmix/io.hpp>

#include <cstdio>
#include <iostream>

int main() {
  headmix::Tensor<float> w({4, 4});
  for (headmix::Index i = 0; i < w.size(); ++i) w[i] = i % 5 == 0 ? 1.0f : 0.0f;  // the identity
  headmix::io::TensorFile file;
  for (const char* name : {"q.weight", "k.weight", "v.weight", "o.weight"})
    file.put(name, headmix::io::StoredTensor::from(w));
  const char* path = "consumer_io.safetensors";
  headmix::io::save_safetensors(path, file);
  headmix::MhaOptions opt;
  opt.num_heads = 2;
  const auto attn = headmix::Mha<float>::from_tensors(headmix::io::load_safetensors(path), "", opt);
  std::remove(path);
  headmix::Matrix<float> x = headmix::Matrix<float>::Ones(3, 4);
  const float err = (attn.forward(x) - x).cwiseAbs().maxCoeff();
  std::cout << "consumer_io: max |y - x| = " << err << "\n";
  return err < 1e-6f ? 0 : 1;
}
