// headmix weights and inputs as the MHA-family references' structs
// (tests/reference/mha_reference.hpp), for the tests that call the naive
// references directly rather than through a cases/<variant>.hpp problem.
#pragma once

#include "test_util.hpp"
#include "reference/dcmha_reference.hpp"
#include "reference/mha_reference.hpp"

namespace headmix_test {

template <class T>
headmix_ref::RefLinear ref_linear(const headmix::Linear<T>& l) {
  return ref_linear_as<headmix_ref::RefLinear>(l);
}

// A [batch * length, width] matrix as the reference's batch.
template <class T>
headmix_ref::RefBatch ref_batch(const Matrix<T>& m, Index batch) {
  return ref_batch_as<headmix_ref::RefBatch>(m, batch);
}

// DCMHA's weights as the reference's, its sizes read from the weights
// (dk, dv and out from the projections, K from dw1).
template <class T>
headmix_ref::RefDcmhaWeights ref_dcmha_weights(const headmix::DcmhaWeights<T>& w, Index D, Index H, Index G, Index R) {
  headmix_ref::RefDcmhaWeights r;
  r.D = static_cast<int>(D), r.H = static_cast<int>(H), r.G = static_cast<int>(G), r.R = static_cast<int>(R);
  r.dk = static_cast<int>(w.q.weight.rows() / H), r.dv = static_cast<int>(w.v.weight.rows() / H);
  r.out = static_cast<int>(w.o.weight.rows()), r.K = static_cast<int>(w.dw1.dim(3));
  r.wq = widen(w.q.weight), r.bq = widen(w.q.bias.data(), w.q.bias.size());
  r.wk = widen(w.k.weight), r.bk = widen(w.k.bias.data(), w.k.bias.size());
  r.wv = widen(w.v.weight), r.bv = widen(w.v.bias.data(), w.v.bias.size());
  r.wo = widen(w.o.weight), r.bo = widen(w.o.bias.data(), w.o.bias.size());
  r.dw1 = widen(w.dw1.data(), w.dw1.size()), r.qkw = widen(w.qkw.data(), w.qkw.size());
  r.dd = widen(w.dd.data(), w.dd.size());
  r.pre_w = widen(w.pre_w.data(), w.pre_w.size()), r.post_w = widen(w.post_w.data(), w.post_w.size());
  return r;
}

}  // namespace headmix_test
