#include "server/ingest/append_checks.h"

#include <climits>

#include "absl/strings/str_cat.h"
#include "proto/dtype.h"

namespace kvpool::server {

absl::Status ValidateAppendHeader(const ::kvpool::v1::AppendKvHeader& h, int max_append_tokens) {
  if (h.sequence_id().empty()) return absl::InvalidArgumentError("sequence_id is empty");
  if (max_append_tokens < 1 || h.num_tokens() < 1 ||
      h.num_tokens() > static_cast<uint32_t>(max_append_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens must be in [1, ", max_append_tokens, "], got ", h.num_tokens()));
  }
  if (DTypeSize(h.dtype()) == 0) {
    return absl::InvalidArgumentError("dtype must be DTYPE_BF16, DTYPE_FP16 or DTYPE_FP32");
  }
  const uint32_t max_start = static_cast<uint32_t>(INT32_MAX - max_append_tokens);
  if (h.token_start() > max_start) {
    return absl::InvalidArgumentError(
        absl::StrCat("token_start must be at most ", max_start, ", got ", h.token_start()));
  }
  return absl::OkStatus();
}

AppendSpec AppendSpecOf(const ::kvpool::v1::AppendKvHeader& h) {
  AppendSpec spec;
  spec.token_start = static_cast<int>(h.token_start());
  spec.num_tokens = static_cast<int>(h.num_tokens());
  spec.kind = h.end_of_prefill() ? AppendKind::kFinalPrefill : AppendKind::kPrefill;
  spec.token_ids.assign(h.token_ids().begin(), h.token_ids().end());
  return spec;
}

absl::Status CheckChunkPlace(int32_t layer, uint32_t token_offset, uint32_t num_tokens,
                             int num_layers, int append_tokens) {
  if (layer < 0 || layer >= num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", num_layers, ")"));
  }
  if (append_tokens < 1 || num_tokens < 1 || token_offset >= static_cast<uint32_t>(append_tokens) ||
      num_tokens > static_cast<uint32_t>(append_tokens) - token_offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk tokens [", token_offset, ", ", uint64_t{token_offset} + num_tokens,
                     ") do not fit the append's ", append_tokens, " tokens"));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> ChunkBytes(uint32_t num_tokens, size_t row_bytes) {
  size_t bytes = 0;
  if (__builtin_mul_overflow(size_t{num_tokens}, row_bytes, &bytes)) {
    return absl::InvalidArgumentError("chunk size overflows");
  }
  return bytes;
}

}  // namespace kvpool::server
