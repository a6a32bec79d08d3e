// The suite's main: records which GEMM backend and SIMD set ran, then runs
// every registered benchmark.
#include <Eigen/Core>
#include <benchmark/benchmark.h>

int main(int argc, char** argv) {
#ifdef EIGEN_USE_BLAS
  benchmark::AddCustomContext("gemm_backend", "external BLAS through EIGEN_USE_BLAS");
#else
  benchmark::AddCustomContext("gemm_backend", "Eigen's built-in GEMM (no BLAS)");
#endif
  benchmark::AddCustomContext("eigen_simd", Eigen::SimdInstructionSetsInUse());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
