// Requests of the fuzz model (fuzz_daemon.h: model "m" and its sequences), built the same way
// by FuzzDaemon for its base state and by the seed generator (make_seeds.cc) for the corpora.
//
//   v1::RegisterModelRequest spec = ModelSpecRequest(kModelId);
//   std::vector<v1::AppendKvRequest> push = AppendRequests(kSequenceId, 0, 40, /*token_ids=*/true);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvpool/v1/attention_service.pb.h"
#include "kvpool/v1/model_service.pb.h"
#include "kvpool/v1/sequence_service.pb.h"

namespace kvpool::fuzz {

// RegisterModel's first message for the fuzz model's shape and quant config under `model_id`
// (a data-free rotation of `kind`).
::kvpool::v1::RegisterModelRequest ModelSpecRequest(
    const std::string& model_id,
    ::kvpool::v1::RotationKind kind = ::kvpool::v1::ROTATION_KIND_HADAMARD);

// BF16 K or V bytes of `tokens` rows of the fuzz model, deterministic for a seed.
std::string KvBytes(int tokens, uint64_t seed);

// An AppendKv stream: the header (BF16, token ids token_start.. when `token_ids`) and one chunk
// per layer holding all `tokens` tokens.
std::vector<::kvpool::v1::AppendKvRequest> AppendRequests(const std::string& sequence_id,
                                                          uint32_t token_start, uint32_t tokens,
                                                          bool token_ids, bool end_of_prefill);

// One decode step of `tokens` tokens for every layer (BF16).
::kvpool::v1::AppendDecodeRequest DecodeRequest(const std::string& sequence_id,
                                                uint32_t token_start, uint32_t tokens);

// Attention over `sequence_ids` at `layer` with `num_queries` FP32 query rows each.
::kvpool::v1::AttendRequest AttendRequest(const std::vector<std::string>& sequence_ids, int layer,
                                          uint32_t num_queries);

}  // namespace kvpool::fuzz
