// headmix_mpi_bench: a head-parallel layer over the MPI processes it is
// launched on, next to the same layer in one process with 1 and 2 threads.
//
//   mpiexec -n 1 build/bench/bench/headmix_mpi_bench [--reps N] [--length T] [--dim D] [--heads H]
//                                                   [--variant mha|dcmha|both] [--causal]
//   mpiexec -n 2 build/bench/bench/headmix_mpi_bench ...
//
// (as root, add --allow-run-as-root.) Defaults: T = 4096, D = 1024, H = 16,
// B = 1, float, self-attention without a mask, 1 thread per process, 5 timed
// calls after one warm-up; DCMHA in G = 4 groups of 4 heads (G must be a
// multiple of the process count; K = 4H/G per group), R = 2, pre and post.
//
// Rows, one per layer and setup, printed by rank 0:
//   - head-parallel on P processes x 1 thread: median and fastest call, the
//     call's time being the slowest rank's (every call starts after a
//     barrier); GFLOP per process (flops()) and GFLOP/s per process; the
//     bytes each rank hands to MPI per call (comm_bytes());
//   - with P > 1, the data all-reduce alone (MPI_Allreduce of the same
//     B·T·out_dim floats, timed the same way): the measured communication
//     term of the README's cost model;
//   - with P = 1 only, the one-process layer (headmix::Mha / Dcmha) with 1
//     and 2 threads, for the ratio against the 2-process run.
// Not part of the benchmark suite (run_benchmarks): it needs mpiexec. Run it
// when the machine is otherwise idle; on a machine of C cores, P processes
// x 1 thread and 1 process x P threads compete for the same cores only if
// P <= C.
#include "bench_common.hpp"

#include <headmix/mpi/head_parallel_dcmha.hpp>
#include <headmix/mpi/head_parallel_mha.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace {

using headmix::Index;
namespace bench = headmix::bench;
namespace hmpi = headmix::mpi;

struct Args {
  int reps = 5;
  Index T = 4096, D = 1024, H = 16;
  std::string variant = "both";
  bool causal = false;
};

// DCMHA in G groups (the suite's make_dcmha has one group, which does not
// shard): K = 4H/G keeps the dynamic-weight MLP's size of one group.
headmix::Dcmha<float> make_grouped_dcmha(const bench::LayerShape& s, Index G) {
  const Index M = s.H / G, R = 2, K = 4 * M;
  headmix::DcmhaWeights<float> w;
  w.q = bench::random_linear<float>(s.D, s.D, 1);
  w.k = bench::random_linear<float>(s.D, s.D, 2);
  w.v = bench::random_linear<float>(s.D, s.D, 3);
  w.o = bench::random_linear<float>(s.D, s.D, 4);
  const double in_scale = 1.0 / std::sqrt(double(s.D));
  w.dw1 = bench::random_tensor<float>({s.D, G, 4, K}, in_scale, 5);
  w.qkw = bench::random_tensor<float>({G, 4, K, 2 * R, M}, 1.0 / std::sqrt(double(K)), 6);
  w.dd = bench::random_tensor<float>({s.D, G, 4 * M}, in_scale, 7);
  headmix::DcmhaOptions opt;
  bench::set_dense(opt, s);
  opt.num_heads = s.H;
  opt.groups = G;
  opt.rank = R;
  return headmix::Dcmha<float>(std::move(w), opt);
}

// Median and fastest of `reps` calls of `call`, each call's time the
// slowest rank's; one untimed warm-up call first (workspace, caches).
struct Times {
  double median, fastest;
};
Times time_calls(int reps, MPI_Comm comm, const std::function<void()>& call) {
  call();
  std::vector<double> seconds;
  for (int r = 0; r < reps; ++r) {
    MPI_Barrier(comm);
    const auto start = std::chrono::steady_clock::now();
    call();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_MAX, comm);
    seconds.push_back(s);
  }
  std::sort(seconds.begin(), seconds.end());
  return {seconds[seconds.size() / 2], seconds.front()};
}

void print_row(const char* variant, const std::string& setup, Times t, double gflop, long long bytes) {
  std::printf("%-6s %-32s median %9.2f ms  fastest %9.2f ms  %8.2f GFLOP/proc  %7.2f GFLOP/s/proc  comm %11lld B\n",
              variant, setup.c_str(), t.median * 1e3, t.fastest * 1e3, gflop, gflop / t.median, bytes);
}

// One variant: the head-parallel layer on every process, then the
// all-reduce alone (P > 1) or the one-process layer at 1 and 2 threads (P = 1).
template <template <class> class Layer>
void run(const char* name, const Layer<float>& one, const Args& args, const hmpi::Communicator& comm) {
  const Index B = 1, T = args.T, P = comm.size();
  const bool root = comm.rank() == 0;
  const hmpi::HeadParallel<Layer, float> sharded(one.weights(), one.options(), comm);
  const headmix::Tensor<float> x = bench::random_tensor<float>({B, T, args.D}, 1.0, 11);
  const headmix::AttentionInput<float> in{x.batch(), {}, {}};
  headmix::Tensor<float> y({B, T, sharded.out_dim()});
  headmix::Workspace<float> ws;

  const Times t = time_calls(args.reps, comm.get(), [&] { sharded.forward(in, y.batch(), ws); });
  if (root)
    print_row(name, "head-parallel " + std::to_string(P) + " proc x 1 thread", t, sharded.flops(B, T, T).flops() / 1e9,
              static_cast<long long>(sharded.comm_bytes(B, T)));
  if (P > 1) {
    const Times reduce = time_calls(args.reps, comm.get(), [&] { comm.all_reduce_sum(y.data(), y.size()); });
    if (root) print_row(name, "  its all-reduce alone", reduce, 0.0, static_cast<long long>(y.size() * sizeof(float)));
    return;
  }
  for (int threads : {1, 2}) {
    Layer<float> layer = one;
    auto opt = layer.options();
    opt.threads = threads;
    layer.set_options(opt);
    const Times u = time_calls(args.reps, comm.get(), [&] { layer.forward(in, y.batch(), ws); });
    print_row(name, "one process x " + std::to_string(threads) + " thread" + (threads > 1 ? "s" : ""), u,
              layer.flops(B, T, T).flops() / 1e9, 0);
  }
}

int usage() {
  std::fprintf(stderr,
               "usage: mpiexec -n P headmix_mpi_bench [--reps N] [--length T] [--dim D] [--heads H]\n"
               "                                     [--variant mha|dcmha|both] [--causal]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--reps" && has_value)
      args.reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--length" && has_value)
      args.T = std::atol(argv[++i]);
    else if (a == "--dim" && has_value)
      args.D = std::atol(argv[++i]);
    else if (a == "--heads" && has_value)
      args.H = std::atol(argv[++i]);
    else if (a == "--variant" && has_value)
      args.variant = argv[++i];
    else if (a == "--causal")
      args.causal = true;
    else {
      MPI_Finalize();
      return usage();
    }
  }
  int status = 0;
  try {
    const hmpi::Communicator comm(MPI_COMM_WORLD);
    if (comm.rank() == 0)
      std::printf("headmix_mpi_bench: B 1, T %ld, D %ld, H %ld, float, %s, processes: %d, timed calls: %d\n",
                  static_cast<long>(args.T), static_cast<long>(args.D), static_cast<long>(args.H),
                  args.causal ? "causal" : "not causal", comm.size(), args.reps);
    const bench::LayerShape s{args.D, args.H, args.causal, 1};
    if (args.variant == "mha" || args.variant == "both") run<headmix::Mha>("mha", bench::make_mha(s), args, comm);
    if (args.variant == "dcmha" || args.variant == "both")
      run<headmix::Dcmha>("dcmha", make_grouped_dcmha(s, std::min<Index>(4, args.H)), args, comm);
  } catch (const std::exception& e) {  // headmix's errors are every rank's (Communicator::agree)
    std::fprintf(stderr, "headmix_mpi_bench: %s\n", e.what());
    status = 1;
  }
  MPI_Finalize();
  return status;
}
