// The suite's main: records which GEMM backend and SIMD set ran, runs every
// registered benchmark, and closes with a table of each variant's time
// relative to MHA at the same shape, measured in this same run.
//
// Matching rule: a run named `<family>/<args>` is compared with
// `Suite_MHA/<args>` when the argument strings are identical (the
// shared-shape entries all use the names D, H, T, causal, threads).
#include <Eigen/Core>
#include <benchmark/benchmark.h>

#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace {

constexpr const char* kBaseline = "Suite_MHA";

class RelativeToMhaReporter : public benchmark::ConsoleReporter {
 public:
  using benchmark::ConsoleReporter::ConsoleReporter;

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.error_occurred || r.run_type != Run::RT_Iteration) continue;
      const std::string name = r.benchmark_name();
      const auto slash = name.find('/');
      if (slash == std::string::npos) continue;
      const double seconds = r.GetAdjustedRealTime();
      results_.push_back({name.substr(0, slash), name.substr(slash + 1), seconds});
    }
    ConsoleReporter::ReportRuns(runs);
  }

  void Finalize() override {
    std::map<std::string, double> mha;
    for (const auto& r : results_)
      if (r.family == kBaseline) mha[r.args] = r.time;
    bool header = false;
    for (const auto& r : results_) {
      if (r.family == kBaseline) continue;
      auto it = mha.find(r.args);
      if (it == mha.end()) continue;
      if (!header) {
        std::printf("\nTime relative to MHA at the same shape (same run):\n");
        header = true;
      }
      std::printf("  %-28s %-45s %6.2fx\n", r.family.c_str(), r.args.c_str(), r.time / it->second);
    }
    ConsoleReporter::Finalize();
  }

 private:
  struct Result {
    std::string family, args;
    double time;
  };
  std::vector<Result> results_;
};

}  // namespace

int main(int argc, char** argv) {
#ifdef EIGEN_USE_BLAS
  benchmark::AddCustomContext("gemm_backend", "BLAS through EIGEN_USE_BLAS (" HEADMIX_BLAS_NAME ")");
#else
  benchmark::AddCustomContext("gemm_backend", "Eigen's built-in GEMM (no BLAS)");
#endif
  benchmark::AddCustomContext("eigen_simd", Eigen::SimdInstructionSetsInUse());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RelativeToMhaReporter reporter(isatty(1) ? benchmark::ConsoleReporter::OO_ColorTabular
                                            : benchmark::ConsoleReporter::OO_Tabular);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
