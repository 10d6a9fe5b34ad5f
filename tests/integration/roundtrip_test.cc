// Round trips through a real kvpoold: every read path returns what the prefill and decode
// workers sent, bit for bit, with an identity rotation and the bypass quantizer; with a rotation
// and INT2/INT4 codes, the stored codes are the kernels' codes for the same rotated BF16 rows
// and every value is within the quantizer's bound.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/mixed_sequence.h"
#include "kernels/row_codec.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

class RoundTripTest : public DaemonTest {};

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};

size_t RowValues(const Shape& s) { return static_cast<size_t>(s.kv_heads) * s.head_dim; }

// Tokens [start, start + n) of one layer's rows.
std::vector<Bf16> Slice(const std::vector<Bf16>& rows, const Shape& s, int start, int n) {
  const size_t row = RowValues(s);
  return std::vector<Bf16>(rows.begin() + start * row, rows.begin() + (start + n) * row);
}

// Applies the server's tier rules to `layout` for an append; decode appends are one step each.
void ApplyAppend(MixedSequenceLayout* layout, int tokens, AppendKind kind) {
  const int steps = kind == AppendKind::kDecode ? tokens : 1;
  for (int i = 0; i < steps; ++i) {
    absl::StatusOr<AppendPlan> plan =
        layout->PlanAppend(kind == AppendKind::kDecode ? 1 : tokens, kind);
    ASSERT_TRUE(plan.ok()) << plan.status();
    layout->Commit(*plan, kind);
  }
}

void ExpectTiers(const v1::SequenceInfo& info, const MixedSequenceLayout& layout) {
  EXPECT_EQ(info.sink_tokens(), static_cast<uint32_t>(layout.sink()));
  EXPECT_EQ(info.history_tokens(), static_cast<uint32_t>(layout.history()));
  EXPECT_EQ(info.recent_tokens(), static_cast<uint32_t>(layout.recent()));
  EXPECT_EQ(info.total_tokens(), static_cast<uint32_t>(layout.total()));
}

// Sends decode steps [start, start + n) of `kv` in one AppendDecode.
absl::StatusOr<v1::AppendDecodeResponse> Decode(const KvpoolClient& c, const std::string& id,
                                                const SequenceKv& kv, const Shape& s, int start,
                                                int n) {
  v1::AppendDecodeRequest request;
  request.set_sequence_id(id);
  request.set_token_start(start);
  request.set_num_tokens(n);
  request.set_dtype(v1::DTYPE_BF16);
  std::string k, v;
  for (int l = 0; l < s.num_layers; ++l) {
    absl::StrAppend(&k, AsBytes(Slice(kv.k[l], s, start, n)));
    absl::StrAppend(&v, AsBytes(Slice(kv.v[l], s, start, n)));
  }
  request.set_k(k);
  request.set_v(v);
  return c.AppendDecode(request);
}

// Pushes `kv` as: a non-final prefill of `first` tokens (layer 1 before layer 0, each layer in
// two writes), a final prefill up to `prefill`, then decode steps to the end (single steps,
// then steps of 3). Checks the tier sizes after every append against the kernels' layout rules.
void PushInPieces(const KvpoolClient& c, const std::string& model, const std::string& id,
                  const SequenceKv& kv, const Shape& s, const QuantConfig& quant, int first,
                  int prefill) {
  ASSERT_TRUE(c.CreateSequence(model, id).ok());
  MixedSequenceLayout layout(TierConfig::FromQuantConfig(quant));

  v1::AppendKvHeader header;
  header.set_sequence_id(id);
  header.set_token_start(0);
  header.set_num_tokens(first);
  header.set_dtype(v1::DTYPE_BF16);
  auto stream = c.OpenAppend(header);
  ASSERT_TRUE(stream.ok()) << stream.status();
  const int split = first / 3;
  for (int l = s.num_layers - 1; l >= 0; --l) {
    KV_ASSERT_OK((*stream)->WriteLayer(l, 0, split, AsBytes(Slice(kv.k[l], s, 0, split)),
                                       AsBytes(Slice(kv.v[l], s, 0, split))));
    KV_ASSERT_OK((*stream)->WriteLayer(l, split, first - split,
                                       AsBytes(Slice(kv.k[l], s, split, first - split)),
                                       AsBytes(Slice(kv.v[l], s, split, first - split))));
  }
  absl::StatusOr<v1::AppendKvResponse> r1 = (*stream)->Finish();
  ASSERT_TRUE(r1.ok()) << r1.status();
  ApplyAppend(&layout, first, AppendKind::kPrefill);
  ExpectTiers(r1->sequence(), layout);
  EXPECT_EQ(r1->sequence().state(), v1::SEQUENCE_STATE_PREFILL);

  header.set_token_start(first);
  header.set_num_tokens(prefill - first);
  header.set_end_of_prefill(true);
  std::vector<std::vector<Bf16>> ks, vs;
  std::vector<client::LayerKv> layers;
  for (int l = 0; l < s.num_layers; ++l) {
    ks.push_back(Slice(kv.k[l], s, first, prefill - first));
    vs.push_back(Slice(kv.v[l], s, first, prefill - first));
  }
  for (int l = 0; l < s.num_layers; ++l) layers.push_back({l, AsBytes(ks[l]), AsBytes(vs[l])});
  absl::StatusOr<v1::AppendKvResponse> r2 = c.AppendKv(header, layers);
  ASSERT_TRUE(r2.ok()) << r2.status();
  ApplyAppend(&layout, prefill - first, AppendKind::kFinalPrefill);
  ExpectTiers(r2->sequence(), layout);
  EXPECT_EQ(r2->sequence().state(), v1::SEQUENCE_STATE_DECODE);

  int at = prefill;
  while (at < kv.tokens) {
    const int n = std::min(at - prefill < 10 ? 1 : 3, kv.tokens - at);
    absl::StatusOr<v1::AppendDecodeResponse> d = Decode(c, id, kv, s, at, n);
    ASSERT_TRUE(d.ok()) << d.status();
    ApplyAppend(&layout, n, AppendKind::kDecode);
    ExpectTiers(d->sequence(), layout);
    at += n;
  }
}

TEST_F(RoundTripTest, IdentityBypassIsExactOnEveryReadPath) {
  v1::QuantConfig q;
  q.set_method(v1::QUANT_METHOD_BYPASS);
  absl::StatusOr<v1::ModelInfo> model =
      RegisterDataFree(client(), "exact", kShape, v1::ROTATION_KIND_IDENTITY, 0, q);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->block_layout().bits(), 16);
  const QuantConfig quant = KernelQuant(model->quant());

  SequenceKv kv = MakeSequenceKv(kShape, 740, 1);
  // Bit patterns that a float round trip would not keep: -0, subnormals, the largest values in
  // kvpool's range (|x| < 2^16), a negative subnormal, in history, sink and recent positions.
  const uint16_t specials[] = {0x8000, 0x0001, 0x477f, 0xc77f, 0x8001, 0x0080};
  for (int l = 0; l < kShape.num_layers; ++l) {
    for (size_t i = 0; i < 6; ++i) {
      for (int pos : {5, 100, 300, 735}) {
        kv.k[l][pos * RowValues(kShape) + i * 7] = Bf16::FromBits(specials[i]);
        kv.v[l][pos * RowValues(kShape) + i * 11 + 1] = Bf16::FromBits(specials[(i + 3) % 6]);
      }
    }
  }
  PushInPieces(client(), "exact", "exact-1", kv, kShape, quant, /*first=*/200, /*prefill=*/700);
  if (HasFatalFailure()) return;

  // ReadKv, BF16, everything.
  v1::ReadKvRequest all;
  all.set_sequence_id("exact-1");
  absl::StatusOr<client::KvRead> read = client().ReadKv(all);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->header.num_tokens(), 740u);
  EXPECT_EQ(read->header.dtype(), v1::DTYPE_BF16);
  ASSERT_EQ(read->layers.size(), 2u);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(read->layers[l].layer, l);
    EXPECT_TRUE(read->layers[l].k == AsBytes(kv.k[l])) << "layer " << l << " keys differ";
    EXPECT_TRUE(read->layers[l].v == AsBytes(kv.v[l])) << "layer " << l << " values differ";
  }

  // A token sub-range of one layer.
  v1::ReadKvRequest part;
  part.set_sequence_id("exact-1");
  part.add_layers(1);
  part.set_token_start(100);
  part.set_num_tokens(250);
  read = client().ReadKv(part);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->layers.size(), 1u);
  EXPECT_TRUE(read->layers[0].k == AsBytes(Slice(kv.k[1], kShape, 100, 250)));
  EXPECT_TRUE(read->layers[0].v == AsBytes(Slice(kv.v[1], kShape, 100, 250)));

  // FP32: the exact widening of every BF16 word.
  all.set_dtype(v1::DTYPE_FP32);
  read = client().ReadKv(all);
  ASSERT_TRUE(read.ok()) << read.status();
  for (int l = 0; l < 2; ++l) {
    std::vector<float> k32(kv.k[l].size()), v32(kv.v[l].size());
    for (size_t i = 0; i < k32.size(); ++i) {
      k32[i] = kv.k[l][i].ToFloat();
      v32[i] = kv.v[l][i].ToFloat();
    }
    EXPECT_TRUE(read->layers[l].k == AsBytes(k32));
    EXPECT_TRUE(read->layers[l].v == AsBytes(v32));
  }

  // ReadBlocks: sink rows, 16-bit history blocks and recent rows hold the sent words.
  v1::ReadBlocksRequest blocks_request;
  blocks_request.set_sequence_id("exact-1");
  absl::StatusOr<client::BlocksRead> blocks = client().ReadBlocks(blocks_request);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  const v1::ReadBlocksHeader& h = blocks->header;
  EXPECT_EQ(h.codec_version(), model->codec_version());
  const BlockLayout layout = KernelLayout(h.block_layout());
  EXPECT_EQ(h.block_layout().block_bytes(), layout.block_bytes());
  EXPECT_EQ(h.block_layout().head_segment_bytes(), layout.head_segment_bytes());
  EXPECT_EQ(h.block_layout().code_bytes_per_row(), layout.code_bytes_per_row());
  EXPECT_EQ(h.block_layout().groups_per_row(), layout.groups_per_row());
  EXPECT_EQ(h.sink_tokens() + h.history_tokens() + h.recent_tokens(), 740u);
  const size_t row_bytes = RowValues(kShape) * sizeof(Bf16);
  const size_t head_row = static_cast<size_t>(kShape.head_dim) * sizeof(Bf16);
  for (int l = 0; l < 2; ++l) {
    const client::LayerBlocks& lb = blocks->layers[l];
    EXPECT_TRUE(lb.sink_k == AsBytes(kv.k[l]).substr(0, h.sink_tokens() * row_bytes));
    EXPECT_TRUE(lb.sink_v == AsBytes(kv.v[l]).substr(0, h.sink_tokens() * row_bytes));
    const size_t recent_at = (h.sink_tokens() + h.history_tokens()) * row_bytes;
    EXPECT_TRUE(lb.recent_k == AsBytes(kv.k[l]).substr(recent_at));
    EXPECT_TRUE(lb.recent_v == AsBytes(kv.v[l]).substr(recent_at));
    int mismatches = 0;
    for (uint32_t i = 0; i < h.history_tokens(); ++i) {
      const v1::KvBlock& block = lb.blocks[i / layout.tokens];
      const int slot = i % layout.tokens;
      const size_t pos = h.sink_tokens() + i;
      for (int head = 0; head < kShape.kv_heads; ++head) {
        for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
          const std::vector<Bf16>& src = t == KvTensor::kKey ? kv.k[l] : kv.v[l];
          const char* want =
              reinterpret_cast<const char*>(src.data() + pos * RowValues(kShape)) + head * head_row;
          const char* got = block.data().data() + layout.CodesOffset(t, head) +
                            slot * layout.code_bytes_per_row();
          mismatches += std::memcmp(want, got, head_row) != 0;
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << "layer " << l;
  }
}

struct QuantCase {
  std::string name;
  int bits;
  int group_size;
  v1::ScaleDtype scale;
};

class QuantizedRoundTripTest : public DaemonTest, public ::testing::WithParamInterface<QuantCase> {
 protected:
  static void SetUpTestSuite() { StartSuiteDaemon(DefaultFlags()); }
};

TEST_P(QuantizedRoundTripTest, CodesMatchTheKernelsAndValuesStayWithinTheBound) {
  const QuantCase& qc = GetParam();
  v1::QuantConfig q;
  q.set_bits(qc.bits);
  q.set_group_size(qc.group_size);
  q.set_scale_dtype(qc.scale);
  const std::string model_id = "quant-" + qc.name;
  absl::StatusOr<v1::ModelInfo> model =
      RegisterDataFree(client(), model_id, kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 1234, q);
  ASSERT_TRUE(model.ok()) << model.status();
  const QuantConfig quant = KernelQuant(model->quant());
  absl::StatusOr<RotationSet> rot = KernelRotation(*model);
  ASSERT_TRUE(rot.ok());
  absl::StatusOr<RowCodec> codec = RowCodec::Create(quant, kShape.head_dim);
  ASSERT_TRUE(codec.ok()) << codec.status();

  const SequenceKv kv = MakeSequenceKv(kShape, 650, 2);
  const std::string id = model_id + "-seq";
  PushInPieces(client(), model_id, id, kv, kShape, quant, /*first=*/150, /*prefill=*/610);
  if (HasFatalFailure()) return;

  v1::ReadBlocksRequest request;
  request.set_sequence_id(id);
  absl::StatusOr<client::BlocksRead> blocks = client().ReadBlocks(request);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  const v1::ReadBlocksHeader& h = blocks->header;
  const BlockLayout layout = KernelLayout(h.block_layout());
  EXPECT_EQ(layout.bits, qc.bits);
  EXPECT_EQ(h.block_layout().block_bytes(), layout.block_bytes());
  const size_t row = RowValues(kShape);
  const int dim = kShape.head_dim;
  const int group = layout.group_size;
  const float levels = static_cast<float>((1 << qc.bits) - 1);
  const ScaleDtype sd = quant.scale_dtype;

  v1::ReadKvRequest read_request;
  read_request.set_sequence_id(id);
  read_request.set_dtype(v1::DTYPE_FP32);
  absl::StatusOr<client::KvRead> read32 = client().ReadKv(read_request);
  ASSERT_TRUE(read32.ok()) << read32.status();
  read_request.set_dtype(v1::DTYPE_BF16);
  absl::StatusOr<client::KvRead> read16 = client().ReadKv(read_request);
  ASSERT_TRUE(read16.ok()) << read16.status();

  for (int l = 0; l < kShape.num_layers; ++l) {
    const client::LayerBlocks& lb = blocks->layers[l];
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      const bool key = t == KvTensor::kKey;
      const std::vector<Bf16>& sent = key ? kv.k[l] : kv.v[l];
      std::vector<Bf16> rotated(sent.size());
      KV_ASSERT_OK(rot->RotateBf16(l, t, sent, absl::MakeSpan(rotated)));
      // The rotated basis the daemon stores, every token: exact BF16 rows in sink and recent,
      // decoded codes in the history.
      std::vector<float> stored(sent.size());

      // Sink and recent: the rotated rows, bit for bit.
      const std::string& sink = key ? lb.sink_k : lb.sink_v;
      const std::string& recent = key ? lb.recent_k : lb.recent_v;
      const size_t recent_start = h.sink_tokens() + h.history_tokens();
      EXPECT_TRUE(sink == AsBytes(rotated).substr(0, sink.size()));
      EXPECT_TRUE(recent == AsBytes(rotated).substr(recent_start * row * sizeof(Bf16)));
      for (size_t i = 0; i < h.sink_tokens() * row; ++i) stored[i] = rotated[i].ToFloat();
      for (size_t i = recent_start * row; i < sent.size(); ++i) stored[i] = rotated[i].ToFloat();

      // History: codes and meta as the kernels' RowCodec writes them, values within the bound.
      int code_mismatches = 0, bound_violations = 0;
      double worst_ratio = 0;
      std::vector<uint8_t> codes(layout.code_bytes_per_row());
      std::vector<GroupMeta> meta(layout.groups_per_row());
      std::vector<float> clipped(dim), scratch(dim), decoded(dim);
      for (uint32_t i = 0; i < h.history_tokens(); ++i) {
        const std::string& data = lb.blocks[i / layout.tokens].data();
        const int slot = i % layout.tokens;
        const size_t pos = h.sink_tokens() + i;
        for (int head = 0; head < kShape.kv_heads; ++head) {
          const absl::Span<const Bf16> in(rotated.data() + pos * row + head * dim, dim);
          KV_ASSERT_OK(codec->Encode(t, in, codes.data(), meta.data()));
          const uint8_t* got_codes = reinterpret_cast<const uint8_t*>(data.data()) +
                                     layout.CodesOffset(t, head) +
                                     slot * layout.code_bytes_per_row();
          const uint8_t* got_meta = reinterpret_cast<const uint8_t*>(data.data()) +
                                    layout.MetaOffset(t, head) + slot * layout.meta_bytes_per_row();
          code_mismatches += std::memcmp(codes.data(), got_codes, codes.size()) != 0 ||
                             std::memcmp(meta.data(), got_meta, layout.meta_bytes_per_row()) != 0;
          std::vector<GroupMeta> stored_meta(meta.size());
          std::memcpy(stored_meta.data(), got_meta, layout.meta_bytes_per_row());
          codec->Decode(got_codes, stored_meta.data(), absl::MakeSpan(decoded));
          std::copy(decoded.begin(), decoded.end(), stored.begin() + pos * row + head * dim);

          // The bound, per value: scale/2 plus the 16-bit rounding of min and scale.
          std::vector<float> x(dim);
          for (int d = 0; d < dim; ++d) x[d] = in[d].ToFloat();
          const float tau = ClipThreshold(x, quant.ClipRatio(t), absl::MakeSpan(scratch));
          for (int d = 0; d < dim; ++d) clipped[d] = std::min(std::max(x[d], -tau), tau);
          for (int g = 0; g < dim / group; ++g) {
            float mn = clipped[g * group], mx = mn;
            for (int d = g * group; d < (g + 1) * group; ++d) {
              mn = std::min(mn, clipped[d]);
              mx = std::max(mx, clipped[d]);
            }
            const double s = ScaleWordToFloat(stored_meta[g].scale, sd);
            const double m = ScaleWordToFloat(stored_meta[g].min, sd);
            const double s32 = (double(mx) - mn) / levels;
            const double bound = s / 2 + std::abs(m - mn) + levels * std::abs(s - s32) +
                                 1e-6 * (std::abs(mn) + std::abs(mx) + 1);
            for (int d = g * group; d < (g + 1) * group; ++d) {
              const double err = std::abs(double(decoded[d]) - clipped[d]);
              worst_ratio = std::max(worst_ratio, err / bound);
              bound_violations += err > bound;
            }
          }
        }
      }
      EXPECT_EQ(code_mismatches, 0) << "layer " << l << (key ? " K" : " V");
      EXPECT_EQ(bound_violations, 0)
          << "layer " << l << (key ? " K" : " V") << ", worst " << worst_ratio << " of the bound";
      EXPECT_GT(worst_ratio, 0.2) << "the bound is not vacuous";

      // ReadKv in the original basis: the stored rows un-rotated (FP32), and BF16 is the
      // rounding of FP32.
      std::vector<float> original(stored.size());
      KV_ASSERT_OK(rot->Unrotate(l, t, stored, absl::MakeSpan(original)));
      const std::vector<float> got32 =
          FloatFromBytes(key ? read32->layers[l].k : read32->layers[l].v);
      const std::vector<Bf16> got16 =
          Bf16FromBytes(key ? read16->layers[l].k : read16->layers[l].v);
      ASSERT_EQ(got32.size(), original.size());
      int far = 0, rounding_mismatch = 0;
      for (size_t i = 0; i < original.size(); ++i) {
        far += std::abs(got32[i] - original[i]) > 1e-5f * (1.0f + std::abs(original[i]));
        rounding_mismatch += got16[i].bits != Bf16::FromFloat(got32[i]).bits;
      }
      EXPECT_EQ(far, 0) << "layer " << l << (key ? " K" : " V");
      EXPECT_EQ(rounding_mismatch, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, QuantizedRoundTripTest,
                         ::testing::Values(QuantCase{"int2_g64_fp16", 2, 0, v1::SCALE_DTYPE_FP16},
                                           QuantCase{"int2_g32_bf16", 2, 32, v1::SCALE_DTYPE_BF16},
                                           QuantCase{"int4_g64_fp16", 4, 0, v1::SCALE_DTYPE_FP16}),
                         [](const ::testing::TestParamInfo<QuantCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace kvpool::integration
