#include "tests/support/api_requests.h"

#include <utility>

namespace kvpool::testing {

v1::AppendKvRequest AppendHeaderMessage(const std::string& sequence_id, uint32_t token_start,
                                        uint32_t num_tokens, v1::DType dtype, bool end_of_prefill) {
  v1::AppendKvRequest r;
  v1::AppendKvHeader* h = r.mutable_header();
  h->set_sequence_id(sequence_id);
  h->set_token_start(token_start);
  h->set_num_tokens(num_tokens);
  h->set_dtype(dtype);
  h->set_end_of_prefill(end_of_prefill);
  return r;
}

v1::AppendKvRequest AppendChunkMessage(int layer, uint32_t token_offset, uint32_t num_tokens,
                                       std::string k, std::string v) {
  v1::AppendKvRequest r;
  v1::KvChunk* c = r.mutable_chunk();
  c->set_layer(layer);
  c->set_token_offset(token_offset);
  c->set_num_tokens(num_tokens);
  c->set_k(std::move(k));
  c->set_v(std::move(v));
  return r;
}

}  // namespace kvpool::testing
