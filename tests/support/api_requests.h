// API request messages that tests, the soak and the fuzzers build over and over: the header and
// chunk messages of an AppendKv stream and the spec of a data-free model.
//
//   std::vector<v1::AppendKvRequest> m = {AppendHeaderMessage("s", 0, 16, v1::DTYPE_BF16, true)};
//   m.push_back(AppendChunkMessage(/*layer=*/0, /*token_offset=*/0, 16, k, v));
#pragma once

#include <cstdint>
#include <string>

#include "kvpool/v1/model_service.pb.h"
#include "kvpool/v1/sequence_service.pb.h"

namespace kvpool::testing {

v1::AppendKvRequest AppendHeaderMessage(const std::string& sequence_id, uint32_t token_start,
                                        uint32_t num_tokens, v1::DType dtype = v1::DTYPE_BF16,
                                        bool end_of_prefill = false);

v1::AppendKvRequest AppendChunkMessage(int layer, uint32_t token_offset, uint32_t num_tokens,
                                       std::string k, std::string v);

// A model whose rotation is generated (`kind`, `seed`); quant is left to the caller. `Shape` is
// any of the tests' shape structs (num_layers, q_heads, kv_heads, head_dim).
template <typename Shape>
v1::ModelSpec DataFreeModelSpec(const std::string& model_id, const Shape& shape,
                                v1::RotationKind kind, uint64_t seed) {
  v1::ModelSpec spec;
  spec.set_model_id(model_id);
  v1::ModelShape* s = spec.mutable_shape();
  s->set_num_layers(shape.num_layers);
  s->set_q_heads(shape.q_heads);
  s->set_kv_heads(shape.kv_heads);
  s->set_head_dim(shape.head_dim);
  spec.mutable_data_free()->set_kind(kind);
  spec.mutable_data_free()->set_seed(seed);
  return spec;
}

}  // namespace kvpool::testing
