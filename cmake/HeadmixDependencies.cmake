# Find headmix's dependencies, and stop with the Debian package to install
# when one is missing. Used by the build and by the installed package config.

macro(headmix_find_dependencies)
  # Unversioned find, then an explicit check: find_package(Eigen3 3.4) would
  # reject Eigen 5, whose version file only accepts its own major version.
  find_package(Eigen3 QUIET NO_MODULE)
  if(NOT Eigen3_FOUND)
    message(FATAL_ERROR "headmix needs Eigen >= 3.4: install it with 'apt-get install libeigen3-dev'")
  endif()
  if(Eigen3_VERSION VERSION_LESS 3.4)
    message(FATAL_ERROR "headmix needs Eigen >= 3.4, found ${Eigen3_VERSION} at ${Eigen3_DIR}")
  endif()
  # The safetensors reader (headmix::io) parses its JSON header with
  # nlohmann/json; without it, headmix::headmix alone is available.
  find_package(nlohmann_json 3.9 QUIET)
  if(NOT nlohmann_json_FOUND)
    message(STATUS "headmix: no nlohmann/json, so no headmix::io (safetensors files): "
                   "install it with 'apt-get install nlohmann-json3-dev'")
  endif()
  set(THREADS_PREFER_PTHREAD_FLAG ON)
  find_package(Threads REQUIRED)
endmacro()

# The GEMM backend (core/gemm.hpp): `auto` takes libxsmm when it is found and
# falls back to Eigen's kernels with a message; `libxsmm` requires it;
# `eigen` never looks. libxsmm's static library keeps BLAS entry points
# (sgemm_, dgemm_) for shapes it has no kernel for; headmix never calls
# them, but the link needs a BLAS that defines them. A real one (OpenBLAS),
# not libxsmmnoblas: its stubs would interpose the BLAS of any program that
# links one too. Sets HEADMIX_GEMM_RESOLVED to libxsmm or eigen and, for
# libxsmm, the imported targets PkgConfig::HEADMIX_XSMM and BLAS::BLAS.
macro(headmix_find_gemm backend)
  set(HEADMIX_GEMM_RESOLVED eigen)
  if(NOT "${backend}" STREQUAL "eigen")
    find_package(PkgConfig QUIET)
    if(PkgConfig_FOUND)
      pkg_check_modules(HEADMIX_XSMM QUIET IMPORTED_TARGET libxsmm)
    endif()
    if(NOT TARGET BLAS::BLAS)
      set(BLA_VENDOR OpenBLAS)
      find_package(BLAS QUIET)
      unset(BLA_VENDOR)
    endif()
    if(HEADMIX_XSMM_FOUND AND TARGET BLAS::BLAS)
      set(HEADMIX_GEMM_RESOLVED libxsmm)
    elseif("${backend}" STREQUAL "libxsmm")
      message(FATAL_ERROR "HEADMIX_GEMM=libxsmm needs libxsmm and OpenBLAS: "
                          "install them with 'apt-get install libxsmm-dev libopenblas-dev pkg-config'")
    else()
      message(STATUS "headmix: GEMMs run on Eigen's kernels; for libxsmm's (1.3-2x faster here), "
                     "install libxsmm-dev libopenblas-dev pkg-config")
    endif()
  endif()
endmacro()
