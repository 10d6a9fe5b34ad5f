#include "tests/fuzz/fuzz_requests.h"

#include <cstring>

#include "server/server_test_util.h"
#include "tests/fuzz/fuzz_daemon.h"

namespace kvpool::fuzz {

namespace v1 = ::kvpool::v1;

namespace {

constexpr size_t kRowValues = size_t{kKvHeads} * kHeadDim;

}  // namespace

v1::RegisterModelRequest ModelSpecRequest(const std::string& model_id, v1::RotationKind kind) {
  v1::RegisterModelRequest req;
  v1::ModelSpec* spec = req.mutable_spec();
  spec->set_model_id(model_id);
  spec->mutable_shape()->set_num_layers(kLayers);
  spec->mutable_shape()->set_q_heads(kQHeads);
  spec->mutable_shape()->set_kv_heads(kKvHeads);
  spec->mutable_shape()->set_head_dim(kHeadDim);
  spec->mutable_data_free()->set_kind(kind);
  if (kind == v1::ROTATION_KIND_RANDOMIZED_HADAMARD) spec->mutable_data_free()->set_seed(7);
  v1::QuantConfig* q = spec->mutable_quant();
  q->set_method(v1::QUANT_METHOD_UNIFORM);
  q->set_block_tokens(kBlockTokens);
  q->set_sink_tokens(kSinkTokens);
  q->set_recent_tokens(kRecentTokens);
  q->set_demotion_batch(kBlockTokens);
  return req;
}

std::string KvBytes(int tokens, uint64_t seed) {
  const std::vector<Bf16> rows = server::testing::TestRows(tokens, kRowValues, seed);
  return std::string(reinterpret_cast<const char*>(rows.data()), rows.size() * sizeof(Bf16));
}

std::vector<v1::AppendKvRequest> AppendRequests(const std::string& sequence_id,
                                                uint32_t token_start, uint32_t tokens,
                                                bool token_ids, bool end_of_prefill) {
  std::vector<v1::AppendKvRequest> out(1);
  v1::AppendKvHeader* h = out[0].mutable_header();
  h->set_sequence_id(sequence_id);
  h->set_token_start(token_start);
  h->set_num_tokens(tokens);
  h->set_dtype(v1::DTYPE_BF16);
  h->set_end_of_prefill(end_of_prefill);
  if (token_ids) {
    for (uint32_t t = 0; t < tokens; ++t) h->add_token_ids(token_start + t);
  }
  for (int layer = 0; layer < kLayers; ++layer) {
    v1::KvChunk* c = out.emplace_back().mutable_chunk();
    c->set_layer(layer);
    c->set_token_offset(0);
    c->set_num_tokens(tokens);
    c->set_k(KvBytes(static_cast<int>(tokens), 2 * layer + 1));
    c->set_v(KvBytes(static_cast<int>(tokens), 2 * layer + 2));
  }
  return out;
}

v1::AppendDecodeRequest DecodeRequest(const std::string& sequence_id, uint32_t token_start,
                                      uint32_t tokens) {
  v1::AppendDecodeRequest req;
  req.set_sequence_id(sequence_id);
  req.set_token_start(token_start);
  req.set_num_tokens(tokens);
  req.set_dtype(v1::DTYPE_BF16);
  for (int layer = 0; layer < kLayers; ++layer) {
    req.mutable_k()->append(KvBytes(static_cast<int>(tokens), 100 + layer));
    req.mutable_v()->append(KvBytes(static_cast<int>(tokens), 200 + layer));
  }
  return req;
}

v1::AttendRequest AttendRequest(const std::vector<std::string>& sequence_ids, int layer,
                                uint32_t num_queries) {
  v1::AttendRequest req;
  req.set_model_id(kModelId);
  req.set_layer(layer);
  req.set_dtype(v1::DTYPE_FP32);
  for (const std::string& id : sequence_ids) {
    v1::SequenceQuery* q = req.add_queries();
    q->set_sequence_id(id);
    q->set_num_queries(num_queries);
    std::string values(size_t{num_queries} * kQHeads * kHeadDim * sizeof(float), '\0');
    for (size_t i = 0; i < values.size() / sizeof(float); ++i) {
      const float v = static_cast<float>((i * 37) % 17) / 8.0f - 1.0f;
      std::memcpy(values.data() + i * sizeof(float), &v, sizeof(v));
    }
    q->set_q(std::move(values));
  }
  return req;
}

}  // namespace kvpool::fuzz
