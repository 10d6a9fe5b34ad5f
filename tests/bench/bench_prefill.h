// Prefill of one layer's K/V through AppendKv for the daemon benchmarks: a whole sequence of
// `tokens` tokens in one stream (layer 0, end_of_prefill set), BF16 rows of `row_values` each.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/kvpool_client.h"
#include "kernels/bf16.h"

namespace kvpool::bench {

absl::Status PrefillLayer0(const client::KvpoolClient& c, const std::string& id,
                           const std::vector<Bf16>& k, const std::vector<Bf16>& v, int tokens,
                           size_t row_values);

}  // namespace kvpool::bench
