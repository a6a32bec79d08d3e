// Full checkpoints for the head-parallel loading tests: weights put into an
// io::TensorFile, that file saved where this rank alone reads it through an
// io::SafetensorsReader, and the check that a sharded from_tensors reads
// only its own slices yet builds the layer the in-memory sharding builds.
#pragma once

#include "headmix/core/linear.hpp"
#include "headmix/core/workspace.hpp"
#include "headmix/io/safetensors.hpp"
#include "headmix/mpi/communicator.hpp"
#include "mpi/mpi_test_util.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <vector>

namespace headmix_mpi_test {

/// An Eigen matrix or vector, or a Tensor, stored in `file` as `name`.
template <class M>
void put(headmix::io::TensorFile& file, const std::string& name, const M& m) {
  if constexpr (std::is_base_of_v<Eigen::EigenBase<M>, M>) {
    using T = typename M::Scalar;
    const bool vector = M::ColsAtCompileTime == 1;
    headmix::Tensor<T> t(vector ? std::vector<headmix::Index>{m.rows()} : std::vector<headmix::Index>{m.rows(), m.cols()});
    const headmix::Matrix<T> rows = m;  // row-major, as the file stores it
    std::copy(rows.data(), rows.data() + rows.size(), t.data());
    file.put(name, headmix::io::StoredTensor::from(t));
  } else {
    file.put(name, headmix::io::StoredTensor::from(m));
  }
}

/// `lin` as `<name>.weight` and, when it has one, `<name>.bias` (nothing for an absent projection).
template <class T>
void put_linear(headmix::io::TensorFile& file, const std::string& name, const headmix::Linear<T>& lin) {
  if (lin.empty()) return;
  put(file, name + ".weight", lin.weight);
  if (lin.has_bias()) put(file, name + ".bias", lin.bias);
}

/// `file` saved under a name of this rank's own; removed with the object.
class SavedCheckpoint {
 public:
  SavedCheckpoint(const headmix::io::TensorFile& file, const std::string& tag)
      : path_(::testing::TempDir() + "headmix_" + tag + "_rank" + std::to_string(world_rank()) + ".safetensors") {
    headmix::io::save_safetensors(path_, file);
  }
  ~SavedCheckpoint() { std::remove(path_.c_str()); }
  SavedCheckpoint(const SavedCheckpoint&) = delete;
  SavedCheckpoint& operator=(const SavedCheckpoint&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// The tensor bytes one rank of P reads when it loads its shard of `file`:
/// the tensors under `prefix` named in `replicated` whole, every other one
/// a P-th (each is split along one axis).
inline std::uint64_t shard_bytes(const headmix::io::TensorFile& file, const std::string& prefix,
                                 std::initializer_list<const char*> replicated, int P) {
  std::uint64_t total = 0;
  for (const auto& [name, tensor] : file.tensors) {
    bool whole = false;
    for (const char* r : replicated) whole = whole || name == prefix + r;
    total += whole ? tensor.bytes.size() : tensor.bytes.size() / static_cast<std::uint64_t>(P);
  }
  return total;
}

/// Sharded::from_tensors on `file` saved to disk reads exactly
/// shard_bytes(file, prefix, replicated, P) through an io::SafetensorsReader,
/// and the layer it builds is the one sharding `w` in memory builds: the
/// same forward, bit for bit, on `in`.
template <class Sharded, class Weights, class Options, class T>
void expect_loads_only_its_shard(const Weights& w, const Options& opt, const headmix::io::TensorFile& file,
                                 const std::string& prefix, std::initializer_list<const char*> replicated,
                                 const headmix::AttentionInput<T>& in) {
  const SavedCheckpoint saved(file, "shard_load");
  const headmix::io::SafetensorsReader reader(saved.path());
  const Sharded loaded = Sharded::from_tensors(reader, prefix, opt, headmix::mpi::Communicator(MPI_COMM_WORLD));
  EXPECT_EQ(reader.bytes_read(), shard_bytes(file, prefix, replicated, world_size()));
  const Sharded direct(w, opt, headmix::mpi::Communicator(MPI_COMM_WORLD));
  headmix::Workspace<T> ws;
  EXPECT_TRUE(headmix_test::bit_identical("output", loaded.forward(in, ws), direct.forward(in, ws)));
}

}  // namespace headmix_mpi_test
