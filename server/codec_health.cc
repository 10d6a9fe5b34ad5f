#include "server/codec_health.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "kernels/row_codec.h"

namespace kvpool::server {

bool CodecHealth::ShouldSample() {
  if (sample_every_ == 0) return false;
  return chunks_.fetch_add(1, std::memory_order_relaxed) % sample_every_ == 0;
}

void CodecHealth::SampleTensor(const Model& model, int layer, KvTensor t,
                               absl::Span<const Bf16> rows, CodecHealthSeries* out) const {
  const size_t d = static_cast<size_t>(model.head_dim);
  const size_t head_rows = rows.size() / d;
  if (head_rows == 0) return;
  const RowCodec& codec = model.row_codec;
  const QuantConfig& quant = codec.config();
  // Rows spread over the chunk (tokens and heads alike).
  const size_t picks = std::min<size_t>(kRowsPerSample, head_rows);
  std::vector<Bf16> in(picks * d), rotated(picks * d);
  for (size_t i = 0; i < picks; ++i) {
    const size_t row = i * head_rows / picks;
    std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>(row * d), d, in.begin() + i * d);
  }
  const bool prerotated = t == KvTensor::kValue && model.codec.v_prerotated;
  if (prerotated) {
    rotated = in;
  } else if (!model.codec.rotations.RotateBf16(layer, t, in, absl::MakeSpan(rotated)).ok()) {
    return;  // non-finite rows: the arrival path refuses them
  }
  std::vector<float> x(d), scratch(d), decoded(d);
  std::vector<uint8_t> codes(codec.layout().code_bytes_per_row());
  std::vector<GroupMeta> meta(std::max<size_t>(1, codec.layout().groups_per_row()));
  for (size_t i = 0; i < picks; ++i) {
    const absl::Span<const Bf16> row = absl::MakeConstSpan(rotated).subspan(i * d, d);
    for (size_t j = 0; j < d; ++j) x[j] = row[j].ToFloat();
    const float tau = ClipThreshold(x, quant.ClipRatio(t), absl::MakeSpan(scratch));
    if (!codec.Encode(t, row, codes.data(), meta.data()).ok()) continue;
    codec.Decode(codes.data(), meta.data(), absl::MakeSpan(decoded));
    ++out->rows;
    out->values += d;
    for (size_t j = 0; j < d; ++j) {
      const double over = static_cast<double>(std::fabs(x[j])) - static_cast<double>(tau);
      if (over > 0) out->clip_energy += over * over;
      const double e = static_cast<double>(x[j]) - static_cast<double>(decoded[j]);
      out->error_energy += e * e;
      out->signal_energy += static_cast<double>(x[j]) * static_cast<double>(x[j]);
    }
  }
}

void CodecHealth::Sample(const Model& model, int layer, absl::Span<const Bf16> k,
                         absl::Span<const Bf16> v) {
  const auto start = std::chrono::steady_clock::now();
  CodecHealthSeries ks, vs;
  SampleTensor(model, layer, KvTensor::kKey, k, &ks);
  SampleTensor(model, layer, KvTensor::kValue, v, &vs);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  absl::MutexLock lock(&mu_);
  for (const CodecHealthSeries* s : {&ks, &vs}) {
    const bool key = s == &ks;
    CodecHealthSeries& total = series_[Key{model.tenant, model.id, layer, key}];
    total.rows += s->rows;
    total.values += s->values;
    total.clip_energy += s->clip_energy;
    total.error_energy += s->error_energy;
    total.signal_energy += s->signal_energy;
  }
  ++cost_.samples;
  cost_.seconds += seconds;
}

std::vector<CodecHealthSeries> CodecHealth::Snapshot(
    const std::set<std::pair<TenantId, std::string>>& live) {
  absl::MutexLock lock(&mu_);
  std::vector<CodecHealthSeries> out;
  for (auto it = series_.begin(); it != series_.end();) {
    const auto& [tenant, model, layer, key] = it->first;
    if (live.count({tenant, model}) == 0) {
      it = series_.erase(it);
      continue;
    }
    CodecHealthSeries s = it->second;
    s.tenant = tenant;
    s.model_id = model;
    s.layer = layer;
    s.key = key;
    out.push_back(std::move(s));
    ++it;
  }
  return out;
}

CodecHealthCost CodecHealth::Cost() const {
  absl::MutexLock lock(&mu_);
  return cost_;
}

}  // namespace kvpool::server
