// headmix_suite: the benchmark suite proper. Every ratio it prints comes from
// one paired comparison (paired.hpp: A B, B A, ... at least 5 pairs; median
// of the per-pair ratios with its interquartile range):
//
//   1. each variant's time over MHA's at the same shape, beside the analytic
//      FLOP ratio;
//   2. each variant's 2-thread speedup (time at 1 thread / at 2 threads);
//   3. MHA's GFLOP/s over a GEMM yardstick's ([T, D] x [D, 3D]): Eigen's
//      GEMM, headmix::gemm on libxsmm when built with it, and OpenBLAS's
//      cblas_sgemm on one thread when linked;
//   4. headmix MHA's time over PyTorch's (when built with libtorch), against
//      each of torch's paths, the faster marked as the baseline;
//   5. a decoding step (one token, S positions in view) against recomputing
//      the causal forward over S positions, with the cache's memory (MHA
//      also with grouped-query attention, H/8 KV heads); each step against
//      reading its bytes once; and at the longest S, the step over a
//      bfloat16 cache against the same step over a full-precision one;
//   6. sliding windows: a causal layer with window W at a long T over the
//      same at a short T (cost O(T · W)).
//
//   headmix_suite [--mode=default|full|smoke] [--json=results.json] [--only=<table>] [--cpu=N|none]
//
// --cpu: the CPU one-thread comparisons run pinned to (paired.hpp); by
// default the first this process may use, `none` to leave them unpinned.
//
// The JSON holds every comparison with its per-pair times; bench/plot.py
// draws latency against sequence length from it.
#include "bench_common.hpp"
#include "paired.hpp"
#ifdef HEADMIX_BENCH_TORCH
#include "torch_rows.hpp"
#endif

#include <nlohmann/json.hpp>

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#ifdef HEADMIX_BENCH_OPENBLAS
// OpenBLAS's C interface, declared here rather than through <cblas.h>, whose
// include path differs between Debian's openblas flavours.
extern "C" {
void cblas_sgemm(int order, int transa, int transb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc);
void openblas_set_num_threads(int);
char* openblas_get_corename(void);
char* openblas_get_config(void);
}
#endif

namespace {

using namespace headmix;
using bench::LayerShape;
using bench::PairedResult;
using bench::PairSettings;
using bench::Side;
using nlohmann::json;

// ---- what a run measures ------------------------------------------------------------
struct Plan {
  std::string mode;
  std::string only;  // run this table alone (vs_mha, threads, yardstick, torch, decode), or all
  PairSettings settings;
  std::vector<std::pair<Index, Index>> widths;  // (D, H) of the layer comparisons
  std::vector<Index> lengths;                   // T = S of the variant comparisons
  std::vector<int> variant_threads;             // threads of the variant comparisons
  std::vector<Index> thread_lengths;            // T of the 2-thread speedups
  std::vector<Index> yardstick_lengths;
  std::vector<Index> torch_lengths;             // 1 thread
  std::vector<Index> torch_lengths_2t;          // 2 threads
  Index decode_D = 1024, decode_H = 16;
  std::vector<Index> decode_lengths;            // S of the step / recompute rows
  std::vector<Index> bandwidth_lengths;         // S of the step / read-bandwidth rows
  std::vector<std::tuple<Index, Index, Index>> window_lengths;  // (long T, short T, window) of the window rows
  std::vector<Index> lsh_alone_lengths;         // LSH timed alone (dense MHA too big)
};

Plan make_plan(const std::string& mode) {
  Plan p;
  p.mode = mode;
  if (mode == "smoke") {  // tiny shapes, seconds even under sanitizers
    p.settings.min_rep_seconds = 0.001;
    p.settings.budget_seconds = 0;
    p.widths = {{64, 4}};
    p.lengths = {128};
    p.variant_threads = {1};
    p.thread_lengths = {128};
    p.yardstick_lengths = {128};
    p.torch_lengths = {};
    p.decode_D = 64;
    p.decode_H = 4;
    p.decode_lengths = {64};
    p.bandwidth_lengths = {64};
    p.window_lengths = {{256, 64, 16}};
    return p;
  }
  if (mode == "full") {
    p.settings.budget_seconds = 2.0;
    p.widths = {{768, 12}, {1024, 16}};
    p.lengths = {256, 512, 1024, 2048, 4096};
    p.variant_threads = {1, 2};
    p.thread_lengths = p.lengths;
    p.yardstick_lengths = {256, 512, 1024, 2048, 4096, 16384};  // MHA's rate must hold at long T too
    p.torch_lengths = p.lengths;
    p.torch_lengths_2t = p.lengths;
    p.decode_lengths = {512, 2048, 8192};
    p.bandwidth_lengths = p.decode_lengths;
    p.window_lengths = {{16384, 4096, 512}};
    p.lsh_alone_lengths = {16384};
    return p;
  }
  if (mode != "default") throw std::invalid_argument("--mode must be default, full or smoke, not '" + mode + "'");
  p.settings.budget_seconds = 1.0;
  p.settings.min_pairs = 7;
  p.settings.max_pairs = 15;
  p.widths = {{768, 12}};
  p.lengths = {256, 512, 1024, 2048};
  p.variant_threads = {1};
  p.thread_lengths = {256, 1024};
  p.yardstick_lengths = {256, 1024, 2048};
  p.torch_lengths = {256, 512, 1024, 2048};
  p.torch_lengths_2t = {1024};
  p.decode_lengths = {512, 2048};
  p.bandwidth_lengths = {2048, 8192};
  p.window_lengths = {{4096, 1024, 128}};
  return p;
}

// ---- sides ------------------------------------------------------------------------------
// With HEADMIX_USE_BLAS headmix's GEMMs run in OpenBLAS, which must stay on
// one thread under headmix's own workers, whatever a torch row set before.
inline void headmix_blas_threads() {
#if defined(EIGEN_USE_BLAS) && defined(HEADMIX_BENCH_OPENBLAS)
  openblas_set_num_threads(1);
#endif
}

// Pause before each repetition of a comparison with a multi-threaded torch
// side: OpenBLAS's idle workers spin for 2^28 cycles (its default
// THREAD_TIMEOUT, ~0.1 s at 2-3 GHz) before they sleep.
constexpr double kSpinSettleSeconds = 0.25;

#ifdef HEADMIX_BENCH_TORCH
// Call after one call of a side that allocates afresh on every call: when
// that call took glibc's heap past the part grown ahead, grow the heap to
// twice its size (at most half the machine's memory), touching every new
// page, and free the block again. With trimming off (tune_malloc) the pages
// stay in the process, so later growth up to there takes no page fault.
// The block asks for more than all free memory in the heap, so that it
// comes from the top, not from a hole that earlier rows left.
// libtorch's heap, fragmented by its per-call temporaries, kept reaching
// new high-water marks several calls into a row here, and a repetition that
// touched fresh pages took 2.5-3.6x its time (a fault costs ~10 us in this VM).
void grow_heap_ahead() {
  static std::size_t grown = 0;  // the heap's size after the last growth
  const struct mallinfo2 heap = mallinfo2();
  if (heap.arena <= grown) return;
  const std::size_t memory = std::size_t(sysconf(_SC_PHYS_PAGES)) * std::size_t(sysconf(_SC_PAGESIZE));
  const std::size_t bytes = std::min(heap.arena, memory / 2 - std::min(memory / 2, heap.arena)) + heap.fordblks;
  auto* block = static_cast<volatile char*>(std::malloc(bytes));
  if (block) {
    for (std::size_t i = 0; i < bytes; i += 4096) block[i] = 0;
    std::free(const_cast<char*>(block));
  }
  grown = mallinfo2().arena;
}
#endif

// One forward over a random [T, D] sequence, on state the side owns.
template <class Layer>
Side forward_side(const std::string& label, Layer layer, Index T, Index D) {
  struct State {
    Layer layer;
    Matrix<float> x, y;
    Workspace<float> ws;
  };
  auto s = std::make_shared<State>(State{std::move(layer), bench::random_matrix<float>(T, D, 1.0, 99), {}, {}});
  s->y.resize(T, s->layer.out_dim());
  return {label, [s] {
            headmix_blas_threads();
            const AttentionInput<float> in{as_batch(s->x), {}, {}};
            s->layer.forward(in, as_batch(s->y), s->ws);
            benchmark::DoNotOptimize(s->y.data());
            benchmark::ClobberMemory();
          }};
}

// The variant every other is timed against, and the yardsticks' and torch's peer.
const std::string kMha = bench::suite_variants().front().name;

// The variant's forward side and its analytic FLOPs at (1, T, T).
std::pair<Side, double> variant_side(const std::string& v, const LayerShape& s, Index T) {
  return bench::with_layer(v, s, [&](auto layer) {
    const double flops = layer.flops(1, T, T).flops();
    return std::pair<Side, double>{forward_side(v, std::move(layer), T, s.D), flops};
  });
}

// One decoding step: one new token over a cache of S - 1 positions, the
// cache truncated back afterwards so every call generates the same token.
// `cache_bytes`: the memory of the cache, once the prompt has filled it.
template <class Layer>
Side step_side(const std::string& label, Layer layer, Index S, Index D, std::size_t& cache_bytes,
               CachePrecision precision = CachePrecision::full) {
  struct State {
    Layer layer;
    SequenceCache<float> cache;
    Matrix<float> x, y;
    Workspace<float> ws;
  };
  auto s = std::make_shared<State>(State{std::move(layer), SequenceCache<float>(1, S, precision), {}, {}, {}});
  const Matrix<float> prompt = bench::random_matrix<float>(S - 1, D, 1.0, 11);
  Matrix<float> y_prompt(S - 1, s->layer.out_dim());
  // The prompt, untimed, runs on every core (at S = 8192 it is most of a
  // decoding row's time); the steps on the row's threads.
  auto options = s->layer.options();
  const int step_threads = options.threads;
  options.threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  s->layer.set_options(options);
  s->layer.step(as_batch(prompt), s->cache, as_batch(y_prompt), s->ws);
  options.threads = step_threads;
  s->layer.set_options(options);
  cache_bytes = s->cache.bytes();
  s->x = bench::random_matrix<float>(1, D, 1.0, 12);
  s->y.resize(1, s->layer.out_dim());
  const Index keep = S - 1;
  return {label, [s, keep] {
            headmix_blas_threads();
            s->layer.step(as_batch(s->x), s->cache, as_batch(s->y), s->ws);
            s->cache.truncate(keep);
            benchmark::DoNotOptimize(s->y.data());
            benchmark::ClobberMemory();
          }};
}

// Whether Layer has step() over a cache.
template <class Layer, class = void>
struct decodes : std::false_type {};
template <class Layer>
struct decodes<Layer, std::void_t<decltype(std::declval<const Layer&>().step(
                          std::declval<ConstBatchView<float>>(), std::declval<SequenceCache<float>&>(),
                          std::declval<BatchView<float>>(), std::declval<Workspace<float>&>()))>> : std::true_type {};

// Decoding rows: every variant that decodes, and after MHA its grouped-query
// form (H/8 KV heads: an eighth of the cache). Each row: its label, its
// variant, and whether its steps may read a bfloat16 cache.
struct DecodeRow {
  std::string label, variant;
  bool half_cache;
};
std::vector<DecodeRow> decode_rows() {
  std::vector<DecodeRow> rows;
  for (const bench::SuiteVariant& v : bench::suite_variants()) {
    if (!v.decodes) continue;
    rows.push_back({v.name, v.name, v.half_cache});
    if (rows.size() == 1) rows.push_back({std::string(v.name) + " GQA", v.name, v.half_cache});
  }
  return rows;
}

// A decoding row's sides: recomputing the whole sequence, and one step.
// `cache_bytes` and `weight_bytes`: what one step reads.
std::pair<Side, Side> decode_sides(const DecodeRow& row, LayerShape s, Index S, std::size_t& cache_bytes,
                                   std::size_t& weight_bytes, CachePrecision precision = CachePrecision::full) {
  if (row.label != row.variant) s.kv_heads = std::max<Index>(1, s.H / 8);  // the GQA row
  const std::string step = std::string(precision == CachePrecision::full ? " step" : " bf16 step") +
                           (s.bfloat16_weights ? ", bf16 weights" : "");
  return bench::with_layer(row.variant, s, [&](auto layer) -> std::pair<Side, Side> {
    if constexpr (decodes<decltype(layer)>::value) {
      weight_bytes = bench::weight_bytes(layer);
      return {forward_side(row.label + " recompute", layer, S, s.D),
              step_side(row.label + step, layer, S, s.D, cache_bytes, precision)};
    } else {
      throw std::invalid_argument("no decoding for " + row.label);
    }
  });
}

// The bandwidth yardstick: reading `bytes` once, as a step at memory
// bandwidth would: one thread sums a buffer of that size as four quarters
// at once, each into its own vector of partial sums. Four streams read
// 1.1-1.3x faster than one (Eigen's sum over the whole buffer, the
// yardstick before) on the AMD VM of docs/bench/reproducibility.md, and
// eight no faster, so the yardstick is the strongest read measured there.
Side read_side(std::size_t bytes) {
  constexpr Index kStreams = 4, kWidth = 16;
  const Index quarter = Index(bytes / sizeof(float)) / (kStreams * kWidth) * kWidth;
  auto buf = std::make_shared<Vector<float>>(Vector<float>::Random(kStreams * quarter));
  return {"read", [buf, quarter] {
            using Packet = Eigen::Array<float, kWidth, 1>;
            Packet sums[kStreams];
            for (Packet& s : sums) s.setZero();
            const float* data = buf->data();
            for (Index i = 0; i < quarter; i += kWidth)
              for (Index j = 0; j < kStreams; ++j) sums[j] += Eigen::Map<const Packet>(data + j * quarter + i);
            float sum = 0;
            for (const Packet& s : sums) sum += s.sum();
            benchmark::DoNotOptimize(sum);
          }};
}

double gemm_flops(Index T, Index D) { return 2.0 * double(T) * double(D) * 3.0 * double(D); }

// The yardstick's operands: x [T, D], w [D, 3D], y [T, 3D].
struct GemmOperands {
  Matrix<float> x, w, y;
  GemmOperands(Index T, Index D)
      : x(bench::random_matrix<float>(T, D, 1.0, 1)), w(bench::random_matrix<float>(D, 3 * D, 1.0, 2)), y(T, 3 * D) {}
};

Side eigen_gemm_side(Index T, Index D) {
  auto s = std::make_shared<GemmOperands>(T, D);
  return {"Eigen GEMM", [s] {
            s->y.noalias() = s->x * s->w;
            benchmark::DoNotOptimize(s->y.data());
            benchmark::ClobberMemory();
          }};
}

#ifdef HEADMIX_USE_LIBXSMM
// headmix::gemm on libxsmm's kernels, the product the layers run.
Side libxsmm_gemm_side(Index T, Index D) {
  auto s = std::make_shared<GemmOperands>(T, D);
  return {"libxsmm GEMM", [s] {
            headmix::gemm(s->x, s->w, s->y);
            benchmark::DoNotOptimize(s->y.data());
            benchmark::ClobberMemory();
          }};
}
#endif

#ifdef HEADMIX_BENCH_OPENBLAS
Side openblas_gemm_side(Index T, Index D) {
  auto s = std::make_shared<GemmOperands>(T, D);
  const int m = int(T), n = int(3 * D), k = int(D);
  return {"OpenBLAS sgemm", [s, m, n, k] {
            openblas_set_num_threads(1);  // torch rows may have raised it
            constexpr int kRowMajor = 101, kNoTrans = 111;  // CBLAS enum values
            cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0f, s->x.data(), k, s->w.data(), n, 0.0f,
                        s->y.data(), n);
            benchmark::DoNotOptimize(s->y.data());
            benchmark::ClobberMemory();
          }};
}
#endif

// ---- records and printing ------------------------------------------------------------
struct Record {
  std::string table;
  json params;
  PairedResult r;
  json extra = json::object();
};

// A side's times; median and quartiles on `clock`, the comparison's.
json side_json(const bench::SideTimes& t, bench::Clock clock) {
  const bench::Summary s = t.summary(clock);
  return {{"label", t.label},
          {"calls_per_rep", t.calls_per_rep},
          {"wall_seconds_per_call", t.seconds},
          {"cpu_seconds_per_call", t.cpu_seconds},
          {"median_seconds", s.median},
          {"q1_seconds", s.q1},
          {"q3_seconds", s.q3},
          {"preempted_reps", t.preempted_reps},
          {"faulted_reps", t.faulted_reps}};
}

json record_json(const Record& rec) {
  const auto& r = rec.r;
  json j = {{"table", rec.table},
            {"params", rec.params},
            {"a", side_json(r.a, r.clock)},
            {"b", side_json(r.b, r.clock)},
            {"clock", bench::clock_name(r.clock)},
            {"ratio_definition", "scale * time(a) / time(b) on clock, per pair"},
            {"scale", r.scale},
            {"ratios", r.ratios},
            {"wall_ratios", r.wall_ratios},
            {"cpu_ratios", r.cpu_ratios},
            {"median", r.ratio.median},
            {"q1", r.ratio.q1},
            {"q3", r.ratio.q3},
            {"min", r.ratio.min},
            {"max", r.ratio.max},
            {"flagged", r.flagged},
            {"wall_seconds", r.wall_seconds}};
  j.update(rec.extra);
  return j;
}

std::string shape_text(const json& p) {
  std::ostringstream o;
  if (p.contains("D")) o << "D=" << p["D"].get<long>() << " ";
  if (p.contains("T")) o << "T=" << p["T"].get<long>();
  if (p.contains("S")) o << "S=" << p["S"].get<long>();
  if (p.contains("causal")) o << (p["causal"].get<bool>() ? " causal" : "");
  if (p.contains("threads")) o << " " << p["threads"].get<int>() << "t";
  return o.str();
}

std::string ratio_text(const PairedResult& r) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%5.2fx [%.2f-%.2f] %s%s", r.ratio.median, r.ratio.q1, r.ratio.q3,
                bench::clock_name(r.clock), r.flagged ? " !" : "");
  return buf;
}

// The machine probe: the headmix GEMM's rate on the yardstick's T = 256
// product (compute) and the read yardstick's rate on 80 MiB (memory),
// measured alone, pinned, before the tables and after them. A shared host
// can slow either for minutes (a run here read 23 GB/s where the next read
// 42): when the two probes differ, ratios of a compute-bound side to a
// memory-bound one (decoding) and comparisons with other runs are suspect.
struct MachineProbe {
  double gemm_gflops = 0, read_gbs = 0;
};

MachineProbe probe_machine(const bench::PairSettings& settings) {
  constexpr Index T = 256, D = 768;
  constexpr std::size_t bytes = std::size_t(80) << 20;
#ifdef HEADMIX_USE_LIBXSMM
  const Side gemm = libxsmm_gemm_side(T, D);
#else
  const Side gemm = eigen_gemm_side(T, D);
#endif
  const double gemm_s = bench::series(gemm, settings, bench::Clock::cpu).summary(bench::Clock::cpu).median;
  const double read_s =
      bench::series(read_side(bytes), settings, bench::Clock::cpu).summary(bench::Clock::cpu).median;
  return {1e-9 * gemm_flops(T, D) / gemm_s, 1e-9 * double(bytes) / read_s};
}

// A side's median milliseconds per call on its comparison's clock.
double ms(const PairedResult& r, const bench::SideTimes& t) { return 1e3 * t.summary(r.clock).median; }

class Suite {
 public:
  explicit Suite(Plan plan) : plan_(std::move(plan)) {}

  void run() {
    auto wanted = [&](const char* table) { return plan_.only.empty() || plan_.only == table; };
    if (wanted("vs_mha")) variants_against_mha();
    if (wanted("threads")) thread_speedups();
    if (wanted("yardstick")) yardstick();
    if (wanted("torch")) torch();
    if (wanted("decode")) decoding();
    if (wanted("window")) window_scaling();
    if (wanted("alone")) lsh_alone();
  }

  void print_tables() const;
  json to_json(const json& context) const;

  /// Over the CPU-clock comparisons, each one's median wall / CPU time per
  /// repetition: how much of the core other processes took.
  bench::Summary wall_over_cpu() const {
    std::vector<double> per_comparison;
    for (const Record& r : records_) {
      if (r.r.clock != bench::Clock::cpu) continue;
      std::vector<double> q;
      for (const bench::SideTimes* t : {&r.r.a, &r.r.b})
        for (std::size_t i = 0; i < t->seconds.size(); ++i) q.push_back(t->seconds[i] / t->cpu_seconds[i]);
      per_comparison.push_back(bench::summarize(q).median);
    }
    return bench::summarize(per_comparison);
  }

 private:
  // One paired comparison. Both sides on one thread: CPU time (paired.hpp).
  Record& add(const std::string& table, json params, const Side& a, const Side& b, bool single_threaded,
              double scale = 1) {
    const bench::Clock clock = single_threaded ? bench::Clock::cpu : bench::Clock::wall;
    records_.push_back({table, std::move(params), bench::compare(a, b, plan_.settings, clock, scale)});
    const Record& r = records_.back();
    const int faulted = r.r.a.faulted_reps + r.r.b.faulted_reps;
    std::printf("  %-10s %-34s %-44s %3zu pairs %5.1f s  %d preempted%s\n", table.c_str(),
                (r.r.a.label + " / " + r.r.b.label).substr(0, 34).c_str(),
                (shape_text(r.params) + "  " + ratio_text(r.r)).c_str(), r.r.ratios.size(), r.r.wall_seconds,
                r.r.a.preempted_reps + r.r.b.preempted_reps,
                faulted ? ("  " + std::to_string(faulted) + " faulted").c_str() : "");
    std::fflush(stdout);
    return records_.back();
  }

  static json layer_params(const LayerShape& s, Index T) {
    return {{"D", s.D}, {"H", s.H}, {"T", T}, {"causal", s.causal}, {"threads", s.threads}};
  }

  void variants_against_mha() {
    for (auto [D, H] : plan_.widths)
      for (Index T : plan_.lengths)
        for (bool causal : {false, true})
          for (int threads : plan_.variant_threads) {
            const LayerShape s{D, H, causal, threads};
            for (const bench::SuiteVariant& v : bench::suite_variants()) {
              if (v.name == kMha) continue;
              auto [mha, mha_flops] = variant_side(kMha, s, T);
              auto [var, var_flops] = variant_side(v.name, s, T);
              json p = layer_params(s, T);
              p["variant"] = v.name;
              Record& r = add("vs_mha", p, var, mha, threads == 1);
              r.extra["flop_ratio"] = var_flops / mha_flops;
            }
          }
  }

  void thread_speedups() {
    for (auto [D, H] : plan_.widths)
      for (Index T : plan_.thread_lengths)
        for (bool causal : {false, true})
          for (const bench::SuiteVariant& variant : bench::suite_variants()) {
            const std::string v = variant.name;
            auto one = variant_side(v, {D, H, causal, 1}, T).first;
            auto two = variant_side(v, {D, H, causal, 2}, T).first;
            one.label = v + " 1t";
            two.label = v + " 2t";
            json p = layer_params({D, H, causal, 1}, T);
            p.erase("threads");
            p["variant"] = v;
            add("threads", p, one, two, false);
          }
  }

  void yardstick() {
    for (auto [D, H] : plan_.widths)
      for (Index T : plan_.yardstick_lengths) {
        const LayerShape s{D, H, false, 1};
        std::vector<std::pair<Side, std::string>> gemms = {{eigen_gemm_side(T, D), "Eigen"}};
#ifdef HEADMIX_USE_LIBXSMM
        gemms.push_back({libxsmm_gemm_side(T, D), "libxsmm"});
#endif
#ifdef HEADMIX_BENCH_OPENBLAS
        gemms.push_back({openblas_gemm_side(T, D), "OpenBLAS"});
#endif
        for (auto& [gemm, name] : gemms) {
          auto [mha, mha_flops] = variant_side(kMha, s, T);
          json p = layer_params(s, T);
          p["gemm"] = name;
          // scale · t(GEMM) / t(MHA) with scale = F(MHA) / F(GEMM): MHA's
          // GFLOP/s as a fraction of the GEMM's.
          Record& r = add("yardstick", p, gemm, mha, true, mha_flops / gemm_flops(T, D));
          r.extra["mha_flops"] = mha_flops;
          r.extra["gemm_flops"] = gemm_flops(T, D);
        }
      }
  }

  void torch() {
#ifdef HEADMIX_BENCH_TORCH
    using bench::torch_rows::Path;
    auto run = [&](Index D, Index H, Index T, bool causal, int threads) {
      for (Path path : {Path::fused, Path::module}) {
        Side t{bench::torch_rows::path_name(path), bench::torch_rows::make_call(path, D, H, T, causal, threads)};
        if (!t.call) continue;
        // At 2 threads torch's OpenBLAS worker spins for ~0.1 s after each
        // call, on the core headmix's second worker wants (paired.hpp).
        if (threads > 1) t.settle_seconds = kSpinSettleSeconds;
        t.call();  // torch's first call sizes its heap; grow it ahead of the comparison
        grow_heap_ahead();
        Side mha = variant_side(kMha, {D, H, causal, threads}, T).first;
        mha.label = "headmix MHA";
        json p = layer_params({D, H, causal, threads}, T);
        p["torch_path"] = path == Path::fused ? "fused" : "module";
        add("torch", p, mha, t, threads == 1);
      }
    };
    for (auto [D, H] : plan_.widths) {
      for (Index T : plan_.torch_lengths)
        for (bool causal : {false, true}) run(D, H, T, causal, 1);
      for (Index T : plan_.torch_lengths_2t)
        for (bool causal : {false, true}) run(D, H, T, causal, 2);
    }
#endif
  }

  void decoding() {
    const LayerShape s{plan_.decode_D, plan_.decode_H, true, 1};
    auto has = [](const std::vector<Index>& v, Index S) { return std::find(v.begin(), v.end(), S) != v.end(); };
    std::vector<Index> lengths = plan_.decode_lengths;
    for (Index S : plan_.bandwidth_lengths)
      if (!has(lengths, S)) lengths.push_back(S);
    for (Index S : lengths)
      for (const DecodeRow& row : decode_rows()) {
        std::size_t cache_bytes = 0, weight_bytes = 0;
        auto [recompute, step] = decode_sides(row, s, S, cache_bytes, weight_bytes);
        json p = {{"D", s.D}, {"H", s.H}, {"S", S}, {"variant", row.label}};
        if (has(plan_.decode_lengths, S)) add("decode", p, recompute, step, true).extra["cache_bytes"] = cache_bytes;
        if (!has(plan_.bandwidth_lengths, S)) continue;
        // The step against reading its bytes once: the share of the read
        // bandwidth it reaches.
        const std::size_t bytes = cache_bytes + weight_bytes;
        Record& r = add("bandwidth", p, read_side(bytes), step, true);
        r.extra["bytes_per_step"] = bytes;
        r.extra["cache_bytes"] = cache_bytes;
        if (S != plan_.bandwidth_lengths.back() || !row.half_cache) continue;
        // The same step over a bfloat16 cache: its speed-up per token, and
        // the bytes it reads.
        std::size_t half_cache_bytes = 0;
        auto [unused, half_step] = decode_sides(row, s, S, half_cache_bytes, weight_bytes, CachePrecision::bfloat16);
        p["weights"] = "float";
        Record& h = add("half_cache", p, step, half_step, true);
        h.extra["bytes_per_step"] = half_cache_bytes + weight_bytes;
        h.extra["cache_bytes"] = half_cache_bytes;
        // And with the projection weights in bfloat16 too (bfloat16_weights).
        LayerShape rounded = s;
        rounded.bfloat16_weights = true;
        std::size_t half_weight_bytes = 0;
        auto [unused_too, lean_step] =
            decode_sides(row, rounded, S, half_cache_bytes, half_weight_bytes, CachePrecision::bfloat16);
        p["weights"] = "bfloat16";
        Record& w = add("half_cache", p, step, lean_step, true);
        w.extra["bytes_per_step"] = half_cache_bytes + half_weight_bytes;
        w.extra["cache_bytes"] = half_cache_bytes;
      }
  }

  // Sliding windows: the same causal layer with window W at a long and a
  // short length. Its cost is O(T · W), so the ratio should approach the
  // ratio of the lengths, not its square.
  void window_scaling() {
    for (const auto& [long_T, short_T, W] : plan_.window_lengths)
      for (const bench::SuiteVariant& variant : bench::suite_variants()) {
        if (!variant.windowed) continue;
        const std::string v = variant.name;
        LayerShape s{plan_.widths.front().first, plan_.widths.front().second, true, 1};
        s.window = W;
        auto a = variant_side(v, s, long_T).first;
        auto b = variant_side(v, s, short_T).first;
        a.label = v + " T=" + std::to_string(long_T);
        b.label = v + " T=" + std::to_string(short_T);
        json p = layer_params(s, long_T);
        p["short_T"] = short_T;
        p["window"] = W;
        p["variant"] = v;
        add("window", p, a, b, true);
      }
  }

  void lsh_alone() {
    for (auto [D, H] : plan_.widths)
      for (Index T : plan_.lsh_alone_lengths)
        for (bool causal : {false, true})
          for (int threads : {1, 2}) {
            const LayerShape s{D, H, causal, threads};
            const bench::Clock clock = threads == 1 ? bench::Clock::cpu : bench::Clock::wall;
            const bench::SideTimes t = bench::series(variant_side("LSH", s, T).first, plan_.settings, clock);
            json p = layer_params(s, T);
            alone_.push_back(
                {{"table", "alone"}, {"params", p}, {"clock", bench::clock_name(clock)}, {"a", side_json(t, clock)}});
            std::printf("  %-10s %-34s %-44s %3zu reps\n", "alone", "LSH", (shape_text(p)).c_str(), t.seconds.size());
          }
  }

  Plan plan_;
  std::vector<Record> records_;
  std::vector<json> alone_;
};

void Suite::print_tables() const {
  auto each = [&](const char* table, auto&& fn) {
    for (const Record& r : records_)
      if (r.table == table) fn(r);
  };
  std::printf("\nAll ratios: median of the per-pair ratios [interquartile range] and the clock they come from;\n"
              "! = a quartile more than %.0f%% from the median. cpu: both sides run on the calling thread, timed\n"
              "by its CPU time (their latency less any time other processes took); wall: wall-clock time.\n"
              "Times (ms) are medians per call on the same clock.\n",
              100 * plan_.settings.flag_spread);

  std::printf("\n1. Time relative to MHA at the same shape (variant / MHA), beside the analytic FLOP ratio:\n");
  std::printf("   %-13s %-22s %9s %10s  %-27s %6s %9s\n", "variant", "shape", "MHA ms", "variant ms", "time ratio",
              "FLOPs", "time/FLOP");
  each("vs_mha", [](const Record& r) {
    const double f = r.extra["flop_ratio"].get<double>();
    std::printf("   %-13s %-22s %9.2f %10.2f  %-27s %5.2fx %9.2f\n", r.params["variant"].get<std::string>().c_str(),
                shape_text(r.params).c_str(), ms(r.r, r.r.b), ms(r.r, r.r.a), ratio_text(r.r).c_str(), f, r.r.ratio.median / f);
  });

  std::printf("\n2. 2-thread speedup (time at 1 thread / time at 2 threads):\n");
  std::printf("   %-13s %-22s %9s %9s  %-22s\n", "variant", "shape", "1t ms", "2t ms", "speedup");
  each("threads", [](const Record& r) {
    std::printf("   %-13s %-22s %9.2f %9.2f  %-22s\n", r.params["variant"].get<std::string>().c_str(),
                shape_text(r.params).c_str(), ms(r.r, r.r.a), ms(r.r, r.r.b), ratio_text(r.r).c_str());
  });

  std::printf("\n3. MHA's GFLOP/s against the GEMM yardstick [T, D] x [D, 3D], 1 thread (MHA's share):\n");
  std::printf("   %-10s %-22s %9s %9s  %-22s\n", "GEMM", "shape", "MHA GF/s", "GEMM GF/s", "MHA / GEMM");
  each("yardstick", [](const Record& r) {
    const double mha = r.extra["mha_flops"].get<double>() / r.r.b.summary(r.r.clock).median * 1e-9;
    const double gemm = r.extra["gemm_flops"].get<double>() / r.r.a.summary(r.r.clock).median * 1e-9;
    std::printf("   %-10s %-22s %9.1f %9.1f  %-22s\n", r.params["gemm"].get<std::string>().c_str(),
                shape_text(r.params).c_str(), mha, gemm, ratio_text(r.r).c_str());
  });

  bool torch = false;
  each("torch", [&](const Record&) { torch = true; });
  if (torch) {
    std::printf("\n4. headmix MHA against PyTorch (headmix time / torch time; below 1: headmix is faster);\n"
                "   * = the faster torch path at that shape, the baseline:\n");
    std::printf("   %-26s %-8s %-2s %10s %9s  %-22s\n", "shape", "torch", "", "headmix ms", "torch ms",
                "headmix / torch");
    std::map<std::string, double> fastest;  // shape -> the faster torch path's median time
    each("torch", [&](const Record& r) {
      const std::string key = shape_text(r.params);
      const double t = r.r.b.summary(r.r.clock).median;
      if (!fastest.count(key) || t < fastest[key]) fastest[key] = t;
    });
    each("torch", [&](const Record& r) {
      const std::string key = shape_text(r.params);
      const bool best = r.r.b.summary(r.r.clock).median == fastest[key];
      std::printf("   %-26s %-8s %-2s %10.2f %9.2f  %-22s\n", key.c_str(),
                  r.params["torch_path"].get<std::string>().c_str(), best ? "*" : "", ms(r.r, r.r.a), ms(r.r, r.r.b),
                  ratio_text(r.r).c_str());
    });
  }

  std::printf("\n5. Decoding one token with S positions in view, 1 thread: recompute the causal forward over S\n"
              "   positions / one cached step:\n");
  std::printf("   %-13s %-22s %9s %12s %10s  %-22s\n", "variant", "shape", "step ms", "recompute ms", "cache MiB",
              "recompute / step");
  each("decode", [](const Record& r) {
    std::printf("   %-13s %-22s %9.3f %12.2f %10.2f  %-22s\n", r.params["variant"].get<std::string>().c_str(),
                shape_text(r.params).c_str(), ms(r.r, r.r.b), ms(r.r, r.r.a),
                r.extra["cache_bytes"].get<double>() / (1 << 20), ratio_text(r.r).c_str());
  });
  bool bandwidth = false;
  each("bandwidth", [&](const Record&) { bandwidth = true; });
  if (bandwidth) {
    std::printf("\n   The same steps against the read bandwidth: a step reads its weights and its cache once;\n"
                "   'read' sums a buffer of those bytes (one thread, four streams at once). read / step =\n"
                "   the share of the bandwidth the step reaches (1.00x: at bandwidth):\n");
    std::printf("   %-13s %-22s %10s %9s %9s %9s  %-22s\n", "variant", "shape", "MiB/step", "step ms", "step GB/s",
                "read GB/s", "read / step");
    each("bandwidth", [](const Record& r) {
      const double bytes = r.extra["bytes_per_step"].get<double>();
      std::printf("   %-13s %-22s %10.2f %9.3f %9.2f %9.2f  %-22s\n", r.params["variant"].get<std::string>().c_str(),
                  shape_text(r.params).c_str(), bytes / (1 << 20), ms(r.r, r.r.b), bytes / ms(r.r, r.r.b) * 1e-6,
                  bytes / ms(r.r, r.r.a) * 1e-6, ratio_text(r.r).c_str());
    });
  }

  bool half = false;
  each("half_cache", [&](const Record&) { half = true; });
  if (half) {
    std::printf("\n   The same steps over a bfloat16 cache (K and V, and DCMHA's key-side factors, stored in half\n"
                "   precision, products in float), with float weights and with bfloat16 weights\n"
                "   (options.bfloat16_weights): full-cache, float-weight step / bf16 step = the speed-up per token:\n");
    std::printf("   %-13s %-22s %-8s %10s %9s %9s  %-22s\n", "variant", "shape", "weights", "MiB/step", "bf16 ms",
                "GB/s", "full / bf16");
    each("half_cache", [](const Record& r) {
      const double bytes = r.extra["bytes_per_step"].get<double>();
      std::printf("   %-13s %-22s %-8s %10.2f %9.3f %9.2f  %-22s\n", r.params["variant"].get<std::string>().c_str(),
                  shape_text(r.params).c_str(), r.params.value("weights", "float").c_str(), bytes / (1 << 20),
                  ms(r.r, r.r.b), bytes / ms(r.r, r.r.b) * 1e-6, ratio_text(r.r).c_str());
    });
  }

  bool windows = false;
  each("window", [&](const Record&) { windows = true; });
  if (windows) {
    std::printf("\n6. Sliding window W, causal, 1 thread: time at the long T / time at the short T (linear cost:\n"
                "   the ratio of the lengths):\n");
    std::printf("   %-13s %-8s %-16s %9s %9s  %-22s\n", "variant", "W", "T long / short", "long ms", "short ms",
                "time ratio");
    each("window", [](const Record& r) {
      const std::string lengths =
          std::to_string(r.params["T"].get<long>()) + " / " + std::to_string(r.params["short_T"].get<long>());
      std::printf("   %-13s %-8ld %-16s %9.1f %9.1f  %-22s\n", r.params["variant"].get<std::string>().c_str(),
                  r.params["window"].get<long>(), lengths.c_str(), ms(r.r, r.r.a), ms(r.r, r.r.b),
                  ratio_text(r.r).c_str());
    });
  }

  if (!alone_.empty()) {
    std::printf("\n7. LSH alone (dense attention does not fit): median ms per call [IQR]:\n");
    for (const json& j : alone_)
      std::printf("   %-26s %9.1f [%.1f-%.1f] %s\n", shape_text(j["params"]).c_str(),
                  1e3 * j["a"]["median_seconds"].get<double>(), 1e3 * j["a"]["q1_seconds"].get<double>(),
                  1e3 * j["a"]["q3_seconds"].get<double>(), j["clock"].get<std::string>().c_str());
  }
  const bench::Summary quiet = wall_over_cpu();
  if (quiet.median > 0)
    std::printf("\nSingle-threaded comparisons, wall time / CPU time per comparison: median %.2f, worst %.2f\n"
                "(1.00 when no other process wanted the core).\n",
                quiet.median, quiet.max);
  int flagged = 0;
  for (const Record& r : records_) flagged += r.r.flagged;
  std::printf("\n%zu comparisons, %d flagged (IQR wider than ±%.0f%%).\n", records_.size(), flagged,
              100 * plan_.settings.flag_spread);
}

json Suite::to_json(const json& context) const {
  json j = {{"context", context}, {"comparisons", json::array()}, {"alone", alone_}};
  for (const Record& r : records_) j["comparisons"].push_back(record_json(r));
  return j;
}

// ---- context --------------------------------------------------------------------------
std::string first_line_of(const char* path, const std::string& key = "") {
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);)
    if (key.empty() || line.rfind(key, 0) == 0) {
      const auto colon = key.empty() ? std::string::npos : line.find(':');
      return colon == std::string::npos ? line : line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  return "unknown";
}

std::string env_or(const char* name, const char* otherwise) {
  const char* v = std::getenv(name);
  return v ? v : otherwise;
}

// glibc's defaults return large freed blocks to the kernel (mmap'd blocks at
// once, the heap top past 128 KiB), so a call that allocates its buffers
// afresh every time (libtorch's operators; Eigen's GEMM packing buffers)
// faults in new pages on every call: up to 4x torch's time here. Keep
// freed memory in the process instead, for every row alike.
std::string tune_malloc() {
  const bool ok = mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, -1) == 1 &&
                  mallopt(M_TOP_PAD, 64 << 20) == 1;
  return ok ? "glibc malloc, mallopt(M_MMAP_MAX = 0, M_TRIM_THRESHOLD = -1 (never trim), M_TOP_PAD = 64 MiB) for "
              "every row; the heap grown ahead, touched, to twice what torch's calls took it to"
            : "glibc malloc defaults (mallopt failed)";
}

#ifdef HEADMIX_BENCH_OPENBLAS
// Empty, or why OpenBLAS is not at its strongest here: OPENBLAS_CORETYPE
// forcing a kernel without AVX-512 on a CPU that has it (seen: Haswell's
// AVX2 kernel at half the sgemm rate of the Cooperlake kernel OpenBLAS picks
// itself on the same Zen 5 core). The yardstick's OpenBLAS row and the torch
// rows, whose BLAS is OpenBLAS, then understate the peer.
std::string openblas_strength_warning() {
  std::string core = openblas_get_corename();
  std::transform(core.begin(), core.end(), core.begin(), [](unsigned char ch) { return std::tolower(ch); });
  const bool wide_kernel = core.find("skylakex") != std::string::npos || core.find("cooperlake") != std::string::npos ||
                           core.find("sapphirerapids") != std::string::npos;
#if defined(__x86_64__) || defined(__i386__)
  const bool cpu_has_avx512 = __builtin_cpu_supports("avx512f");
#else
  const bool cpu_has_avx512 = false;
#endif
  if (wide_kernel || !std::getenv("OPENBLAS_CORETYPE") || !cpu_has_avx512) return "";
  return "OPENBLAS_CORETYPE=" + env_or("OPENBLAS_CORETYPE", "") + " forces OpenBLAS's " + openblas_get_corename() +
         " kernel on a CPU with AVX-512, so the OpenBLAS yardstick and the torch rows are not the strongest peer; "
         "for those tables, run: env -u OPENBLAS_CORETYPE headmix_suite --only=yardstick (and --only=torch)";
}
#endif

json make_context(const Plan& plan, const std::string& malloc_setup) {
  json c;
  c["mode"] = plan.mode;
  c["cpu"] = first_line_of("/proc/cpuinfo", "model name");
  c["cpus_online"] = sysconf(_SC_NPROCESSORS_ONLN);
  c["compiler"] = std::string("g++ ") + __VERSION__;
  c["eigen"] = std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) + "." +
               std::to_string(EIGEN_MINOR_VERSION) + ", SIMD " + Eigen::SimdInstructionSetsInUse();
#if defined(HEADMIX_USE_LIBXSMM)
  c["headmix_gemm"] = std::string("libxsmm ") + LIBXSMM_VERSION + " JIT kernels, target " + libxsmm_get_target_arch() +
                      ", k slices of " + std::to_string(headmix::detail::gemm_k_slice());
#elif defined(EIGEN_USE_BLAS)
  c["headmix_gemm"] = "OpenBLAS through EIGEN_USE_BLAS (1 thread)";
#else
  c["headmix_gemm"] = "Eigen's built-in GEMM";
#endif
#ifdef HEADMIX_BENCH_OPENBLAS
  c["openblas"] = std::string(openblas_get_config()) + "; core kernel " + openblas_get_corename();
  if (const std::string warning = openblas_strength_warning(); !warning.empty()) c["openblas_warning"] = warning;
#else
  c["openblas"] = "not linked (install libopenblas-dev for the OpenBLAS yardstick)";
#endif
  c["OPENBLAS_CORETYPE"] = std::getenv("OPENBLAS_CORETYPE")
                               ? env_or("OPENBLAS_CORETYPE", "") + " (from the environment; the suite never sets it)"
                               : "(unset: OpenBLAS detected the CPU)";
  c["OPENBLAS_NUM_THREADS"] = env_or("OPENBLAS_NUM_THREADS", "(unset; the suite sets OpenBLAS's threads per row)");
  c["malloc"] = malloc_setup;
#ifdef HEADMIX_BENCH_TORCH
  c["torch"] = bench::torch_rows::setup();
  c["OMP_WAIT_POLICY"] = env_or("OMP_WAIT_POLICY", "(unset: libgomp's default, workers spin; torch's 2-thread rows are "
                                                   "slower than they could be)");
#else
  c["torch"] = "not built (install libtorch-dev and reconfigure for the PyTorch rows)";
#endif
  c["clock"] = "cpu (the calling thread's CPU time) for comparisons whose sides both run on it, wall otherwise; "
               "multi-threaded torch rows pause " + std::to_string(kSpinSettleSeconds) +
               " s before each repetition, until OpenBLAS's idle workers stop spinning";
  c["pinning"] = plan.settings.cpu < 0
                     ? std::string("none: one-thread comparisons run wherever the scheduler puts them")
                     : "one-thread comparisons: the calling thread pinned to CPU " + std::to_string(plan.settings.cpu) +
                           " while timed (--cpu=N to choose, --cpu=none for no pinning); multi-threaded rows unpinned";
  c["pairs"] = {{"min_pairs", plan.settings.min_pairs},
                {"max_pairs", plan.settings.max_pairs},
                {"budget_seconds", plan.settings.budget_seconds},
                {"min_rep_seconds", plan.settings.min_rep_seconds},
                {"flag_spread", plan.settings.flag_spread},
                {"order", "A B, B A, A B, ... (the first side alternates)"}};
  c["layers"] =
      "B = 1, float, self-attention; bench::make_* in bench/bench_common.hpp (Talking-Heads both mixes; CollabHead "
      "R = D/2; DCMHA R = 2, K = 4H; LSH bucket 64, 4 hashes)";
  return c;
}

#ifdef HEADMIX_BENCH_TORCH
// torch's OpenMP workers spin after each parallel region (libgomp's default
// wait policy) on the core that OpenBLAS's second thread needs: at 2 threads
// torch's fused path took 56-59 ms at T = 1024 and 24 ms at T = 256 with
// them spinning, 45 and 7.0 ms with OMP_WAIT_POLICY=passive, its strongest
// 2-thread setting measured (1 OpenMP and 2 OpenBLAS threads: 44-46 and
// 6.9-7.5 ms, but 149-172 ms at T = 2048 against 147). libgomp reads the
// policy when it loads, before main: so the suite runs itself again with it
// set, unless the caller chose one.
void use_passive_openmp(char** argv) {
#ifdef __linux__
  if (std::getenv("OMP_WAIT_POLICY")) return;
  setenv("OMP_WAIT_POLICY", "passive", 1);
  execv("/proc/self/exe", argv);
  unsetenv("OMP_WAIT_POLICY");  // exec failed: the default policy runs, and the header says so
#else
  (void)argv;
#endif
}
#endif

// The CPU one-thread comparisons run on: --cpu's value ("none": -1), by
// default the first CPU this process may use (-1 where none is known or
// pinning fails, e.g. in a container that forbids it).
int pinning_cpu(const std::string& arg) {
  const std::vector<int> allowed = bench::allowed_cpus();
  if (arg == "none") return -1;
  if (arg.empty()) return !allowed.empty() && bench::PinnedThread(allowed.front()).pinned() ? allowed.front() : -1;
  std::size_t used = 0;
  int cpu = -1;
  try {
    cpu = std::stoi(arg, &used);
  } catch (const std::exception&) {
  }
  if (used != arg.size() || std::find(allowed.begin(), allowed.end(), cpu) == allowed.end() ||
      !bench::PinnedThread(cpu).pinned()) {
    std::string list;
    for (int c : allowed) list += (list.empty() ? "" : " ") + std::to_string(c);
    throw std::invalid_argument("--cpu must be none or a CPU this process may run on (" + list + "), not '" + arg + "'");
  }
  return cpu;
}

}  // namespace

int main(int argc, char** argv) try {
#ifdef HEADMIX_BENCH_TORCH
  use_passive_openmp(argv);
#endif
  std::string mode = "default", json_path, only, cpu;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--mode=", 0) == 0) mode = a.substr(7);
    else if (a.rfind("--json=", 0) == 0) json_path = a.substr(7);
    else if (a.rfind("--only=", 0) == 0) only = a.substr(7);
    else if (a.rfind("--cpu=", 0) == 0) cpu = a.substr(6);
    else {
      std::fprintf(stderr, "usage: headmix_suite [--mode=default|full|smoke] [--json=results.json] "
                           "[--only=vs_mha|threads|yardstick|torch|decode|window|alone] [--cpu=N|none]\n");
      return 2;
    }
  }
  const std::string malloc_setup = tune_malloc();
#ifdef HEADMIX_BENCH_OPENBLAS
  openblas_set_num_threads(1);  // headmix runs its own workers; rows that want more set them
#endif
  Plan plan = make_plan(mode);
  const std::vector<std::string> tables = {"vs_mha", "threads", "yardstick", "torch", "decode", "window", "alone"};
  if (!only.empty() && std::find(tables.begin(), tables.end(), only) == tables.end())
    throw std::invalid_argument("--only must name a table (vs_mha, threads, yardstick, torch, decode, window, alone), not '" +
                                only + "'");
  plan.only = only;
  plan.settings.cpu = pinning_cpu(cpu);
  json context = make_context(plan, malloc_setup);
  context["loadavg_start"] = first_line_of("/proc/loadavg");
  std::printf("headmix benchmark suite, mode %s\n", mode.c_str());
  for (auto& [k, v] : context.items())
    std::printf("  %-22s %s\n", k.c_str(), v.is_string() ? v.get<std::string>().c_str() : v.dump().c_str());
  const MachineProbe before = probe_machine(plan.settings);
  std::printf("\nMachine probe before the tables: GEMM %.0f GFLOP/s, read %.1f GB/s (1 thread, pinned)\n",
              before.gemm_gflops, before.read_gbs);
  std::printf("\nComparisons as they run (ratio = first side / second side):\n");
  Suite suite(plan);
  suite.run();
  const MachineProbe after = probe_machine(plan.settings);
  context["loadavg_end"] = first_line_of("/proc/loadavg");
  const double gemm_moved = after.gemm_gflops / before.gemm_gflops - 1, read_moved = after.read_gbs / before.read_gbs - 1;
  context["machine_probe"] = {{"definition", "headmix GEMM [256, 768] x [768, 2304] GFLOP/s and the read yardstick on "
                                             "80 MiB GB/s, 1 thread, pinned, before and after the tables"},
                              {"before", {{"gemm_gflops", before.gemm_gflops}, {"read_gbs", before.read_gbs}}},
                              {"after", {{"gemm_gflops", after.gemm_gflops}, {"read_gbs", after.read_gbs}}}};
  const bench::Summary quiet = suite.wall_over_cpu();
  context["wall_over_cpu_single_threaded"] = {{"median", quiet.median}, {"worst", quiet.max}};
  suite.print_tables();
  std::printf("Load average (1, 5, 15 min) at start: %s; at end: %s\n",
              context["loadavg_start"].get<std::string>().c_str(), context["loadavg_end"].get<std::string>().c_str());
  std::printf("Machine probe before / after the tables: GEMM %.0f / %.0f GFLOP/s (%+.0f%%), read %.1f / %.1f GB/s "
              "(%+.0f%%)\n",
              before.gemm_gflops, after.gemm_gflops, 100 * gemm_moved, before.read_gbs, after.read_gbs,
              100 * read_moved);
  if (std::abs(gemm_moved) > 0.05 || std::abs(read_moved) > 0.05)
    std::printf("Warning: the machine's speed moved by more than 5%% during the run (other work on it or its host):\n"
                "ratios of a compute-bound side to a memory-bound one (decoding) and comparisons with other runs\n"
                "are suspect; run again on a quieter machine.\n");
  if (context.contains("openblas_warning"))
    std::printf("Warning: %s\n", context["openblas_warning"].get<std::string>().c_str());
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << suite.to_json(context).dump(1) << "\n";
    if (!out) throw std::runtime_error("cannot write " + json_path);
    std::printf("Wrote %s\n", json_path.c_str());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "headmix_suite: %s\n", e.what());
  return 1;
}
