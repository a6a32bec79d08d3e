// headmix's file formats, opt-in: the safetensors reader and writer. They
// parse the file header with nlohmann/json, which the CMake target
// headmix::io carries; headmix/headmix.hpp does not need it.
#pragma once

#include "headmix/io/io_error.hpp"
#include "headmix/io/safetensors.hpp"
