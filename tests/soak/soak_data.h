// The soak's data: K/V rows that are a pure function of (layer, position, token id), prompts that
// share prefixes, and the checks of what kvpoold returns against them.
//
// Because a token's rows depend only on where it sits and which token it is, every client that
// pushes the same prompt sends the same bytes, so prefix units published by one client and
// attached by another read back exactly what the second client would have sent.
//
//   SoakShape shape{2, 4, 2, 64};
//   LayerRows rows = ExpectedRows(shape, /*layer=*/0, /*start=*/0, token_ids);  // all tokens
//   KVPOOL_RETURN_IF_ERROR(CompareAttention(got_out, got_lse, reference, 1e-4, "seq-1"));
//
// Thread-safe: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/attention.h"
#include "kernels/bf16.h"

namespace kvpool::soak {

struct SoakShape {
  int num_layers = 2;
  int q_heads = 4;
  int kv_heads = 2;
  int head_dim = 64;

  // Values of one token's K (or V) row over every KV head.
  size_t row_values() const { return static_cast<size_t>(kv_heads) * head_dim; }
  size_t query_values() const { return static_cast<size_t>(q_heads) * head_dim; }
  AttentionShape attention() const { return {q_heads, kv_heads, head_dim}; }
};

// K and V of one layer for consecutive positions: BF16 [tokens][kv_heads][head_dim] each.
struct LayerRows {
  std::vector<Bf16> k, v;
  absl::string_view k_bytes() const {
    return {reinterpret_cast<const char*>(k.data()), k.size() * sizeof(Bf16)};
  }
  absl::string_view v_bytes() const {
    return {reinterpret_cast<const char*>(v.data()), v.size() * sizeof(Bf16)};
  }
};

// The rows of positions [start, start + token_ids.size()) of `layer`, token i having id
// token_ids[i]. Keys carry one outlier channel, as post-RoPE keys do; every value is finite.
LayerRows ExpectedRows(const SoakShape& shape, int layer, uint32_t start,
                       absl::Span<const uint32_t> token_ids);

// Token ids of shared prompt `index` (a system prompt several sequences start with).
std::vector<uint32_t> SharedPrompt(int index, int tokens);

// `n` query values ~ N(0, 0.5), deterministic for `seed`.
std::vector<float> QueryValues(size_t n, uint64_t seed);

// Dense float64 attention of each of `num_queries` queries ([num_queries][Hq][D]) over
// float K/V rows ([tokens][Hkv][D]): out [num_queries][Hq][D], lse [num_queries][Hq].
AttentionOutput ReferenceAttention(const SoakShape& shape, absl::Span<const float> q,
                                   int num_queries, absl::Span<const float> k,
                                   absl::Span<const float> v, int tokens);

// OK when `out` and `lse` agree with `ref`: every output within tol x max(1, largest |ref out|),
// every lse within tol x max(1, |ref lse|), all finite. Otherwise Internal naming `what`, the
// first differing index and both values.
absl::Status CompareAttention(absl::Span<const float> out, absl::Span<const float> lse,
                              const AttentionOutput& ref, double tol, absl::string_view what);

// OK when `got` equals `want` byte for byte; otherwise Internal naming `what` and the first
// differing 16-bit word.
absl::Status CompareBytes(absl::string_view got, absl::string_view want, absl::string_view what);

std::vector<float> ToFloats(absl::Span<const Bf16> v);
std::vector<float> FloatsFromBytes(absl::string_view bytes);

}  // namespace kvpool::soak
