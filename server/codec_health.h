// CodecHealth: a drift signal for the codec, per model, layer and tensor. Every
// `sample_every`-th chunk of arriving K/V rows, a few of its rows are rotated, clipped, encoded
// and decoded again on the side (the stored bytes come from the arrival path, untouched) to sum
// the energy the clip removes and the squared error of the decoded row, each beside the row's
// energy. The clip threshold is an order statistic of the row, so the NUMBER of values clipped
// is fixed by the clip ratio; the energy they lose is what grows when live data grows heavier
// tails than the data the rotation was fitted on. The time the sampling takes is counted too, so
// its cost is visible.
//
//   CodecHealth health(/*sample_every=*/64);
//   if (health.ShouldSample()) health.Sample(model, layer, k_rows, v_rows);   // on the worker
//   for (const CodecHealthSeries& s : health.Snapshot(live_models)) ...
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "server/model_registry.h"

namespace kvpool::server {

struct CodecHealthSeries {
  TenantId tenant;
  std::string model_id;
  int layer = 0;
  bool key = true;           // K, else V
  uint64_t rows = 0;         // head rows sampled
  uint64_t values = 0;       // their values
  double clip_energy = 0;    // sum of (|x| - tau)^2 over the values the clip changed
  double error_energy = 0;   // sum of (x - decoded)^2: everything the codec loses
  double signal_energy = 0;  // sum of x^2 (x: the rotated BF16 rows)
};

struct CodecHealthCost {
  uint64_t samples = 0;  // chunks sampled
  double seconds = 0;    // time spent sampling them
};

class CodecHealth {
 public:
  // Head rows sampled per tensor of a sampled chunk.
  static constexpr int kRowsPerSample = 4;

  // 0 = never sample.
  explicit CodecHealth(uint32_t sample_every) : sample_every_(sample_every) {}

  // Whether the chunk about to be staged is one to sample (every sample_every-th).
  bool ShouldSample();
  // Samples rows of one layer's chunk: `k` and `v` are [tokens][kv_heads][D] as they arrived.
  void Sample(const Model& model, int layer, absl::Span<const Bf16> k, absl::Span<const Bf16> v);

  // Every series of a model in `live` ((tenant, model id) pairs), sorted; the series of other
  // models (deleted since) are dropped.
  std::vector<CodecHealthSeries> Snapshot(const std::set<std::pair<TenantId, std::string>>& live);
  CodecHealthCost Cost() const;
  uint32_t sample_every() const { return sample_every_; }

 private:
  using Key = std::tuple<TenantId, std::string, int, bool>;
  void SampleTensor(const Model& model, int layer, KvTensor t, absl::Span<const Bf16> rows,
                    CodecHealthSeries* out) const;

  const uint32_t sample_every_;
  std::atomic<uint64_t> chunks_{0};
  mutable absl::Mutex mu_;
  std::map<Key, CodecHealthSeries> series_ ABSL_GUARDED_BY(mu_);
  CodecHealthCost cost_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::server
