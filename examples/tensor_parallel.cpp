// One DCMHA checkpoint, run head-parallel over MPI processes (Megatron-style
// tensor parallelism by whole head groups) and checked against the same
// layer in one process.
//
//   mpiexec -n 2 build/test/examples/tensor_parallel [--small] [--weights FILE] [--prefix P] [--threads N]
//
// (as root, Open MPI also wants --allow-run-as-root; more processes than
// cores, --oversubscribe). Built only when CMake finds MPI (headmix::mpi).
//
// The checkpoint holds a DCMHA layer under a prefix (default "layers.0.attn."),
// with the names of dcmha.md: q/k/v/o .weight (and .bias), dc.dw1, dc.qkw,
// dc.dd (and dc.pre_w / dc.post_w). The head and group counts and the rank
// of the dynamic terms are read from dc.qkw [G, 4, K, 2R, M]; the KV head
// count from k.weight; the layer is causal unless the file's metadata
// "config" says {"causal": false}. Without --weights, rank 0 first writes a
// random layer (G = 4 groups of 2 or 4 heads) to a temporary file with
// io::save_safetensors and every rank reads that file, as it would read a
// real checkpoint (across machines, pass --weights on a shared filesystem).
//
// Every rank loads the checkpoint twice: as HeadParallelDcmha (its groups
// only) and as the one-process Dcmha (all of them), runs both on the same
// input (rank 0's, broadcast) and compares: the forward output, then a
// prefill and token-by-token decoding through step() with sharded caches.
// Exit code: 0 on every rank if every rank's sharded results equal its
// one-process results within the bound below, 1 on every rank if not or on
// an error (a shape that does not shard, a missing tensor: every rank gets
// the error), 2 for a bad command line.
#include <headmix/headmix.hpp>
#include <headmix/io/safetensors.hpp>
#include <headmix/mpi/head_parallel_dcmha.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

using headmix::Index;
using headmix::Tensor;
namespace io = headmix::io;
namespace hmpi = headmix::mpi;

namespace {

struct Args {
  bool small = false;
  std::string weights, prefix = "layers.0.attn.";
  int threads = 1;
};

// ---- the checkpoint --------------------------------------------------------

Tensor<float> random_tensor(std::vector<Index> shape, double scale, std::mt19937& rng) {
  Tensor<float> t(std::move(shape));
  std::normal_distribution<float> n(0.0f, static_cast<float>(scale));
  for (Index i = 0; i < t.size(); ++i) t[i] = n(rng);
  return t;
}

// A random causal DCMHA layer of G = 4 groups, stored as F32.
void write_checkpoint(const std::string& path, const std::string& prefix, bool small) {
  const Index D = small ? 32 : 1024, H = small ? 8 : 16, G = 4, R = 2, K = 4 * H / G;
  std::mt19937 rng(2024);
  const double s = 1.0 / std::sqrt(static_cast<double>(D));
  io::TensorFile f;
  for (const char* name : {"q", "k", "v", "o"})
    f.put(prefix + name + ".weight", io::StoredTensor::from(random_tensor({D, D}, s, rng)));
  f.put(prefix + "o.bias", io::StoredTensor::from(random_tensor({D}, 0.1, rng)));
  f.put(prefix + "dc.dw1", io::StoredTensor::from(random_tensor({D, G, 4, K}, s, rng)));
  f.put(prefix + "dc.qkw",
        io::StoredTensor::from(random_tensor({G, 4, K, 2 * R, H / G}, 1.0 / std::sqrt(double(K)), rng)));
  f.put(prefix + "dc.dd", io::StoredTensor::from(random_tensor({D, G, 4 * (H / G)}, s, rng)));
  f.metadata["config"] = "{\"causal\": true}";
  io::save_safetensors(path, f);
}

// The options the checkpoint's shapes imply (the layer checks them all again).
headmix::DcmhaOptions options_of(const io::SafetensorsReader& f, const std::string& prefix, int threads) {
  const std::vector<Index>& qkw = f.shape(prefix + "dc.qkw");  // [G, 4, K, 2R, M]
  const std::vector<Index>& q = f.shape(prefix + "q.weight");  // [H·dk, D]
  const std::vector<Index>& k = f.shape(prefix + "k.weight");  // [Hkv·dk, D]
  if (qkw.size() != 5 || q.size() != 2 || k.size() != 2)
    throw io::io_error(prefix + "dc.qkw, q.weight, k.weight: expected ranks 5, 2, 2");
  headmix::DcmhaOptions o;
  o.groups = qkw[0];
  o.num_heads = qkw[0] * qkw[4];
  o.rank = qkw[3] / 2;
  const Index dk = o.num_heads > 0 ? q[0] / o.num_heads : 0;
  o.num_kv_heads = dk > 0 ? k[0] / dk : 0;
  o.static_w = f.contains(prefix + "dc.pre_w") || f.contains(prefix + "dc.post_w");
  o.use_pre = !o.static_w || f.contains(prefix + "dc.pre_w");
  o.use_post = !o.static_w || f.contains(prefix + "dc.post_w");
  const auto config = f.metadata().find("config");
  o.causal = config == f.metadata().end() || config->second.find("\"causal\": false") == std::string::npos;
  o.threads = threads;
  return o;
}

// ---- comparing ------------------------------------------------------------

// Sharded against one process: the same arithmetic per head, but o's
// H·Dv-term dot products become P partial sums added by MPI, and q, k, v
// and the dynamic factors are GEMMs of other widths that may reorder their
// sums. Two orders of an n-term sum differ by at most about 2·n·u·Σ|terms|;
// with the scales here that stays below 1e-4 of the largest output value in
// float (~840 units of roundoff). Measured: a few units.
struct Comparison {
  double max_diff = 0, scale = 0;
  bool ok() const { return std::isfinite(max_diff) && max_diff <= 1e-4 * std::max(scale, 1.0); }
  void add(const Tensor<float>& got, const Tensor<float>& want) {
    if (got.shape() != want.shape()) {
      max_diff = std::numeric_limits<double>::infinity();
      return;
    }
    for (Index i = 0; i < got.size(); ++i) {
      max_diff = std::max(max_diff, std::abs(double(got[i]) - double(want[i])));
      scale = std::max(scale, std::abs(double(want[i])));
    }
  }
};

// Positions [at, at + n) of every sequence of x.
Tensor<float> positions(const Tensor<float>& x, Index at, Index n) {
  Tensor<float> part({x.dim(0), n, x.dim(2)});
  for (Index b = 0; b < x.dim(0); ++b) part.batch().item(b) = x.batch().item(b).middleRows(at, n);
  return part;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Load, run, compare. Returns this rank's verdict.
bool run(const Args& args, const hmpi::Communicator& comm) {
  const bool root = comm.rank() == 0;
  // Every rank opens the file inside an agreement: a rank that cannot read
  // its header makes every rank throw, instead of leaving the others in
  // from_tensors. The sharded load reads only this rank's slices of it.
  std::optional<io::SafetensorsReader> file;
  headmix::DcmhaOptions opt;
  comm.agree("tensor_parallel", [&] {
    file.emplace(args.weights);
    opt = options_of(*file, args.prefix, args.threads);
  });
  const auto sharded = hmpi::HeadParallelDcmha<float>::from_tensors(*file, args.prefix, opt, comm);
  const std::uint64_t shard_bytes = file->bytes_read();
  const auto one = headmix::Dcmha<float>::from_tensors(*file, args.prefix, opt);
  std::uint64_t file_bytes = 0;
  for (const auto& named : file->tensors) file_bytes += named.second.end - named.second.begin;
  file.reset();  // the layers hold what they need
  const Index B = args.small ? 2 : 1, T = args.small ? 12 : 512, D = sharded.embed_dim(), P = comm.size();
  if (root)
    std::cout << "DCMHA, D " << D << ", " << sharded.num_heads() << " heads in " << opt.groups << " groups, "
              << (opt.causal ? "causal" : "not causal") << ", on " << P << " process(es): each holds "
              << sharded.local().groups() << " groups (" << sharded.local_heads() << " heads), read "
              << shard_bytes << " of the checkpoint's " << file_bytes << " tensor bytes, computes "
              << sharded.flops(B, T, T).flops() / 1e9 << " of " << one.flops(B, T, T).flops() / 1e9
              << " GFLOP per call, and sends " << sharded.comm_bytes(B, T) << " bytes\n";

  // The same input on every rank: rank 0's.
  std::mt19937 rng(7);
  Tensor<float> x = random_tensor({B, T, D}, 1.0, rng);
  MPI_Bcast(x.data(), static_cast<int>(x.size()), MPI_FLOAT, 0, comm.get());

  // Each layer runs twice: the second call, timed, allocates nothing.
  headmix::Workspace<float> ws1, ws;
  Tensor<float> want = one.forward({x.batch(), {}, {}}, ws1), got = sharded.forward({x.batch(), {}, {}}, ws);
  auto start = std::chrono::steady_clock::now();
  one.forward({x.batch(), {}, {}}, want.batch(), ws1);
  const double one_seconds = seconds_since(start);
  start = std::chrono::steady_clock::now();
  sharded.forward({x.batch(), {}, {}}, got.batch(), ws);
  const double sharded_seconds = seconds_since(start);
  Comparison forward;
  forward.add(got, want);

  // Prefill half of each sequence, then one token at a time.
  Comparison decode;
  if (opt.causal) {
    headmix::SequenceCache<float> cache1(B, T), cache(B, T);
    for (Index at = 0; at < T;) {
      const Index n = at == 0 ? T / 2 : 1;
      const Tensor<float> part = positions(x, at, n);
      decode.add(sharded.step(part.batch(), cache, ws), one.step(part.batch(), cache1, ws1));
      at += n;
    }
    if (root) std::cout << "cache per process: " << cache.bytes() << " bytes (one process: " << cache1.bytes() << ")\n";
  }

  const bool ok = forward.ok() && decode.ok();
  if (root || !ok)
    std::cout << (root ? "" : "[rank " + std::to_string(comm.rank()) + "] ")
              << "sharded vs one process: forward max |diff| " << forward.max_diff << " (outputs up to "
              << forward.scale << "), decoding max |diff| " << decode.max_diff << " -> " << (ok ? "OK" : "FAILED")
              << "\n";
  if (root)
    std::cout << "forward: " << sharded_seconds * 1e3 << " ms sharded, " << one_seconds * 1e3
              << " ms in one process (not a speed-up measurement: bench/mpi_bench.cpp is)\n";
  return ok;
}

int usage() {
  std::cerr << "usage: mpiexec -n P tensor_parallel [--small] [--weights FILE] [--prefix P] [--threads N]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);  // the program's: headmix never calls it
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--small")
      args.small = true;
    else if (a == "--weights" && has_value)
      args.weights = argv[++i];
    else if (a == "--prefix" && has_value)
      args.prefix = argv[++i];
    else if (a == "--threads" && has_value)
      args.threads = std::max(1, std::atoi(argv[++i]));
    else {
      MPI_Finalize();
      return usage();
    }
  }

  int status = 1;
  std::string temporary;
  try {
    const hmpi::Communicator comm(MPI_COMM_WORLD);
    if (args.weights.empty()) {
      // Rank 0 writes the file and sends its name; an error there is every rank's.
      comm.agree("tensor_parallel", [&] {
        if (comm.rank() != 0) return;
        temporary = (std::filesystem::temp_directory_path() /
                     ("headmix_tensor_parallel_" + std::to_string(std::random_device{}()) + ".safetensors"))
                        .string();
        write_checkpoint(temporary, args.prefix, args.small);
        std::cout << "wrote a random DCMHA layer to " << temporary << "\n";
      });
      int length = static_cast<int>(temporary.size());
      MPI_Bcast(&length, 1, MPI_INT, 0, MPI_COMM_WORLD);
      args.weights.resize(static_cast<std::size_t>(length));
      if (comm.rank() == 0) args.weights = temporary;
      MPI_Bcast(args.weights.data(), length, MPI_CHAR, 0, MPI_COMM_WORLD);
    }
    int ok = run(args, comm) ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);  // one verdict for every rank
    status = ok ? 0 : 1;
  } catch (const std::exception& e) {  // every rank gets a headmix error: see Communicator::agree
    std::cerr << "tensor_parallel: " << e.what() << "\n";
  }
  MPI_Barrier(MPI_COMM_WORLD);  // every rank has read the temporary file
  if (!temporary.empty()) std::filesystem::remove(temporary);
  MPI_Finalize();
  return status;
}
