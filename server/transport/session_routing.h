// Which hosted transport holds a session: TransportService's calls that name a session (PushKv,
// WatchSession, SetAttentionPlan, CloseSession, ...) go to the transport that knows it.
//
//   absl::StatusOr<AttentionPlanInfo> plan = ForSession<AttentionPlanInfo>(
//       transports, &TransportCapabilities::attention_plans, kNoAttention, id,
//       [&](Transport* t) { return t->SetAttentionPlan(tenant, id, model, ids, n); });
//
// Thread-safe (as the transports).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/transport/transport.h"

namespace kvpool::server {

inline const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

// Runs `op` on each hosted transport whose capability `has` is set, in order, until one knows
// the session (answers other than NotFound) and returns that answer. Unavailable (`none`) when no
// hosted transport has the capability (a null `has`: every transport qualifies); NotFound when
// none knows the session.
template <typename Result>
Result ForSession(const std::vector<Transport*>& transports, bool TransportCapabilities::*has,
                  absl::string_view none, uint64_t session_id,
                  const std::function<Result(Transport*)>& op) {
  bool any = false;
  for (Transport* t : transports) {
    if (has != nullptr && !(t->capabilities().*has)) continue;
    any = true;
    Result r = op(t);
    if (!absl::IsNotFound(StatusOf(r))) return r;
  }
  if (!any) return absl::UnavailableError(std::string(none));
  return absl::NotFoundError(absl::StrCat("no transport session ", session_id));
}

}  // namespace kvpool::server
