#include "tests/support/test_data.h"

#include <random>

namespace kvpool::testing {

std::vector<float> GaussianValues(size_t n, uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

std::vector<float> RealLikeRows(int rows, int head_dim, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> channel(0, head_dim - 1);
  std::uniform_real_distribution<float> magnitude(8.0f, 20.0f);
  int outlier_channel[4];
  float outlier_scale[4];
  for (int i = 0; i < 4; ++i) {
    outlier_channel[i] = channel(rng);
    outlier_scale[i] = magnitude(rng);
  }
  std::vector<float> out(static_cast<size_t>(rows) * head_dim);
  for (int r = 0; r < rows; ++r) {
    const float offset = 0.5f * normal(rng);
    float* row = &out[static_cast<size_t>(r) * head_dim];
    for (int d = 0; d < head_dim; ++d) row[d] = normal(rng) + offset;
    for (int i = 0; i < 4; ++i) row[outlier_channel[i]] *= outlier_scale[i];
  }
  return out;
}

std::vector<Bf16> ToBf16(const std::vector<float>& v) {
  std::vector<Bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Bf16::FromFloat(v[i]);
  return out;
}

std::vector<float> ToFloat(const std::vector<Bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = v[i].ToFloat();
  return out;
}

std::string OscarFixturesDir() { return std::string(KVPOOL_FIXTURES_DIR) + "/oscar-reference"; }

}  // namespace kvpool::testing
