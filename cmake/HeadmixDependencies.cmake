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
  # The safetensors reader parses its JSON header with nlohmann/json.
  find_package(nlohmann_json 3.9 QUIET)
  if(NOT nlohmann_json_FOUND)
    message(FATAL_ERROR "headmix needs nlohmann/json >= 3.9: install it with 'apt-get install nlohmann-json3-dev'")
  endif()
  set(THREADS_PREFER_PTHREAD_FLAG ON)
  find_package(Threads REQUIRED)
endmacro()
