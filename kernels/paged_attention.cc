#include "kernels/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "kernels/bf16.h"
#include "kernels/block_layout.h"

namespace kvpool {
namespace {

constexpr const char* kTierNames[3] = {"sink", "history", "recent"};

bool SameLayout(const BlockLayout& a, const BlockLayout& b) {
  return a.tokens == b.tokens && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim &&
         a.group_size == b.group_size && a.bits == b.bits;
}

absl::Status CheckModel(const PagedAttentionModel& model, const PagedKvBatch& batch) {
  const AttentionShape& s = model.shape;
  if (s.q_heads < 1 || s.kv_heads < 1 || s.q_heads % s.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q_heads ", s.q_heads, " must be a positive multiple of kv_heads ", s.kv_heads));
  }
  if (!IsSupportedHeadDim(s.head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim ", s.head_dim, " is not a power of two in [32, 256]"));
  }
  if (model.history_codec == nullptr || model.history_codec->head_dim() != s.head_dim) {
    return absl::InvalidArgumentError("the history codec is missing or of another head_dim");
  }
  const QuantConfig& cfg = model.history_codec->config();
  if (!SameLayout(batch.history_pool.layout, BlockLayout::ForModel(cfg, s.kv_heads, s.head_dim)) ||
      batch.history_pool.scale_dtype != cfg.scale_dtype) {
    return absl::InvalidArgumentError("the history pool's layout does not match the codec");
  }
  const BlockLayout& p = batch.bf16_pool.layout;
  if (p.bits != 16 || p.kv_heads != s.kv_heads || p.head_dim != s.head_dim || p.tokens < 1) {
    return absl::InvalidArgumentError(
        "the BF16 pool's layout must be 16-bit rows of the model's kv_heads and head_dim");
  }
  for (const PagedKvView* pool : {&batch.history_pool, &batch.bf16_pool}) {
    if (pool->num_blocks < 0 || pool->block_stride < 0) {
      return absl::InvalidArgumentError("a pool's num_blocks and block_stride must be >= 0");
    }
  }
  if (batch.num_seqs < 0 || batch.max_history_tokens < 0 || batch.max_bf16_tokens < 0) {
    return absl::InvalidArgumentError("num_seqs and the token bounds must be >= 0");
  }
  return absl::OkStatus();
}

// Tier `t` of every row: counts within the bounds, tokens within the table row, block ids within
// the pool. The bound of the BF16 tiers applies to their sum, checked by the caller.
absl::Status CheckTier(const PagedKvBatch& batch, int t, const PagedKvTier& tier,
                       const PagedKvView& pool) {
  if (batch.num_seqs == 0) return absl::OkStatus();
  if (tier.first_token == nullptr || tier.num_tokens == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", kTierNames[t], " tier's first_token or num_tokens is null"));
  }
  const int64_t bt = pool.layout.tokens;
  for (int row = 0; row < batch.num_seqs; ++row) {
    const int64_t first = tier.first_token[row];
    const int64_t count = tier.num_tokens[row];
    if (first < 0 || count < 0) {
      return absl::InvalidArgumentError(absl::StrCat("row ", row, ": the ", kTierNames[t],
                                                     " tier's first_token ", first,
                                                     " or num_tokens ", count, " is negative"));
    }
    if (count == 0) continue;
    if (pool.pool == nullptr || tier.block_tables == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("the ", kTierNames[t], " tier has tokens but a null pool or block table"));
    }
    const int64_t last_block = (first + count - 1) / bt;
    if (last_block >= tier.block_table_stride) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", row, ": the ", kTierNames[t], " tier's tokens [", first, ", ", first + count,
          ") run past its block table row of ", tier.block_table_stride, " blocks"));
    }
    const int32_t* ids = tier.block_tables + static_cast<size_t>(row) * tier.block_table_stride;
    for (int64_t b = first / bt; b <= last_block; ++b) {
      if (ids[b] < 0 || ids[b] >= pool.num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("row ", row, ": ", kTierNames[t],
                                                       " block id ", ids[b], " is outside [0, ",
                                                       pool.num_blocks, ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckBatch(const PagedKvBatch& batch) {
  const PagedKvTier* tiers[3] = {&batch.sink, &batch.history, &batch.recent};
  for (int t = 0; t < 3; ++t) {
    KVPOOL_RETURN_IF_ERROR(
        CheckTier(batch, t, *tiers[t], t == 1 ? batch.history_pool : batch.bf16_pool));
  }
  for (int row = 0; row < batch.num_seqs; ++row) {
    const int64_t bf16 = int64_t{batch.sink.num_tokens[row]} + batch.recent.num_tokens[row];
    if (batch.history.num_tokens[row] > batch.max_history_tokens || bf16 > batch.max_bf16_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", row, ": ", batch.history.num_tokens[row], " history and ", bf16,
                       " BF16 tokens exceed the batch's bounds ", batch.max_history_tokens, " and ",
                       batch.max_bf16_tokens));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRotation(const PagedAttentionRotation& r, int head_dim) {
  if (r.set == nullptr) return absl::OkStatus();
  if (r.set->head_dim() != head_dim || r.layer < 0 || r.layer >= r.set->num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the rotation set has no layer ", r.layer, " of head_dim ", head_dim));
  }
  return absl::OkStatus();
}

// out = in * M (transpose: in * M^T) for `rows` rows of D values: each value accumulated in fp32
// with fused multiply-adds over k in order from +0 (RotationSet's dense arithmetic).
void DenseRows(const float* in, const float* m, bool transpose, int d, size_t rows, float* out) {
  for (size_t r = 0; r < rows; ++r) {
    const float* x = in + r * d;
    float* y = out + r * d;
    for (int j = 0; j < d; ++j) {
      float acc = 0.0f;
      if (transpose) {
        const float* mj = m + static_cast<size_t>(j) * d;
        for (int k = 0; k < d; ++k) acc = std::fma(x[k], mj[k], acc);
      } else {
        for (int k = 0; k < d; ++k) acc = std::fma(x[k], m[static_cast<size_t>(k) * d + j], acc);
      }
      y[j] = acc;
    }
  }
}

// `in` (rows of D) into the rotated basis of `t` (inverse: back out of it) into `out`.
absl::Status ApplyRotation(const PagedAttentionRotation& r, KvTensor t, bool inverse, int d,
                           absl::Span<const float> in, absl::Span<float> out) {
  if (r.set != nullptr) {
    return inverse ? r.set->Unrotate(r.layer, t, in, out) : r.set->Rotate(r.layer, t, in, out);
  }
  const float* m = t == KvTensor::kKey ? r.k : r.v;
  if (m == nullptr) {
    std::copy(in.begin(), in.end(), out.begin());
  } else {
    DenseRows(in.data(), m, inverse, d, in.size() / d, out.data());
  }
  return absl::OkStatus();
}

// Tokens [first, first + count) of `tier`'s row `row`, tensor `t`, in order, [count][Hkv][D].
void GatherBf16(const PagedKvView& pool, const PagedKvTier& tier, int row, KvTensor t,
                std::vector<Bf16>* out) {
  const BlockLayout& l = pool.layout;
  const int bt = l.tokens;
  const size_t width = static_cast<size_t>(l.kv_heads) * l.head_dim;
  const size_t row_bytes = static_cast<size_t>(l.head_dim) * sizeof(Bf16);
  const int tokens = tier.num_tokens[row];
  const int first = tier.first_token[row];
  const int32_t* ids = tier.block_tables + static_cast<size_t>(row) * tier.block_table_stride;
  out->resize(static_cast<size_t>(tokens) * width);
  for (int done = 0; done < tokens;) {
    const int pos = first + done;
    const int take = std::min(tokens - done, bt - pos % bt);
    const uint8_t* page = pool.Block(ids[pos / bt]);
    for (int h = 0; h < l.kv_heads; ++h) {
      const uint8_t* src = page + l.CodesOffset(t, h) + static_cast<size_t>(pos % bt) * row_bytes;
      for (int r = 0; r < take; ++r) {
        std::memcpy(out->data() + (static_cast<size_t>(done + r) * l.kv_heads + h) * l.head_dim,
                    src + r * row_bytes, row_bytes);
      }
    }
    done += take;
  }
}

// Attention of the rotated query `q` over row `row` of `batch`, in the rotated V basis: the
// sink, then the recent window, then the history, merged in that order.
AttentionOutput AttendRow(const PagedAttentionModel& model, const PagedKvBatch& batch, int row,
                          absl::Span<const float> q) {
  const AttentionShape& shape = model.shape;
  AttentionOutput acc;
  acc.out.assign(static_cast<size_t>(shape.q_heads) * shape.head_dim, 0.0f);
  acc.lse.assign(shape.q_heads, -std::numeric_limits<float>::infinity());
  std::vector<Bf16> k, v;
  for (const PagedKvTier* tier : {&batch.sink, &batch.recent}) {
    const int tokens = tier->num_tokens[row];
    if (tokens <= 0) continue;
    GatherBf16(batch.bf16_pool, *tier, row, KvTensor::kKey, &k);
    GatherBf16(batch.bf16_pool, *tier, row, KvTensor::kValue, &v);
    MergeAttention(shape, AttendBf16Rows(shape, q, k, v, tokens), &acc);
  }
  const int history = batch.history.num_tokens[row];
  if (history > 0) {
    const int bt = batch.history_pool.layout.tokens;
    const int first = batch.history.first_token[row];
    const int first_block = first / bt;
    const int end_block = static_cast<int>((int64_t{first} + history + bt - 1) / bt);
    const int32_t* ids =
        batch.history.block_tables + static_cast<size_t>(row) * batch.history.block_table_stride;
    std::vector<const uint8_t*> blocks;
    blocks.reserve(end_block - first_block);
    for (int b = first_block; b < end_block; ++b) {
      blocks.push_back(batch.history_pool.Block(ids[b]));
    }
    MergeAttention(shape,
                   AttendBlocksFrom(shape, *model.history_codec, batch.history_pool.layout, blocks,
                                    first % bt, history, q),
                   &acc);
  }
  return acc;
}

}  // namespace

absl::Status PagedDecodeAttention(const PagedAttentionModel& model, const PagedKvBatch& batch,
                                  const PagedAttentionRotation& rotation,
                                  const PagedAttentionIo& io) {
  KVPOOL_RETURN_IF_ERROR(CheckModel(model, batch));
  KVPOOL_RETURN_IF_ERROR(CheckRotation(rotation, model.shape.head_dim));
  KVPOOL_RETURN_IF_ERROR(CheckBatch(batch));
  if (batch.num_seqs == 0) return absl::OkStatus();
  if (io.queries == nullptr || io.out == nullptr || io.lse == nullptr) {
    return absl::InvalidArgumentError("queries, out and lse must not be null");
  }
  const int d = model.shape.head_dim;
  const size_t per_row = static_cast<size_t>(model.shape.q_heads) * d;
  std::vector<float> q(per_row);
  for (int row = 0; row < batch.num_seqs; ++row) {
    const size_t at = static_cast<size_t>(row) * per_row;
    KVPOOL_RETURN_IF_ERROR(ApplyRotation(rotation, KvTensor::kKey, /*inverse=*/false, d,
                                         absl::MakeConstSpan(io.queries + at, per_row),
                                         absl::MakeSpan(q)));
    const AttentionOutput o = AttendRow(model, batch, row, q);
    KVPOOL_RETURN_IF_ERROR(ApplyRotation(rotation, KvTensor::kValue, /*inverse=*/true, d, o.out,
                                         absl::MakeSpan(io.out + at, per_row)));
    std::copy(o.lse.begin(), o.lse.end(), io.lse + static_cast<size_t>(row) * model.shape.q_heads);
  }
  return absl::OkStatus();
}

}  // namespace kvpool
