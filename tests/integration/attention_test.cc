// Remote attention through a real kvpoold equals the kernels' attention (AttendBf16Rows over the
// BF16 tiers, AttendBlocks over the INT2 history, MergeAttention, the same rotation) on the very
// blocks the daemon stores, to float rounding; with identity + bypass it equals dense attention,
// and its log-sum-exp merges exactly with attention over tokens the caller kept.
#include "kernels/attention.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/row_codec.h"
#include "tests/integration/integration_util.h"
#include "tests/support/test_data.h"

namespace kvpool::integration {
namespace {

class AttentionTest : public DaemonTest {};

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};

struct Expected {
  std::vector<float> out;  // [num_queries][Hq][D], original basis
  std::vector<float> lse;  // [num_queries][Hq]
  uint32_t tokens = 0;
};

// Attention the kernels compute over what ReadBlocks returns for `layer`, for `num_queries`
// unrotated query rows `q`.
absl::StatusOr<Expected> KernelAttention(const KvpoolClient& c, const v1::ModelInfo& model,
                                         const std::string& id, int layer,
                                         const std::vector<float>& q, int num_queries) {
  v1::ReadBlocksRequest request;
  request.set_sequence_id(id);
  request.add_layers(layer);
  absl::StatusOr<client::BlocksRead> read = c.ReadBlocks(request);
  if (!read.ok()) return read.status();
  absl::StatusOr<RotationSet> rot = KernelRotation(model);
  if (!rot.ok()) return rot.status();
  absl::StatusOr<RowCodec> codec =
      RowCodec::Create(KernelQuant(model.quant()), model.shape().head_dim());
  if (!codec.ok()) return codec.status();
  const BlockLayout layout = KernelLayout(read->header.block_layout());
  const AttentionShape shape{model.shape().q_heads(), model.shape().kv_heads(),
                             model.shape().head_dim()};
  const client::LayerBlocks& lb = read->layers[0];
  std::vector<const uint8_t*> blocks;
  for (const v1::KvBlock& b : lb.blocks) {
    blocks.push_back(reinterpret_cast<const uint8_t*>(b.data().data()));
  }
  const size_t per_query = static_cast<size_t>(shape.q_heads) * shape.head_dim;
  Expected e;
  e.tokens =
      read->header.sink_tokens() + read->header.history_tokens() + read->header.recent_tokens();
  for (int j = 0; j < num_queries; ++j) {
    const std::vector<float> qj(q.begin() + j * per_query, q.begin() + (j + 1) * per_query);
    std::vector<float> q_rot(qj.size());
    if (absl::Status s = rot->Rotate(layer, KvTensor::kKey, qj, absl::MakeSpan(q_rot)); !s.ok()) {
      return s;
    }
    AttentionOutput acc = AttendBf16Rows(shape, q_rot, Bf16FromBytes(lb.sink_k),
                                         Bf16FromBytes(lb.sink_v), read->header.sink_tokens());
    MergeAttention(
        shape, AttendBlocks(shape, *codec, layout, blocks, read->header.history_tokens(), q_rot),
        &acc);
    MergeAttention(shape,
                   AttendBf16Rows(shape, q_rot, Bf16FromBytes(lb.recent_k),
                                  Bf16FromBytes(lb.recent_v), read->header.recent_tokens()),
                   &acc);
    std::vector<float> out(acc.out.size());
    if (absl::Status s = rot->Unrotate(layer, KvTensor::kValue, acc.out, absl::MakeSpan(out));
        !s.ok()) {
      return s;
    }
    e.out.insert(e.out.end(), out.begin(), out.end());
    e.lse.insert(e.lse.end(), acc.lse.begin(), acc.lse.end());
  }
  return e;
}

// Float-rounding agreement (RemoteAttentionTolerance: 2e-5 on the CPU backend).
void ExpectClose(const v1::SequenceAttention& got, const Expected& want, const std::string& what) {
  EXPECT_EQ(got.attended_tokens(), want.tokens) << what;
  const std::vector<float> out = FloatFromBytes(got.out());
  ASSERT_EQ(out.size(), want.out.size()) << what;
  ASSERT_EQ(static_cast<size_t>(got.lse_size()), want.lse.size()) << what;
  float scale = 1.0f;
  for (float x : want.out) scale = std::max(scale, std::abs(x));
  double worst = 0;
  for (size_t i = 0; i < out.size(); ++i)
    worst = std::max(worst, double(std::abs(out[i] - want.out[i])));
  const AttentionTolerance tol = RemoteAttentionTolerance();
  EXPECT_LE(worst, tol.out * scale) << what;
  for (size_t h = 0; h < want.lse.size(); ++h) {
    EXPECT_NEAR(got.lse(h), want.lse[h], tol.lse * std::max(1.0f, std::abs(want.lse[h])))
        << what << " head " << h;
  }
}

// Queries that attend sharply to a few tokens (like real ones) plus noise: [n][Hq][D].
std::vector<float> FocusedQueries(const SequenceKv& kv, int layer, int n, uint64_t seed) {
  std::vector<float> q = testing::GaussianValues(
      static_cast<size_t>(n) * kShape.q_heads * kShape.head_dim, seed, 0.3f);
  const int group = kShape.q_heads / kShape.kv_heads;
  for (int j = 0; j < n; ++j) {
    for (int h = 0; h < kShape.q_heads; ++h) {
      const int t = static_cast<int>((seed * 7919 + j * 131 + h * 17) % kv.tokens);
      const size_t at = (static_cast<size_t>(t) * kShape.kv_heads + h / group) * kShape.head_dim;
      for (int d = 0; d < kShape.head_dim; ++d) {
        q[(static_cast<size_t>(j) * kShape.q_heads + h) * kShape.head_dim + d] +=
            0.15f * kv.k[layer][at + d].ToFloat();
      }
    }
  }
  return q;
}

TEST_F(AttentionTest, RemoteAttentionEqualsKernelAttentionOnTheStoredBlocks) {
  absl::StatusOr<v1::ModelInfo> model =
      RegisterDataFree(client(), "attn-rh", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 99);
  ASSERT_TRUE(model.ok()) << model.status();

  // Sequences in every tier state: sink only, sink + recent, all three tiers after a final
  // prefill, history straight from a non-final prefill, history grown by decode demotion, and
  // an empty one.
  struct Seq {
    std::string id;
    int tokens;
    bool final;
    int decode;
  };
  const std::vector<Seq> seqs = {{"a-sink", 40, true, 0},     {"a-recent", 300, true, 0},
                                 {"a-tiers", 1000, true, 0},  {"a-prefill", 700, false, 0},
                                 {"a-decode", 400, true, 37}, {"a-empty", 0, true, 0}};
  std::vector<SequenceKv> kvs;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const Seq& s = seqs[i];
    SequenceKv kv = MakeSequenceKv(kShape, s.tokens + s.decode, 10 + i);
    if (s.tokens == 0) {
      ASSERT_TRUE(client().CreateSequence("attn-rh", s.id).ok());
      kvs.push_back(kv);
      continue;
    }
    SequenceKv prefill = kv;
    prefill.tokens = s.tokens;
    const size_t row = static_cast<size_t>(kShape.kv_heads) * kShape.head_dim;
    for (int l = 0; l < kShape.num_layers; ++l) {
      prefill.k[l].resize(s.tokens * row);
      prefill.v[l].resize(s.tokens * row);
    }
    absl::StatusOr<v1::AppendKvResponse> r =
        CreateAndAppend(client(), "attn-rh", s.id, prefill, s.final);
    ASSERT_TRUE(r.ok()) << s.id << ": " << r.status();
    for (int t = s.tokens; t < s.tokens + s.decode; ++t) {
      v1::AppendDecodeRequest d;
      d.set_sequence_id(s.id);
      d.set_token_start(t);
      d.set_num_tokens(1);
      d.set_dtype(v1::DTYPE_BF16);
      std::string k, v;
      for (int l = 0; l < kShape.num_layers; ++l) {
        absl::StrAppend(&k, AsBytes(kv.k[l]).substr(t * row * 2, row * 2));
        absl::StrAppend(&v, AsBytes(kv.v[l]).substr(t * row * 2, row * 2));
      }
      d.set_k(k);
      d.set_v(v);
      ASSERT_TRUE(client().AppendDecode(d).ok());
    }
    kvs.push_back(kv);
  }

  for (int layer = 0; layer < kShape.num_layers; ++layer) {
    v1::AttendRequest request;
    request.set_model_id("attn-rh");
    request.set_layer(layer);
    request.set_dtype(v1::DTYPE_FP32);
    std::vector<std::vector<float>> queries;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int nq = 1 + static_cast<int>(i % 3);  // speculative-decoding style multi-query
      queries.push_back(FocusedQueries(kvs[i].tokens > 0 ? kvs[i] : kvs[2], layer, nq, 100 + i));
      v1::SequenceQuery* sq = request.add_queries();
      sq->set_sequence_id(seqs[i].id);
      sq->set_num_queries(nq);
      sq->set_q(std::string(AsBytes(queries.back())));
    }
    absl::StatusOr<v1::AttendResponse> got = client().Attend(request);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->results_size(), static_cast<int>(seqs.size()));
    for (size_t i = 0; i < seqs.size(); ++i) {
      const v1::SequenceAttention& r = got->results(i);
      EXPECT_EQ(r.sequence_id(), seqs[i].id);
      const int nq = 1 + static_cast<int>(i % 3);
      if (seqs[i].tokens == 0) {
        EXPECT_EQ(r.attended_tokens(), 0u);
        for (float l : r.lse()) EXPECT_EQ(l, -std::numeric_limits<float>::infinity());
        for (float x : FloatFromBytes(r.out())) EXPECT_EQ(x, 0.0f);
        continue;
      }
      absl::StatusOr<Expected> want =
          KernelAttention(client(), *model, seqs[i].id, layer, queries[i], nq);
      ASSERT_TRUE(want.ok()) << want.status();
      ExpectClose(r, *want, seqs[i].id + " layer " + std::to_string(layer));
    }

    // The same queries as BF16 give what their FP32 widening gives, bit for bit.
    v1::AttendRequest bf16 = request;
    bf16.set_dtype(v1::DTYPE_BF16);
    v1::AttendRequest widened = request;
    for (int i = 0; i < bf16.queries_size(); ++i) {
      const std::vector<Bf16> qb = testing::ToBf16(queries[i]);
      bf16.mutable_queries(i)->set_q(std::string(AsBytes(qb)));
      widened.mutable_queries(i)->set_q(std::string(AsBytes(testing::ToFloat(qb))));
    }
    absl::StatusOr<v1::AttendResponse> a = client().Attend(bf16);
    absl::StatusOr<v1::AttendResponse> b = client().Attend(widened);
    ASSERT_TRUE(a.ok() && b.ok());
    for (int i = 0; i < a->results_size(); ++i) {
      EXPECT_EQ(a->results(i).out(), b->results(i).out()) << seqs[i].id;
    }
  }
}

TEST_F(AttentionTest, IdentityBypassEqualsDenseAttentionAndMergesWithLocalTokens) {
  v1::QuantConfig q;
  q.set_method(v1::QUANT_METHOD_BYPASS);
  absl::StatusOr<v1::ModelInfo> model =
      RegisterDataFree(client(), "attn-exact", kShape, v1::ROTATION_KIND_IDENTITY, 0, q);
  ASSERT_TRUE(model.ok()) << model.status();
  // 900 tokens stored in the daemon, 60 more kept by the caller.
  const int stored = 900, local = 60;
  const SequenceKv kv = MakeSequenceKv(kShape, stored + local, 7);
  SequenceKv head = kv;
  head.tokens = stored;
  const size_t row = static_cast<size_t>(kShape.kv_heads) * kShape.head_dim;
  for (int l = 0; l < kShape.num_layers; ++l) {
    head.k[l].resize(stored * row);
    head.v[l].resize(stored * row);
  }
  ASSERT_TRUE(CreateAndAppend(client(), "attn-exact", "exact-seq", head, true).ok());

  const AttentionShape shape{kShape.q_heads, kShape.kv_heads, kShape.head_dim};
  const int layer = 1;
  const std::vector<float> q1 = FocusedQueries(kv, layer, 1, 5);
  v1::AttendRequest request;
  request.set_model_id("attn-exact");
  request.set_layer(layer);
  v1::SequenceQuery* sq = request.add_queries();
  sq->set_sequence_id("exact-seq");
  sq->set_q(std::string(AsBytes(q1)));
  absl::StatusOr<v1::AttendResponse> got = client().Attend(request);
  ASSERT_TRUE(got.ok()) << got.status();
  const v1::SequenceAttention& r = got->results(0);

  const std::vector<float> k_all = testing::ToFloat(kv.k[layer]);
  const std::vector<float> v_all = testing::ToFloat(kv.v[layer]);
  // Dense attention (float64) over the stored tokens.
  const AttentionOutput dense_stored =
      DenseAttentionReference(shape, q1, absl::MakeConstSpan(k_all).subspan(0, stored * row),
                              absl::MakeConstSpan(v_all).subspan(0, stored * row), stored);
  Expected want{dense_stored.out, dense_stored.lse, static_cast<uint32_t>(stored)};
  ExpectClose(r, want, "stored tokens vs dense");

  // Merge the remote partial result with local attention over the caller's 60 tokens: equals
  // dense attention over all 960.
  AttentionOutput remote{FloatFromBytes(r.out()),
                         std::vector<float>(r.lse().begin(), r.lse().end())};
  const AttentionOutput local_part =
      AttendBf16Rows(shape, q1, absl::MakeConstSpan(kv.k[layer]).subspan(stored * row, local * row),
                     absl::MakeConstSpan(kv.v[layer]).subspan(stored * row, local * row), local);
  MergeAttention(shape, local_part, &remote);
  const AttentionOutput dense_all =
      DenseAttentionReference(shape, q1, k_all, v_all, stored + local);
  v1::SequenceAttention merged;
  merged.set_out(std::string(AsBytes(remote.out)));
  for (float l : remote.lse) merged.add_lse(l);
  merged.set_attended_tokens(stored + local);
  ExpectClose(merged, Expected{dense_all.out, dense_all.lse, static_cast<uint32_t>(stored + local)},
              "remote + local merged vs dense");
}

}  // namespace
}  // namespace kvpool::integration
