// The five layers in both scalars, compiled once for all the test programs.
//
// Every test program instantiates the same layers, and under the sanitizers
// that repeated work is most of CI's build time. With the CMake option
// HEADMIX_TEST_PRECOMPILED_LAYERS, tests/precompiled_layers.cpp defines
// these instances in a library built with the tests' own flags, and every
// test program declares them `extern` here instead of compiling its own.
// The code that runs is the same; only where it is compiled changes. The
// promise builds (Release -march=native) leave the option off and compile
// the headers as users do.
#pragma once

#include "headmix/headmix.hpp"

// `prefix` is `extern` for a declaration, empty for the definition.
#define HEADMIX_TEST_LAYER_INSTANCES(prefix, Layer) \
  prefix template class headmix::Layer<float>;      \
  prefix template class headmix::Layer<double>;
// The allocating forms. Not for Lsh, which has no step() to wrap.
#define HEADMIX_TEST_FORMS_INSTANCES(prefix, Layer)                        \
  prefix template class headmix::LayerForms<headmix::Layer<float>, float>; \
  prefix template class headmix::LayerForms<headmix::Layer<double>, double>;

#ifdef HEADMIX_TEST_PRECOMPILED_LAYERS
HEADMIX_TEST_LAYER_INSTANCES(extern, Mha)
HEADMIX_TEST_LAYER_INSTANCES(extern, TalkingHeads)
HEADMIX_TEST_LAYER_INSTANCES(extern, CollabHead)
HEADMIX_TEST_LAYER_INSTANCES(extern, Dcmha)
HEADMIX_TEST_LAYER_INSTANCES(extern, Lsh)
HEADMIX_TEST_FORMS_INSTANCES(extern, Mha)
HEADMIX_TEST_FORMS_INSTANCES(extern, TalkingHeads)
HEADMIX_TEST_FORMS_INSTANCES(extern, CollabHead)
HEADMIX_TEST_FORMS_INSTANCES(extern, Dcmha)
#endif
