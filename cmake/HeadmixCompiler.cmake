# Before project(): a compiler a preset names (the test preset's clang++),
# or clang's sanitizer runtimes, missing would otherwise stop CMake with a
# failed test program; say which Debian package to install instead.
if(DEFINED CMAKE_CXX_COMPILER AND NOT IS_ABSOLUTE "${CMAKE_CXX_COMPILER}")
  find_program(headmix_cxx "${CMAKE_CXX_COMPILER}")
  if(NOT headmix_cxx)
    set(headmix_package "${CMAKE_CXX_COMPILER}")
    if(CMAKE_CXX_COMPILER MATCHES "^clang")
      set(headmix_package clang)
    elseif(CMAKE_CXX_COMPILER MATCHES "^g\\+\\+")
      set(headmix_package g++)
    endif()
    message(FATAL_ERROR "headmix: the C++ compiler '${CMAKE_CXX_COMPILER}' is not installed: "
                        "install it with 'apt-get install ${headmix_package}' (or 'sh scripts/install-deps.sh test')")
  endif()
  if(CMAKE_CXX_COMPILER MATCHES "^clang" AND "${CMAKE_EXE_LINKER_FLAGS}" MATCHES "-fsanitize=[^ ]*address")
    execute_process(COMMAND "${headmix_cxx}" -print-runtime-dir
                    OUTPUT_VARIABLE headmix_clang_runtimes OUTPUT_STRIP_TRAILING_WHITESPACE)
    file(GLOB headmix_asan_runtime "${headmix_clang_runtimes}/libclang_rt.asan*")
    if(NOT headmix_asan_runtime)
      execute_process(COMMAND "${headmix_cxx}" -dumpversion OUTPUT_VARIABLE headmix_clang_version)
      string(REGEX MATCH "^[0-9]+" headmix_clang_major "${headmix_clang_version}")
      message(FATAL_ERROR "headmix: clang's sanitizer runtimes are not installed: install them with "
                          "'apt-get install libclang-rt-${headmix_clang_major}-dev' (or 'sh scripts/install-deps.sh test')")
    endif()
  endif()
endif()
