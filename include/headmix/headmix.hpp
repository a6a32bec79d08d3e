// headmix: multi-head attention variants on Eigen. The one header to
// include for the layers; files (headmix/io.hpp, CMake target headmix::io)
// and decompositions (headmix/decomp.hpp) are opt-in.
#pragma once

#include "headmix/core/attention_tensor.hpp"
#include "headmix/core/dot_product.hpp"
#include "headmix/core/error.hpp"
#include "headmix/core/flops.hpp"
#include "headmix/core/head_mix.hpp"
#include "headmix/core/input.hpp"
#include "headmix/core/layer_forms.hpp"
#include "headmix/core/linear.hpp"
#include "headmix/core/mask.hpp"
#include "headmix/core/options.hpp"
#include "headmix/core/parallel.hpp"
#include "headmix/core/pipeline.hpp"
#include "headmix/core/sequence_cache.hpp"
#include "headmix/core/softmax.hpp"
#include "headmix/core/types.hpp"
#include "headmix/core/workspace.hpp"
#include "headmix/variants/collab_head.hpp"
#include "headmix/variants/dcmha.hpp"
#include "headmix/variants/lsh.hpp"
#include "headmix/variants/mha.hpp"
#include "headmix/variants/talking_heads.hpp"
