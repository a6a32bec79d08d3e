// headmix's decompositions, opt-in: CP-ALS and the re-parameterisation of
// a trained MHA as a CollabHead (and grouped-query K/V expanded per head).
#pragma once

#include "headmix/decomp/cp_als.hpp"
#include "headmix/decomp/mha_to_collab.hpp"
