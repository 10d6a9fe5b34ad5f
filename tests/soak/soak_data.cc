#include "tests/soak/soak_data.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvpool::soak {
namespace {

// SplitMix64: a small, well-mixed generator; enough for test data.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Approximately N(0, 1) values (Irwin-Hall of four uniforms), four per 64-bit draw.
class Normals {
 public:
  explicit Normals(uint64_t seed) : state_(Mix(seed)) {}
  float Next() {
    const uint64_t r = Mix(state_++);
    float sum = 0.0f;
    for (int i = 0; i < 4; ++i) sum += static_cast<float>((r >> (16 * i)) & 0xffffu) / 65535.0f;
    return (sum - 2.0f) * 1.7320508f;
  }

 private:
  uint64_t state_;
};

}  // namespace

LayerRows ExpectedRows(const SoakShape& shape, int layer, uint32_t start,
                       absl::Span<const uint32_t> token_ids) {
  const size_t row = shape.row_values();
  LayerRows rows;
  rows.k.resize(token_ids.size() * row);
  rows.v.resize(token_ids.size() * row);
  for (size_t t = 0; t < token_ids.size(); ++t) {
    const uint64_t position = start + t;
    Normals gen(Mix(token_ids[t]) ^ (position << 24) ^ (static_cast<uint64_t>(layer) << 56));
    const float offset = 0.5f * gen.Next();
    for (size_t i = 0; i < row; ++i) {
      const float outlier = (i % shape.head_dim) == 5 ? 8.0f : 0.0f;
      rows.k[t * row + i] = Bf16::FromFloat(gen.Next() + outlier + offset);
      rows.v[t * row + i] = Bf16::FromFloat(gen.Next());
    }
  }
  return rows;
}

std::vector<uint32_t> SharedPrompt(int index, int tokens) {
  std::vector<uint32_t> ids(tokens);
  for (int i = 0; i < tokens; ++i) {
    ids[i] = static_cast<uint32_t>(Mix((static_cast<uint64_t>(index) << 32) | i) % 32000);
  }
  return ids;
}

std::vector<float> QueryValues(size_t n, uint64_t seed) {
  Normals gen(seed);
  std::vector<float> q(n);
  for (float& x : q) x = 0.5f * gen.Next();
  return q;
}

AttentionOutput ReferenceAttention(const SoakShape& shape, absl::Span<const float> q,
                                   int num_queries, absl::Span<const float> k,
                                   absl::Span<const float> v, int tokens) {
  const size_t per_query = shape.query_values();
  AttentionOutput all;
  for (int j = 0; j < num_queries; ++j) {
    const AttentionOutput one = DenseAttentionReference(
        shape.attention(), q.subspan(j * per_query, per_query), k, v, tokens);
    all.out.insert(all.out.end(), one.out.begin(), one.out.end());
    all.lse.insert(all.lse.end(), one.lse.begin(), one.lse.end());
  }
  return all;
}

absl::Status CompareAttention(absl::Span<const float> out, absl::Span<const float> lse,
                              const AttentionOutput& ref, double tol, absl::string_view what) {
  if (out.size() != ref.out.size() || lse.size() != ref.lse.size()) {
    return absl::InternalError(absl::StrCat(what, ": attention output has ", out.size(),
                                            " values and ", lse.size(), " lse, expected ",
                                            ref.out.size(), " and ", ref.lse.size()));
  }
  double scale = 1.0;
  for (float x : ref.out) scale = std::max(scale, static_cast<double>(std::fabs(x)));
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i]) || std::fabs(out[i] - ref.out[i]) > tol * scale) {
      return absl::InternalError(absl::StrCat(what, ": attention out[", i, "] = ", out[i],
                                              ", reference ", ref.out[i], " (tolerance ",
                                              tol * scale, ")"));
    }
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    const double bound = tol * std::max(1.0, std::fabs(static_cast<double>(ref.lse[i])));
    if (!std::isfinite(lse[i]) || std::fabs(lse[i] - ref.lse[i]) > bound) {
      return absl::InternalError(absl::StrCat(what, ": attention lse[", i, "] = ", lse[i],
                                              ", reference ", ref.lse[i], " (tolerance ", bound,
                                              ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CompareBytes(absl::string_view got, absl::string_view want, absl::string_view what) {
  if (got.size() != want.size()) {
    return absl::InternalError(
        absl::StrCat(what, ": ", got.size(), " bytes read back, expected ", want.size()));
  }
  if (got == want) return absl::OkStatus();
  size_t i = 0;
  while (i + 1 < got.size() && got[i] == want[i] && got[i + 1] == want[i + 1]) i += 2;
  uint16_t g = 0, w = 0;
  std::memcpy(&g, got.data() + i, 2);
  std::memcpy(&w, want.data() + i, 2);
  return absl::InternalError(absl::StrCat(what, ": the 16-bit word at byte ", i,
                                          " reads back as 0x", absl::Hex(g), ", expected 0x",
                                          absl::Hex(w)));
}

std::vector<float> ToFloats(absl::Span<const Bf16> v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = v[i].ToFloat();
  return out;
}

std::vector<float> FloatsFromBytes(absl::string_view bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

}  // namespace kvpool::soak
