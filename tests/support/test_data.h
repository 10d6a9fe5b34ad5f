// Test inputs shared by the unit tests and benchmarks: real-like K/V rows (Gaussian values with
// a few large outlier channels and per-row offsets, as post-RoPE keys have) and fixture paths.
//
//   std::vector<float> rows = RealLikeRows(/*rows=*/512, /*head_dim=*/128, /*seed=*/7);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/bf16.h"

namespace kvpool::testing {

// `rows` x `head_dim` values: N(0, 1) plus 4 outlier channels (fixed per seed) scaled by 8-20,
// plus a per-row offset N(0, 0.5). Deterministic for a seed.
std::vector<float> RealLikeRows(int rows, int head_dim, uint64_t seed);
// N(0, stddev) values, deterministic for a seed.
std::vector<float> GaussianValues(size_t n, uint64_t seed, float stddev = 1.0f);
std::vector<Bf16> ToBf16(const std::vector<float>& v);
std::vector<float> ToFloat(const std::vector<Bf16>& v);

// Directory of the OSCAR reference golden data kept in the repository
// (tests/fixtures/oscar-reference, see tests/fixtures/README.md). The conformance tests read
// their files from it and fail when one is missing.
std::string OscarFixturesDir();

}  // namespace kvpool::testing
