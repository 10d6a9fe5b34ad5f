// The end-of-run check of a soak: once every client has released what it holds, the daemon's
// accounting must be back to where it was before the run, exactly.
//
//   KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse baseline, client.GetStats(true));
//   ... register the shared models, run the clients ...
//   KVPOOL_RETURN_IF_ERROR(CheckFinalAccounting(client, baseline, shared_models, "soak1",
//                                               report.counters, absl::Seconds(120), &log));
//
// "Exactly" (server/block_pool.h, server/prefix_index.h, stats_service.proto): with no sequence
// left, every pool byte the run still holds belongs to prefix units cached for the run's shared
// models (cached, never shared); deleting those models drops them, and then pool bytes, pages
// per class, slabs, cached and shared bytes and prefix units equal the baseline. The worker queue
// is empty, no data-plane session, push or staging buffer is left, and the daemon's counters lie
// within what the clients know they did (ExpectedCounters).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/kvpool_client.h"
#include "tests/soak/soak_client.h"
#include "tests/soak/soak_report.h"

namespace kvpool::soak {

// Waits up to `settle` for the run's sequences to disappear (an append cut by its deadline may
// still be rolling back), then checks the accounting as described above, deleting the shared
// models on the way. Appends what it compared to *log. Internal with every mismatch otherwise.
// Assumes no other client changes the daemon meanwhile.
absl::Status CheckFinalAccounting(const client::KvpoolClient& client,
                                  const v1::GetStatsResponse& baseline,
                                  const std::vector<SoakModel>& shared_models,
                                  absl::string_view id_prefix, const ExpectedCounters& expected,
                                  absl::Duration settle, std::string* log);

}  // namespace kvpool::soak
