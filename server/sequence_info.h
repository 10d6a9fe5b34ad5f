// SequenceInfo: what the store tells about one sequence (its state, tier lengths and pool bytes);
// answered by SequenceStore (Create, Describe, List, Seal) and in every AppendResult.
//
//   KVPOOL_ASSIGN_OR_RETURN(SequenceInfo info, store.Describe(tenant, "seq-1"));
//   if (info.state == SequenceState::kSealed) ...
#pragma once

#include <cstddef>
#include <string>

#include "absl/time/time.h"
#include "server/tenant.h"

namespace kvpool::server {

enum class SequenceState { kPrefill, kDecode, kSealed };

// Public description of a sequence.
struct SequenceInfo {
  std::string id;
  std::string model_id;
  TenantId tenant;
  SequenceState state = SequenceState::kPrefill;
  int sink = 0;
  int history = 0;
  int recent = 0;
  int reused_tokens = 0;
  bool has_token_ids = true;
  size_t pool_bytes = 0;
  size_t shared_bytes = 0;
  size_t bf16_equivalent_bytes = 0;
  // Lease (zero: none) and time since the last append, read or attention.
  absl::Duration ttl = absl::ZeroDuration();
  absl::Duration idle = absl::ZeroDuration();
  int total() const { return sink + history + recent; }
};

}  // namespace kvpool::server
