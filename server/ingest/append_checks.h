// The checks every ingest applies, whatever carries it: the append's header (AppendKv's first
// message; the device push header embeds it; UCX's PUSH_BEGIN is decoded into it) and a chunk's
// place in its append. Pure functions, no gRPC, so the fuzz targets run them everywhere.
//
//   KVPOOL_RETURN_IF_ERROR(ValidateAppendHeader(header, config.max_append_tokens));
//   AppendSpec spec = AppendSpecOf(header);
//   KVPOOL_RETURN_IF_ERROR(CheckChunkPlace(c.layer(), c.token_offset(), c.num_tokens(),
//                                          model.num_layers, spec.num_tokens));
//
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/v1/sequence_service.pb.h"
#include "server/sequence_store.h"

namespace kvpool::server {

// InvalidArgument for an empty sequence id, num_tokens outside [1, max_append_tokens], a dtype
// that names no payload type, or a token_start beyond INT32_MAX - max_append_tokens (an append
// there could never end inside the int32 token positions). The store checks the rest
// (the sequence, its state and length, the token ids).
[[nodiscard]] absl::Status ValidateAppendHeader(const ::kvpool::v1::AppendKvHeader& header,
                                                int max_append_tokens);

// The store's description of a validated header's append.
AppendSpec AppendSpecOf(const ::kvpool::v1::AppendKvHeader& header);

// InvalidArgument unless `layer` is in [0, num_layers) and [token_offset, token_offset +
// num_tokens) is a non-empty range inside the append's `append_tokens` tokens.
[[nodiscard]] absl::Status CheckChunkPlace(int32_t layer, uint32_t token_offset,
                                           uint32_t num_tokens, int num_layers, int append_tokens);

// Bytes of `num_tokens` rows of `row_bytes` each; InvalidArgument when that overflows.
[[nodiscard]] absl::StatusOr<size_t> ChunkBytes(uint32_t num_tokens, size_t row_bytes);

}  // namespace kvpool::server
