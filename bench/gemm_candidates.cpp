// headmix_gemm_candidates: which GEMM library should headmix's products use?
//
// Candidates (each optional at configure time): Eigen's own kernels as
// headmix calls them (Map with OuterStride over row-major buffers), Eigen
// with K packed once per head, OpenBLAS (cblas_sgemm), BLIS (native typed
// API bli_sgemm) and libxsmm (JIT micro-kernels over tiles). All run on the
// calling thread.
//
// Shapes, float, dk = dv = 64, H = 12 (D = 768):
//   scores   C[rows x keys] = Q_h[rows x 64] K_h[keys x 64]^T
//   readout  O_h[rows x 64] = P[rows x keys] V_h[keys x 64]
//   proj     Y[T x 3D] = X[T x D] W^T, W [3D x D] (PyTorch layout)
// Q, K, V and O are [T, H * 64] row-major with a head's columns a strided
// slice, so operands come from where they would in the layer. One timed
// call of scores / readout is a sweep: every query block of `heads` heads
// for T = keys (one score block or P block reused, as the layer's workspace
// is).
//
// Measurement: candidates interleaved round-robin with a rotating start so
// that none always runs first; each repetition is timed on the calling
// thread's CPU clock (paired.hpp's reasoning: the machine is shared); the
// table gives median GFLOP/s (2 m n k per product) and its interquartile
// range. Before timing, each candidate is checked against a double-precision
// naive product on one small shape of each kind; the program exits 1 if
// any differs by more than 1e-3 relative to the result's largest magnitude.
//
// Usage: headmix_gemm_candidates [--quick] [--json=path]
#include "paired.hpp"

#include <Eigen/Core>

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#ifdef HEADMIX_GEMM_BLIS
#include <blis.h>
#endif
#ifdef HEADMIX_GEMM_XSMM
#define HEADMIX_USE_LIBXSMM  // for the k slice headmix's gemm() takes (gemm_k_slice)
#include "headmix/core/gemm.hpp"
#endif

namespace {

using Index = Eigen::Index;
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using CMap = Eigen::Map<const RowMat, Eigen::Unaligned, Eigen::OuterStride<>>;
using MMap = Eigen::Map<RowMat, Eigen::Unaligned, Eigen::OuterStride<>>;

constexpr Index kHeadDim = 64;
constexpr Index kPanelCols = 64;  // the width of headmix's PackedMatrix panels (its libxsmm tile width)

// One row-major product C[m x n] = A[m x k] op(B): op(B) = B [k x n] when
// !trans_b, else B^T with B stored [n x k]. Leading dimensions in elements.
// `b_panels` (libxsmm's candidate only): B [k x n] is stored as headmix's
// PackedMatrix stores it, in panels of 64 columns, each row-major on its own
// (ldb unused).
struct GemmArgs {
  bool trans_b;
  Index m, n, k;
  const float* a;
  Index lda;
  const float* b;
  Index ldb;
  float* c;
  Index ldc;
  bool b_panels = false;
};
using GemmFn = std::function<void(const GemmArgs&)>;

// ---------------------------------------------------------------- Eigen
void eigen_gemm(const GemmArgs& g) {
  const CMap a(g.a, g.m, g.k, Eigen::OuterStride<>(g.lda));
  MMap c(g.c, g.m, g.n, Eigen::OuterStride<>(g.ldc));
  if (g.trans_b)
    c.noalias() = a * CMap(g.b, g.n, g.k, Eigen::OuterStride<>(g.ldb)).transpose();
  else
    c.noalias() = a * CMap(g.b, g.k, g.n, Eigen::OuterStride<>(g.ldb));
}

// ---------------------------------------------------------------- OpenBLAS
// libblis exports cblas_sgemm and sgemm_ as well, so OpenBLAS's entry points
// are taken from OpenBLAS's own handle (dlsym on it searches that object
// first) rather than from whichever library the global lookup finds first.
// The CBLAS enums are spelled out here so that no cblas.h (BLIS ships one)
// is included.
struct OpenBlas {
  using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                         float*, int);
  Sgemm sgemm = nullptr;
  void (*set_threads)(int) = nullptr;
  char* (*config)() = nullptr;
  char* (*corename)() = nullptr;
  std::string error;
};

#ifdef HEADMIX_GEMM_OPENBLAS
// Called directly (only OpenBLAS has it) so that the linker keeps
// libopenblas as a dependency, ahead of libblis, under --as-needed.
extern "C" void openblas_set_num_threads(int);

const OpenBlas& openblas() {
  static const OpenBlas ob = [] {
    OpenBlas o;
    void* h = dlopen(HEADMIX_OPENBLAS_PATH, RTLD_NOW | RTLD_NOLOAD);
    if (!h) h = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_NOLOAD);
    if (!h) {
      o.error = "OpenBLAS is linked but not loaded (" HEADMIX_OPENBLAS_PATH ")";  // NOLOAD sets no dlerror
      return o;
    }
    o.sgemm = reinterpret_cast<OpenBlas::Sgemm>(dlsym(h, "cblas_sgemm"));
    o.set_threads = reinterpret_cast<void (*)(int)>(dlsym(h, "openblas_set_num_threads"));
    o.config = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_config"));
    o.corename = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_corename"));
    if (!o.sgemm || !o.set_threads || !o.config || !o.corename) o.error = "OpenBLAS entry points missing";
    return o;
  }();
  return ob;
}

void openblas_gemm(const GemmArgs& g) {
  constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
  openblas().sgemm(kRowMajor, kNoTrans, g.trans_b ? kTrans : kNoTrans, int(g.m), int(g.n), int(g.k), 1.0f, g.a,
                   int(g.lda), g.b, int(g.ldb), 0.0f, g.c, int(g.ldc));
}
#endif

// ---------------------------------------------------------------- BLIS
#ifdef HEADMIX_GEMM_BLIS
// Native typed API with general strides: a row-major operand is (row
// stride ld, column stride 1); B^T is B's strides swapped.
void blis_gemm(const GemmArgs& g) {
  float one = 1, zero = 0;
  const inc_t rsb = g.trans_b ? 1 : g.ldb, csb = g.trans_b ? g.ldb : 1;
  bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, g.m, g.n, g.k, &one, const_cast<float*>(g.a), g.lda, 1,
            const_cast<float*>(g.b), rsb, csb, &zero, g.c, g.ldc, 1);
}
#endif

// ---------------------------------------------------------------- libxsmm
#ifdef HEADMIX_GEMM_XSMM
// libxsmm's kernels are column-major C = A B. A row-major C[m x n] is a
// column-major C^T[n x m], and C^T = op(B)^T A^T, whose operands are the
// row-major buffers as they stand when !trans_b. So the candidate takes
// only B [k x n]; the sweeps hand it K_h^T packed once per head (scores)
// and W^T prepared at setup in 64-column panels (projections: weights are
// constant, and headmix's Linear::prepare lays them out so when a layer is
// built). Tiles: 64 x 64 of C^T, k in headmix's slices (64 for AVX2
// kernels, 256 for AVX-512: headmix::detail::gemm_k_slice), beta 0 for the
// first slice, 1 after, each a JIT kernel from libxsmm's registry.
constexpr Index kXsmmTileM = kPanelCols, kXsmmTileN = 64;

libxsmm_smmfunction xsmm_kernel(Index m, Index n, Index k, Index lda, Index ldb, Index ldc, bool accumulate) {
  using Key = std::tuple<Index, Index, Index, Index, Index, Index, bool>;
  static std::map<Key, libxsmm_smmfunction> cache;  // skips the registry's lookup in the sweep loops
  const Key key{m, n, k, lda, ldb, ldc, accumulate};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const libxsmm_blasint im = m, in = n, ik = k, ilda = lda, ildb = ldb, ildc = ldc;
  const float alpha = 1, beta = accumulate ? 1.0f : 0.0f;
  const int flags = LIBXSMM_GEMM_FLAG_NONE;
  const libxsmm_smmfunction f = libxsmm_smmdispatch(im, in, ik, &ilda, &ildb, &ildc, &alpha, &beta, &flags, nullptr);
  if (!f) {
    std::fprintf(stderr, "libxsmm: no JIT kernel for %ldx%ldx%ld\n", long(m), long(n), long(k));
    std::exit(2);
  }
  cache.emplace(key, f);
  return f;
}

void xsmm_gemm(const GemmArgs& g) {
  if (g.trans_b) {
    std::fprintf(stderr, "libxsmm candidate: trans_b is not a path of this bench\n");
    std::exit(2);
  }
  // Column-major view: C^T [n x m] (ld ldc) = B^T [n x k] (ld ldb) * A^T [k x m] (ld lda).
  const Index slice = headmix::detail::gemm_k_slice();
  for (Index j0 = 0; j0 < g.m; j0 += kXsmmTileN) {
    const Index nj = std::min(kXsmmTileN, g.m - j0);
    for (Index i0 = 0; i0 < g.n; i0 += kXsmmTileM) {
      const Index mi = std::min(kXsmmTileM, g.n - i0);
      for (Index p0 = 0; p0 < g.k; p0 += slice) {
        const Index kp = std::min(slice, g.k - p0);
        const Index ldb = g.b_panels ? mi : g.ldb;
        const float* bt = g.b_panels ? g.b + i0 * g.k + p0 * mi : g.b + p0 * g.ldb + i0;
        const libxsmm_smmfunction f = xsmm_kernel(mi, nj, kp, ldb, g.lda, g.ldc, p0 > 0);
        f(bt, g.a + j0 * g.lda + p0, g.c + j0 * g.ldc + i0);
      }
    }
  }
}
#endif

// ---------------------------------------------------------------- shapes
enum class Kind { scores, readout, proj };
const char* kind_name(Kind k) { return k == Kind::scores ? "scores" : k == Kind::readout ? "readout" : "proj"; }

struct Shape {
  Kind kind;
  Index rows = 0, keys = 0;  // scores / readout: T = keys
  Index T = 0, D = 0;        // proj
  Index heads = 0;           // heads per sweep (scores / readout)
  Index H() const { return kind == Kind::proj ? D / kHeadDim : 12; }
  double flops() const {
    if (kind == Kind::proj) return 2.0 * double(T) * double(3 * D) * double(D);
    return 2.0 * double(heads) * double(keys / rows) * double(rows) * double(keys) * double(kHeadDim);
  }
  std::string label() const {
    std::ostringstream s;
    if (kind == Kind::proj)
      s << "proj T=" << T << " D=" << D;
    else
      s << kind_name(kind) << " rows=" << rows << " keys=" << keys << " (" << heads << "h)";
    return s.str();
  }
};

// Heads per sweep: all 12 up to T = 1024; one at T = 4096, whose full
// sweep (26 GFLOP) would take the run's whole budget. A head's operands are
// strided alike either way.
Shape attention_shape(Kind kind, Index rows, Index keys) {
  Shape s;
  s.kind = kind;
  s.rows = rows;
  s.keys = keys;
  s.heads = keys > 1024 ? 1 : 12;
  return s;
}
Shape proj_shape(Index T, Index D) {
  Shape s;
  s.kind = Kind::proj;
  s.T = T;
  s.D = D;
  return s;
}

std::vector<float> random_buffer(Index n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = u(rng);
  return v;
}

// The layer's buffers for one shape.
struct Buffers {
  Shape s;
  Index width = 0;  // H * 64
  std::vector<float> q, k, v, out, block, kt;  // block: the score / P block; kt: packed K_h^T
  std::vector<float> x, w, wt, wt_panels, y;   // proj
  explicit Buffers(const Shape& shape) : s(shape) {
    if (s.kind == Kind::proj) {
      x = random_buffer(s.T * s.D, 1);
      w = random_buffer(3 * s.D * s.D, 2);
      wt.resize(w.size());
      for (Index i = 0; i < 3 * s.D; ++i)
        for (Index j = 0; j < s.D; ++j) wt[std::size_t(j * 3 * s.D + i)] = w[std::size_t(i * s.D + j)];
      for (Index i0 = 0; i0 < 3 * s.D; i0 += kPanelCols) {
        const Index width = std::min(kPanelCols, 3 * s.D - i0);
        for (Index j = 0; j < s.D; ++j)
          for (Index i = 0; i < width; ++i) wt_panels.push_back(wt[std::size_t(j * 3 * s.D + i0 + i)]);
      }
      y.assign(std::size_t(s.T * 3 * s.D), 0.0f);
      return;
    }
    width = s.H() * kHeadDim;
    q = random_buffer(s.keys * width, 3);
    k = random_buffer(s.keys * width, 4);
    v = random_buffer(s.keys * width, 5);
    out.assign(std::size_t(s.keys * width), 0.0f);
    block = random_buffer(s.rows * s.keys, 6);  // readout's P; scores overwrite it
    kt.assign(std::size_t(kHeadDim * s.keys), 0.0f);
  }
};

// K_h^T [64 x keys], contiguous: packed once per head before its sweep, in
// panels of 16 keys so that each written run is a cache line and the 16
// rows read stay in L1 (a plain scatter cost ~4 ns an element).
void pack_kt(Buffers& b, Index h) {
  constexpr Index kPanel = 16;
  const Index keys = b.s.keys;
  const float* k = b.k.data() + h * kHeadDim;
  for (Index j0 = 0; j0 < keys; j0 += kPanel) {
    const Index nj = std::min(kPanel, keys - j0);
    for (Index d = 0; d < kHeadDim; ++d) {
      float* dst = b.kt.data() + d * keys + j0;
      for (Index j = 0; j < nj; ++j) dst[j] = k[(j0 + j) * b.width + d];
    }
  }
}

// One timed call of a candidate on a shape. `packed`: scores use K_h^T
// packed once per head, projections the prepared W^T (`panels`: in
// PackedMatrix's panels).
void sweep(Buffers& b, const GemmFn& gemm, bool packed, bool panels) {
  const Shape& s = b.s;
  if (s.kind == Kind::proj) {
    if (panels)
      gemm({false, s.T, 3 * s.D, s.D, b.x.data(), s.D, b.wt_panels.data(), 0, b.y.data(), 3 * s.D, true});
    else if (packed)
      gemm({false, s.T, 3 * s.D, s.D, b.x.data(), s.D, b.wt.data(), 3 * s.D, b.y.data(), 3 * s.D});
    else
      gemm({true, s.T, 3 * s.D, s.D, b.x.data(), s.D, b.w.data(), s.D, b.y.data(), 3 * s.D});
    return;
  }
  for (Index h = 0; h < s.heads; ++h) {
    if (s.kind == Kind::scores && packed) pack_kt(b, h);
    for (Index r0 = 0; r0 < s.keys; r0 += s.rows) {
      const float* qa = b.q.data() + r0 * b.width + h * kHeadDim;
      if (s.kind == Kind::scores && packed)
        gemm({false, s.rows, s.keys, kHeadDim, qa, b.width, b.kt.data(), s.keys, b.block.data(), s.keys});
      else if (s.kind == Kind::scores)
        gemm({true, s.rows, s.keys, kHeadDim, qa, b.width, b.k.data() + h * kHeadDim, b.width, b.block.data(),
              s.keys});
      else
        gemm({false, s.rows, kHeadDim, s.keys, b.block.data(), s.keys, b.v.data() + h * kHeadDim, b.width,
              b.out.data() + r0 * b.width + h * kHeadDim, b.width});
    }
  }
}

struct Candidate {
  std::string name;
  GemmFn gemm;
  bool packed = false;               // scores on packed K_h^T, proj on W^T
  bool scores_only_packing = false;  // a packing variant: differs from its base only on scores
  bool panels = false;               // proj on W^T in PackedMatrix's panels, as headmix's Linear reads it
  void run(Buffers& b) const { sweep(b, gemm, packed, panels); }
};

std::vector<Candidate> candidates() {
  std::vector<Candidate> c;
  c.push_back({"Eigen", eigen_gemm, false, false});
  c.push_back({"Eigen+packK", eigen_gemm, true, true});
#ifdef HEADMIX_GEMM_OPENBLAS
  c.push_back({"OpenBLAS", openblas_gemm, false, false});
#endif
#ifdef HEADMIX_GEMM_BLIS
  c.push_back({"BLIS", blis_gemm, false, false});
#endif
#ifdef HEADMIX_GEMM_XSMM
  c.push_back({"libxsmm", xsmm_gemm, true, false, true});
#endif
  return c;
}

bool runs_on(const Candidate& c, const Shape& s) {
  // Eigen+packK is Eigen on every kind but scores; its projection would be
  // Eigen on W^T, a different weight layout, not a K packing.
  return !(c.scores_only_packing && s.kind != Kind::scores);
}

// ---------------------------------------------------------------- correctness
// Largest |candidate - naive double| over what the sweep left (scores: the
// last block; readout: every swept head's output; proj: Y), and the
// reference's largest magnitude.
std::pair<double, double> check(const Candidate& cand, const Shape& s) {
  Buffers b(s);
  cand.run(b);
  double err = 0, scale = 0;
  auto note = [&](double ref, float got) {
    err = std::max(err, std::abs(ref - double(got)));
    scale = std::max(scale, std::abs(ref));
  };
  if (s.kind == Kind::proj) {
    for (Index t = 0; t < s.T; ++t)
      for (Index o = 0; o < 3 * s.D; ++o) {
        double acc = 0;
        for (Index i = 0; i < s.D; ++i) acc += double(b.x[std::size_t(t * s.D + i)]) * b.w[std::size_t(o * s.D + i)];
        note(acc, b.y[std::size_t(t * 3 * s.D + o)]);
      }
  } else if (s.kind == Kind::scores) {
    const Index h = s.heads - 1, r0 = s.keys - s.rows;
    for (Index i = 0; i < s.rows; ++i)
      for (Index j = 0; j < s.keys; ++j) {
        double acc = 0;
        for (Index d = 0; d < kHeadDim; ++d)
          acc += double(b.q[std::size_t((r0 + i) * b.width + h * kHeadDim + d)]) *
                 b.k[std::size_t(j * b.width + h * kHeadDim + d)];
        note(acc, b.block[std::size_t(i * s.keys + j)]);
      }
  } else {
    for (Index h = 0; h < s.heads; ++h)
      for (Index t = 0; t < s.keys; ++t)
        for (Index d = 0; d < kHeadDim; ++d) {
          double acc = 0;
          for (Index j = 0; j < s.keys; ++j)
            acc += double(b.block[std::size_t((t % s.rows) * s.keys + j)]) *
                   b.v[std::size_t(j * b.width + h * kHeadDim + d)];
          note(acc, b.out[std::size_t(t * b.width + h * kHeadDim + d)]);
        }
  }
  return {err, scale};
}

// ---------------------------------------------------------------- timing
struct Result {
  Shape shape;
  std::string name;
  headmix::bench::Summary gflops;
  int reps = 0, calls_per_rep = 1;
};

struct Settings {
  int min_rounds = 7, max_rounds = 25;
  double budget_per_candidate = 0.5;  // CPU seconds of timed repetitions per candidate per shape
  double min_rep_seconds = 0.02;
};

std::vector<Result> measure(const Shape& s, const std::vector<Candidate>& all, const Settings& set) {
  std::vector<const Candidate*> cs;
  for (const Candidate& c : all)
    if (runs_on(c, s)) cs.push_back(&c);
  Buffers b(s);
  std::vector<int> calls(cs.size());
  std::vector<std::vector<double>> secs(cs.size());
  for (std::size_t i = 0; i < cs.size(); ++i) {
    cs[i]->run(b);  // warm: JIT, workspaces, caches
    const double t0 = headmix::bench::detail::cpu_now();
    cs[i]->run(b);
    const double once = headmix::bench::detail::cpu_now() - t0;
    calls[i] = std::max(1, int(std::ceil(set.min_rep_seconds / std::max(once, 1e-9))));
  }
  double spent = 0;  // timed CPU seconds, all candidates
  for (int round = 0;; ++round) {
    for (std::size_t j = 0; j < cs.size(); ++j) {
      const std::size_t i = (j + std::size_t(round)) % cs.size();  // rotate who goes first
      const double t0 = headmix::bench::detail::cpu_now();
      for (int c = 0; c < calls[i]; ++c) cs[i]->run(b);
      const double t = headmix::bench::detail::cpu_now() - t0;
      spent += t;
      secs[i].push_back(t / calls[i]);
    }
    const int done = round + 1;
    if (done >= set.min_rounds &&
        (done >= set.max_rounds || spent >= set.budget_per_candidate * double(cs.size())))
      break;
  }
  std::vector<Result> out;
  for (std::size_t i = 0; i < cs.size(); ++i) {
    std::vector<double> g;
    for (double t : secs[i]) g.push_back(s.flops() / t * 1e-9);
    out.push_back({s, cs[i]->name, headmix::bench::summarize(g), int(g.size()), calls[i]});
  }
  return out;
}

// ---------------------------------------------------------------- peak
// The core's FMA throughput on the calling thread: independent FMA chains
// in registers, no memory. The yardstick for "near peak" (GEMM can reach
// ~90% of it); the AVX2 figure is the ceiling of a 256-bit kernel (OpenBLAS
// Haswell, BLIS zen3) on this core.
typedef float Vec16 __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));

template <class Vec>
double fma_peak_gflops() {
  constexpr int Lanes = int(sizeof(Vec) / sizeof(float));
  constexpr int kChains = 12;
  Vec acc[kChains];
  const float xs = 1.0f + 1e-7f * float(std::rand() % 2), ys = 1e-7f;
  Vec x, y;
  for (int l = 0; l < Lanes; ++l) x[l] = xs, y[l] = ys;
  for (int r = 0; r < kChains; ++r) acc[r] = x * float(r);
  constexpr long kIters = 20'000'000;
  const double t0 = headmix::bench::detail::cpu_now();
  for (long i = 0; i < kIters; ++i)
    for (int r = 0; r < kChains; ++r) acc[r] = acc[r] * x + y;
  const double t = headmix::bench::detail::cpu_now() - t0;
  float sink = 0;
  for (int r = 0; r < kChains; ++r)
    for (int l = 0; l < Lanes; ++l) sink += acc[r][l];
  if (sink == 42.0f) std::printf(" ");  // keeps the loop
  return 2.0 * Lanes * kChains * double(kIters) / t * 1e-9;
}

// ---------------------------------------------------------------- header
[[maybe_unused]] std::string library_origin(const void* fn) {
  Dl_info info{};
  if (fn && dladdr(fn, &info) && info.dli_fname) return info.dli_fname;
  return "?";
}

std::vector<std::pair<std::string, std::string>> configuration() {
  std::vector<std::pair<std::string, std::string>> c;
  c.push_back({"Eigen", std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) + "." +
                            std::to_string(EIGEN_MINOR_VERSION) + ", SIMD " + Eigen::SimdInstructionSetsInUse()});
#ifdef HEADMIX_GEMM_OPENBLAS
  const OpenBlas& ob = openblas();
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  c.push_back({"OpenBLAS", std::string(ob.config()) + "; core " + ob.corename() + "; OPENBLAS_CORETYPE=" +
                               (coretype ? coretype : "(unset)") + "; cblas_sgemm from " +
                               library_origin(reinterpret_cast<const void*>(ob.sgemm))});
  c.push_back({"global cblas_sgemm", library_origin(dlsym(RTLD_DEFAULT, "cblas_sgemm")) +
                                         " (unused: the bench calls OpenBLAS's handle)"});
#else
  c.push_back({"OpenBLAS", "not built (install libopenblas-dev)"});
#endif
#ifdef HEADMIX_GEMM_BLIS
  const char* arch_env = std::getenv("BLIS_ARCH_TYPE");
  const std::string arch = bli_arch_string(bli_arch_query_id());
  c.push_back({"BLIS", std::string(bli_info_get_version_str()) + "; arch " + arch + "; BLIS_ARCH_TYPE=" +
                           (arch_env ? arch_env : "(unset)") + "; bli_sgemm from " +
                           library_origin(reinterpret_cast<const void*>(&bli_sgemm)) +
                           (arch == "generic" ? "; WARNING: reference kernels, this BLIS does not know this CPU (BLIS_ARCH_TYPE takes "
                                                "an arch_t number: " + std::to_string(BLIS_ARCH_SKX) + " skx, " +
                                                std::to_string(BLIS_ARCH_HASWELL) + " haswell, " +
                                                std::to_string(BLIS_ARCH_ZEN3) + " zen3)"
                                              : std::string())});
#else
  c.push_back({"BLIS", "not built (install libblis-dev)"});
#endif
#ifdef HEADMIX_GEMM_XSMM
  c.push_back({"libxsmm", std::string(LIBXSMM_VERSION) + "; target " + libxsmm_get_target_arch() +
                              "; JIT tiles 64x64, k slices of " +
                              std::to_string(headmix::detail::gemm_k_slice())});
#else
  c.push_back({"libxsmm", "not built (install libxsmm-dev)"});
#endif
  return c;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    o += ch;
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a.rfind("--json=", 0) == 0)
      json = a.substr(7);
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--json=path]\n", argv[0]);
      return 2;
    }
  }
#ifdef HEADMIX_GEMM_OPENBLAS
  if (!openblas().error.empty()) {
    std::fprintf(stderr, "%s\n", openblas().error.c_str());
    return 2;
  }
  openblas_set_num_threads(1);
  openblas().set_threads(1);  // the same function, unless the handle is another OpenBLAS
#endif
#ifdef HEADMIX_GEMM_BLIS
  bli_thread_set_num_threads(1);
#endif
#ifdef HEADMIX_GEMM_XSMM
  libxsmm_init();
#endif
  const auto config = configuration();
  std::printf("headmix GEMM candidates (float, single-threaded, thread CPU clock)\n");
  for (const auto& [k, v] : config) std::printf("  %-18s %s\n", k.c_str(), v.c_str());
  double peak512 = 0, peak256 = 0;
#if defined(__AVX512F__)
  peak512 = fma_peak_gflops<Vec16>();
#endif
#if defined(__AVX2__) && defined(__FMA__)
  peak256 = fma_peak_gflops<Vec8>();
#endif
  std::printf("  %-18s AVX-512 %.1f GFLOP/s, AVX2 %.1f GFLOP/s (register FMA loop; 0 = not compiled for it)\n",
              "FMA peak", peak512, peak256);

  const std::vector<Candidate> cands = candidates();
  bool ok = true;
  std::vector<std::tuple<std::string, std::string, double>> checks;
  std::printf("\ncorrectness vs naive double (max |diff| / max |ref|, limit 1e-3):\n");
  for (const Shape& s : {attention_shape(Kind::scores, 16, 256), attention_shape(Kind::readout, 16, 256),
                         proj_shape(64, 768)}) {
    std::printf("  %-32s", s.label().c_str());
    for (const Candidate& c : cands) {
      if (!runs_on(c, s)) continue;
      const auto [err, scale] = check(c, s);
      const double rel = err / std::max(scale, 1e-30);
      ok = ok && rel <= 1e-3;
      checks.emplace_back(s.label(), c.name, rel);
      std::printf("  %s %.1e%s", c.name.c_str(), rel, rel <= 1e-3 ? "" : " FAIL");
    }
    std::printf("\n");
  }

  std::vector<Shape> shapes;
  const std::vector<Index> rows = quick ? std::vector<Index>{64} : std::vector<Index>{16, 64};
  const std::vector<Index> keys = quick ? std::vector<Index>{256, 1024} : std::vector<Index>{256, 1024, 4096};
  for (Kind k : {Kind::scores, Kind::readout})
    for (Index r : rows)
      for (Index n : keys) shapes.push_back(attention_shape(k, r, n));
  for (Index D : quick ? std::vector<Index>{768} : std::vector<Index>{768, 1024})
    for (Index T : quick ? std::vector<Index>{256, 1024} : std::vector<Index>{256, 1024, 4096})
      shapes.push_back(proj_shape(T, D));
  Settings set;
  if (quick) {
    set.min_rounds = 5;
    set.budget_per_candidate = 0.1;
  }

  std::printf("\nGFLOP/s: median [q1 - q3] over repetitions (n reps); one call = the sweep in the label\n");
  std::vector<Result> all;
  const auto t0 = std::chrono::steady_clock::now();
  for (const Shape& s : shapes) {
    const std::vector<Result> rs = measure(s, cands, set);
    std::printf("%-32s", s.label().c_str());
    const Result* best = &rs.front();
    for (const Result& r : rs) {
      std::printf("  %s %.1f [%.1f-%.1f] (%d)", r.name.c_str(), r.gflops.median, r.gflops.q1, r.gflops.q3, r.reps);
      if (r.gflops.median > best->gflops.median) best = &r;
    }
    std::printf("  -> %s\n", best->name.c_str());
    std::fflush(stdout);
    all.insert(all.end(), rs.begin(), rs.end());
  }
  std::printf("measured in %.1f s wall\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\n  \"config\": {";
    for (std::size_t i = 0; i < config.size(); ++i)
      f << (i ? ", " : "") << "\"" << json_escape(config[i].first) << "\": \"" << json_escape(config[i].second) << "\"";
    f << "},\n  \"fma_peak_gflops\": {\"avx512\": " << peak512 << ", \"avx2\": " << peak256 << "}";
    f << ",\n  \"quick\": " << (quick ? "true" : "false") << ",\n  \"checks\": [";
    for (std::size_t i = 0; i < checks.size(); ++i)
      f << (i ? ",\n    " : "\n    ") << "{\"shape\": \"" << std::get<0>(checks[i]) << "\", \"candidate\": \""
        << std::get<1>(checks[i]) << "\", \"rel_err\": " << std::get<2>(checks[i]) << "}";
    f << "],\n  \"results\": [";
    for (std::size_t i = 0; i < all.size(); ++i) {
      const Result& r = all[i];
      f << (i ? ",\n    " : "\n    ") << "{\"kind\": \"" << kind_name(r.shape.kind) << "\", \"rows\": " << r.shape.rows
        << ", \"keys\": " << r.shape.keys << ", \"heads\": " << r.shape.heads << ", \"T\": " << r.shape.T
        << ", \"D\": " << r.shape.D << ", \"candidate\": \"" << r.name << "\", \"gflops_median\": " << r.gflops.median
        << ", \"gflops_q1\": " << r.gflops.q1 << ", \"gflops_q3\": " << r.gflops.q3 << ", \"reps\": " << r.reps
        << ", \"calls_per_rep\": " << r.calls_per_rep << "}";
    }
    f << "\n  ]\n}\n";
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", json.c_str());
      return 2;
    }
    std::printf("wrote %s\n", json.c_str());
  }
  if (!ok) {
    std::fprintf(stderr, "a candidate differs from the naive double product by more than 1e-3 (relative)\n");
    return 1;
  }
  return 0;
}
