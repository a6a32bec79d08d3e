// One layer's instances (HEADMIX_TEST_LAYER, set by tests/CMakeLists.txt:
// one object per layer, so that the two cores share the work).
#include "precompiled_layers.hpp"

HEADMIX_TEST_LAYER_INSTANCES(, HEADMIX_TEST_LAYER)
#ifdef HEADMIX_TEST_LAYER_HAS_FORMS
HEADMIX_TEST_FORMS_INSTANCES(, HEADMIX_TEST_LAYER)
#endif
