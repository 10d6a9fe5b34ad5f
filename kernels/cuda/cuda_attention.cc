// Host side of the decode attention: checks, the split of the work into chunks, the workspace
// layout, and the dispatch to the instantiated kernels (decode_attention_d*.cu).
#include "kernels/cuda/cuda_attention.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/attention_params.h"
#include "kernels/cuda/host_internal.h"

namespace kvpool::cuda {
namespace {

using internal::AttentionParams;
using internal::MakeGeometry;

constexpr int kChunkQuantum = 64;     // decode_attention.cuh kChunkQuantum (4 warps x 16 tokens)
constexpr int kHistoryQuantum = 128;  // int2_history.cuh kHistoryQuantum (4 warps x 32 tokens)
constexpr int kMaxGroup = 16;
constexpr int kMaxHistoryGroup = 8;  // int2_history.cuh and merge_group.cuh: groups of up to 8
constexpr int kMaxNarrowGroup = 4;   // the INT2 history kernel's narrow layout
constexpr int kMaxParts = 256;       // decode_attention.cuh kMaxParts (merge kernels)
constexpr int kMaxBf16Parts = 32;    // at most this many chunks of the BF16 tiers
// The largest min_history_chunk_tokens: far above any context, and far from int overflow when
// the chunk lengths are rounded up.
constexpr int kMaxMinHistoryChunkTokens = 1 << 24;

using internal::AttentionKernelKind;

struct Plan {
  int group = 0;
  // Groups of 9 to 16 query heads: Int2HistoryLargeGroupKernel, and the merge kernel with a
  // CTA per query head. Smaller groups: Int2HistoryKernel, either merge kernel, the tail merge.
  bool large_group = false;
  bool history_narrow = false;   // Int2HistoryKernel in the narrow layout (groups of up to 4)
  bool merge_per_group = false;  // MergeGroupKernel (else MergeHeadKernel)
  bool tail_merge = false;       // the attention CTAs merge (MergeIfLastPart), no merge kernel
  int history_chunks = 0;
  int history_chunk_tokens = kChunkQuantum;
  int bf16_chunks = 0;
  int bf16_chunk_tokens = kChunkQuantum;
  int num_parts = 0;
  // Workspace layout (byte offsets).
  size_t q_rot = 0, q_sum = 0, q_scale = 0, part_out = 0, part_lse = 0, counters = 0, total = 0;
};

int RoundUp(int64_t v, int64_t q) { return static_cast<int>((v + q - 1) / q * q); }

absl::Status CheckShape(const DecodeAttentionShape& s, const PagedKvBatch& b) {
  const BlockLayout& l = b.history_pool.layout;
  const int d = l.head_dim;
  if (d != 64 && d != 128) {
    return absl::UnimplementedError(
        absl::StrCat("decode attention supports D = 64 or 128, not ", d));
  }
  KVPOOL_RETURN_IF_ERROR(s.cfg.Validate(d));
  if (l.kv_heads < 1 || s.q_heads < l.kv_heads || s.q_heads % l.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("q_heads ", s.q_heads, " is not a multiple of kv_heads ", l.kv_heads));
  }
  if (s.q_heads / l.kv_heads > kMaxGroup) {
    return absl::UnimplementedError(absl::StrCat("GQA groups above ", kMaxGroup, " query heads"));
  }
  const BlockLayout want = BlockLayout::ForModel(s.cfg, l.kv_heads, d);
  if (want.tokens != l.tokens || want.group_size != l.group_size || want.bits != l.bits) {
    return absl::InvalidArgumentError("history block layout does not match the QuantConfig");
  }
  if (l.bits != 2 || l.group_size != d) {
    return absl::UnimplementedError(
        "decode attention needs INT2 history blocks with one group per row (G = D)");
  }
  if (b.history_pool.scale_dtype != s.cfg.scale_dtype) {
    return absl::InvalidArgumentError("history scale dtype does not match the QuantConfig");
  }
  if (b.history_pool.block_stride % 16 != 0 || b.bf16_pool.block_stride % 16 != 0 ||
      b.history_pool.block_stride < 0 || b.bf16_pool.block_stride < 0) {
    return absl::InvalidArgumentError("block strides must be 0 or a multiple of 16");
  }
  if (s.tuning.max_history_chunk_tokens < 0 || s.tuning.min_history_chunk_tokens < 0 ||
      s.tuning.min_history_chunk_tokens > kMaxMinHistoryChunkTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("tuning's history chunk bounds must be >= 0, the shortest at most ",
                     kMaxMinHistoryChunkTokens));
  }
  if (b.num_seqs < 1 || b.max_history_tokens < 0 || b.max_bf16_tokens < 0) {
    return absl::InvalidArgumentError("need num_seqs >= 1 and non-negative token bounds");
  }
  if (b.max_history_tokens > 0 &&
      (b.history_pool.pool == nullptr || b.history_pool.num_blocks < 1)) {
    return absl::InvalidArgumentError("history pool is empty");
  }
  if (b.max_bf16_tokens > 0) {
    const BlockLayout& p = b.bf16_pool.layout;
    if (b.bf16_pool.pool == nullptr || b.bf16_pool.num_blocks < 1 ||
        reinterpret_cast<uintptr_t>(b.bf16_pool.pool) % 16 != 0) {
      return absl::InvalidArgumentError("BF16 pool must be a non-null 16-byte aligned arena");
    }
    if (p.bits != 16 || p.head_dim != d || p.kv_heads != l.kv_heads || p.tokens < 8 ||
        (p.tokens & (p.tokens - 1)) != 0) {
      return absl::InvalidArgumentError(
          "BF16 pool layout must be bits 16 with the model's head_dim and kv_heads");
    }
  }
  return absl::OkStatus();
}

// Resident CTAs per SM of one attention kernel, cached.
absl::StatusOr<int> CtasPerSm(int d, bool two_tiles, AttentionKernelKind kind) {
  static std::atomic<int> cache[2][2][4] = {};
  std::atomic<int>& slot = cache[d == 128 ? 1 : 0][two_tiles ? 1 : 0][static_cast<int>(kind)];
  int n = slot.load(std::memory_order_relaxed);
  if (n > 0) return n;
  if (d == 64) {
    n = two_tiles ? internal::AttentionCtasPerSm<64, 2>(kind)
                  : internal::AttentionCtasPerSm<64, 1>(kind);
  } else {
    n = two_tiles ? internal::AttentionCtasPerSm<128, 2>(kind)
                  : internal::AttentionCtasPerSm<128, 1>(kind);
  }
  if (n < 0) return CudaStatus(-n, "occupancy");
  n = std::max(n, 1);
  slot.store(n, std::memory_order_relaxed);
  return n;
}

// Split of `tokens` per (sequence, KV head) pair into chunks of one of `lengths` (at most
// max_chunks of them) for `pairs` pairs on `sms` SMs of `per_sm` resident CTAs each: minimizes
// waves * (chunk * balance + per-CTA overhead) + part_cost_tokens per part, i.e. the length of
// the longest CTA queue, so that the last wave is not a partial one (NOTES.md, run 1), plus what
// each part adds to the step beyond its own tokens: its CTA's prologue and partial write and the
// merge's read of it. balance = the most CTAs on one SM over the mean (at least one): co-resident
// CTAs share their SM, so the SMs that hold one CTA more than the others set the time (NOTES.md,
// run 12: 54 chunks of 2432 tokens, 3 or 4 per SM, were slower than both 64 x 2048 and
// 43 x 3072).
// max_chunk (0: none) bounds the chunk length where max_chunks allows it; where it does not, the
// shortest length that does. The chosen count's chunks then share the tokens evenly, in multiples
// of `quantum` and at least min_chunk (2 x 3968 rather than 4096 + 3776 at 7872 tokens: the
// longest chunk sets the time).
struct Split {
  int chunks = 0;
  int chunk_tokens = kChunkQuantum;
};

Split ChooseSplit(int64_t tokens, int64_t pairs, int sms, int per_sm,
                  const std::vector<int>& lengths, int max_chunks, double part_cost_tokens,
                  int max_chunk, int quantum, int min_chunk) {
  constexpr double kCtaOverheadTokens = 256;  // per wave, in token-equivalents
  Split best;
  if (tokens <= 0) return best;
  double best_cost = 0;
  for (const int chunk : lengths) {
    const int64_t actual = (tokens + chunk - 1) / chunk;
    if (actual > max_chunks || (max_chunk > 0 && chunk > max_chunk)) continue;
    const int64_t ctas = pairs * actual;
    const int64_t waves = (ctas + int64_t{sms} * per_sm - 1) / (int64_t{sms} * per_sm);
    const double mean = std::max(1.0, static_cast<double>(ctas) / sms);
    const double balance = static_cast<double>((ctas + sms - 1) / sms) / mean;
    const double cost = static_cast<double>(waves) * (chunk * balance + kCtaOverheadTokens) +
                        static_cast<double>(actual) * part_cost_tokens;
    if (best.chunks == 0 || cost <= best_cost) {  // a tie: the longer chunk, fewer parts
      best.chunks = static_cast<int>(actual);
      best.chunk_tokens = chunk;
      best_cost = cost;
    }
  }
  for (auto it = lengths.begin(); best.chunks == 0 && it != lengths.end(); ++it) {  // ascending
    const int64_t actual = (tokens + *it - 1) / *it;
    if (actual <= max_chunks) best.chunks = static_cast<int>(actual);
  }
  if (best.chunks > 0) {
    best.chunk_tokens =
        std::max(min_chunk, RoundUp((tokens + best.chunks - 1) / best.chunks, quantum));
  }
  return best;
}

// Candidate lengths, ascending, each a multiple of `quantum` and at least min_chunk, including
// the shortest that needs at most max_chunks chunks. Even: the length of c equal chunks for every
// c (the BF16 tiers). Ladder: 2^k and 3 * 2^k times kHistoryQuantum, and min_chunk itself (the
// history: no length between two rungs measured faster than both, and the model's errors are
// largest there: NOTES.md, run 12).
std::vector<int> EvenLengths(int64_t tokens, int min_chunk, int max_chunks, int quantum) {
  std::vector<int> out;
  const int64_t c_max =
      std::max<int64_t>(1, std::min<int64_t>(max_chunks, (tokens + quantum - 1) / quantum));
  for (int64_t c = c_max; c >= 1; --c) {
    const int chunk = std::max(min_chunk, RoundUp((tokens + c - 1) / c, quantum));
    if (out.empty() || chunk > out.back()) out.push_back(chunk);
  }
  return out;
}

std::vector<int> LadderLengths(int64_t tokens, int min_chunk, int max_chunks, int quantum) {
  const int64_t whole = RoundUp(tokens, quantum);
  std::vector<int> out{
      RoundUp(min_chunk, quantum),
      RoundUp(std::max<int64_t>(min_chunk, (tokens + max_chunks - 1) / max_chunks), quantum)};
  for (int64_t rung = kHistoryQuantum; rung < whole; rung *= 2) {
    for (const int64_t len : {rung, 3 * rung / 2}) {
      if (len > min_chunk && len < whole) out.push_back(RoundUp(len, quantum));
    }
  }
  out.push_back(static_cast<int>(std::max<int64_t>(whole, out.front())));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// Part costs of ChooseSplit. The history's: at batch 1 the split into the most chunks that fill
// one wave (62 x 128 tokens at 8K) was up to 30 % slower than 11 x 768; with half the head dim
// per part the ladder's choice was at most 11 % slower than the fastest forced split at the
// benchmarked shapes, and faster than or within 2 % of the previous model's choice (NOTES.md,
// run 12). The BF16 tiers' (at most a few hundred tokens) was not re-measured.
constexpr double kHistoryPartCostPerDim = 0.5;
constexpr double kBf16PartCostTokens = 2;

// Whether a path under `choice` runs, `by_shape` being the measured rule.
bool Takes(PathChoice choice, bool by_shape) {
  switch (choice) {
    case PathChoice::kAlways:
      return true;
    case PathChoice::kNever:
      return false;
    case PathChoice::kByShape:
      break;
  }
  return by_shape;
}

absl::StatusOr<Plan> MakePlan(const DecodeAttentionShape& s, const PagedKvBatch& b) {
  KVPOOL_RETURN_IF_ERROR(CheckShape(s, b));
  int device = 0;
  int sms = 0;
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count"));
  const AttentionTuning& tuning = s.tuning;
  const int kv_heads = b.history_pool.layout.kv_heads;
  const int head_dim = b.history_pool.layout.head_dim;
  Plan p;
  p.group = s.q_heads / kv_heads;
  p.large_group = p.group > kMaxHistoryGroup;
  p.history_narrow = !p.large_group && p.group <= kMaxNarrowGroup && tuning.narrow_layout;
  const int64_t pairs = static_cast<int64_t>(b.num_seqs) * kv_heads;
  // A CTA per (sequence, KV head) group merges faster than the kernels that spread the merge
  // over more CTAs only once those groups alone fill the SMs (NOTES.md, runs 7 and 8).
  const bool groups_fill_sms = pairs >= sms;
  p.merge_per_group = !p.large_group && Takes(tuning.group_merge, groups_fill_sms);
  if (b.max_bf16_tokens > 0) {
    KVPOOL_ASSIGN_OR_RETURN(const int per_sm,
                            CtasPerSm(head_dim, p.large_group, AttentionKernelKind::kBf16Tiers));
    const Split t = ChooseSplit(
        b.max_bf16_tokens, pairs, sms, per_sm,
        EvenLengths(b.max_bf16_tokens, kChunkQuantum, kMaxBf16Parts, kChunkQuantum), kMaxBf16Parts,
        kBf16PartCostTokens, /*max_chunk=*/0, kChunkQuantum, kChunkQuantum);
    p.bf16_chunks = t.chunks;
    p.bf16_chunk_tokens = t.chunk_tokens;
  }
  if (b.max_history_tokens > 0) {
    const AttentionKernelKind kind = p.large_group      ? AttentionKernelKind::kHistoryLargeGroup
                                     : p.history_narrow ? AttentionKernelKind::kHistoryNarrow
                                                        : AttentionKernelKind::kHistory;
    KVPOOL_ASSIGN_OR_RETURN(const int per_sm, CtasPerSm(head_dim, p.large_group, kind));
    const int max_chunks = kMaxParts - p.bf16_chunks;
    const int min_chunk = std::max(2 * kChunkQuantum, tuning.min_history_chunk_tokens);
    const int quantum = p.large_group ? kChunkQuantum : kHistoryQuantum;
    const Split h = ChooseSplit(b.max_history_tokens, pairs, sms, per_sm,
                                LadderLengths(b.max_history_tokens, min_chunk, max_chunks, quantum),
                                max_chunks, kHistoryPartCostPerDim * head_dim,
                                tuning.max_history_chunk_tokens, quantum, min_chunk);
    p.history_chunks = h.chunks;
    p.history_chunk_tokens = h.chunk_tokens;
  }
  p.num_parts = p.history_chunks + p.bf16_chunks;
  p.tail_merge = !p.large_group && p.num_parts > 0 && Takes(tuning.tail_merge, groups_fill_sms);
  const size_t rows = static_cast<size_t>(b.num_seqs) * s.q_heads;
  const size_t d = b.history_pool.layout.head_dim;
  auto take = [&](size_t bytes) {
    const size_t at = p.total;
    p.total += (bytes + 255) / 256 * 256;
    return at;
  };
  p.q_rot = take(rows * d * sizeof(float));
  p.q_sum = take(rows * sizeof(float));
  p.q_scale = take(rows * sizeof(float));
  p.part_out = take(rows * std::max(p.num_parts, 1) * d * sizeof(float));
  p.part_lse = take(rows * std::max(p.num_parts, 1) * sizeof(float));
  if (p.tail_merge) p.counters = take(pairs * sizeof(int32_t));
  return p;
}

absl::Status CheckTier(const PagedKvTier& t, const char* name) {
  if (t.block_tables == nullptr || t.first_token == nullptr || t.num_tokens == nullptr ||
      t.block_table_stride < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", name, " tier needs block tables, ", "first tokens and token counts"));
  }
  return absl::OkStatus();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

absl::StatusOr<size_t> DecodeAttentionWorkspaceBytes(const DecodeAttentionShape& shape,
                                                     const PagedKvBatch& batch) {
  KVPOOL_ASSIGN_OR_RETURN(const Plan plan, MakePlan(shape, batch));
  return plan.total;
}

absl::StatusOr<DecodeAttentionSplit> DecodeAttentionSplitOf(const DecodeAttentionShape& shape,
                                                            const PagedKvBatch& batch) {
  KVPOOL_ASSIGN_OR_RETURN(const Plan plan, MakePlan(shape, batch));
  return DecodeAttentionSplit{plan.history_chunks, plan.history_chunk_tokens, plan.bf16_chunks,
                              plan.bf16_chunk_tokens};
}

absl::Status DecodeAttention(const DecodeAttentionShape& shape, const PagedKvBatch& batch,
                             const DecodeIo& io, void* workspace, size_t workspace_bytes,
                             Stream stream) {
  KVPOOL_ASSIGN_OR_RETURN(const Plan plan, MakePlan(shape, batch));
  if (workspace == nullptr || workspace_bytes < plan.total) {
    return absl::FailedPreconditionError(
        absl::StrCat("decode attention needs ", plan.total, " workspace bytes"));
  }
  if (io.queries == nullptr || io.out == nullptr || io.lse == nullptr) {
    return absl::InvalidArgumentError("queries, out and lse must be device pointers");
  }
  if ((io.rotation_k != nullptr && !Aligned16(io.rotation_k)) ||
      (io.rotation_v != nullptr && !Aligned16(io.rotation_v))) {
    return absl::InvalidArgumentError("rotations must be 16-byte aligned");
  }
  if (batch.max_history_tokens > 0) KVPOOL_RETURN_IF_ERROR(CheckTier(batch.history, "history"));
  if (batch.max_bf16_tokens > 0) {
    KVPOOL_RETURN_IF_ERROR(CheckTier(batch.sink, "sink"));
    KVPOOL_RETURN_IF_ERROR(CheckTier(batch.recent, "recent"));
  }
  const int d = batch.history_pool.layout.head_dim;
  AttentionParams p{};
  p.int2_pool = batch.history_pool.pool;
  p.int2_geo = MakeGeometry(batch.history_pool);
  if (batch.max_bf16_tokens > 0) {
    p.bf16_pool = batch.bf16_pool.pool;
    p.bf16_geo = MakeGeometry(batch.bf16_pool);
  }
  p.sink = batch.sink;
  p.history = batch.history;
  p.recent = batch.recent;
  p.num_seqs = batch.num_seqs;
  p.q_heads = shape.q_heads;
  p.kv_heads = batch.history_pool.layout.kv_heads;
  p.group = plan.group;
  p.scale_is_bf16 = shape.cfg.scale_dtype == ScaleDtype::kBf16 ? 1 : 0;
  p.softmax_scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(d)));
  p.queries = io.queries;
  p.rotation_k = io.rotation_k;
  p.rotation_v = io.rotation_v;
  auto* base = static_cast<uint8_t*>(workspace);
  p.q_rot = reinterpret_cast<float*>(base + plan.q_rot);
  p.q_sum = reinterpret_cast<float*>(base + plan.q_sum);
  p.q_scale = reinterpret_cast<float*>(base + plan.q_scale);
  p.part_out = reinterpret_cast<float*>(base + plan.part_out);
  p.part_lse = reinterpret_cast<float*>(base + plan.part_lse);
  p.merge_counters = plan.tail_merge ? reinterpret_cast<int32_t*>(base + plan.counters) : nullptr;
  p.num_parts = plan.num_parts;
  p.history_chunks = plan.history_chunks;
  p.history_chunk_tokens = plan.history_chunk_tokens;
  p.bf16_chunks = plan.bf16_chunks;
  p.bf16_chunk_tokens = plan.bf16_chunk_tokens;
  p.out = io.out;
  p.lse = io.lse;
  p.use_pdl = shape.tuning.programmatic_launch ? 1 : 0;
  p.merge_per_group = plan.merge_per_group ? 1 : 0;
  p.bf16_after_history = p.use_pdl != 0 && plan.history_chunks > 0 && plan.bf16_chunks > 0 &&
                                 shape.tuning.tiers_beside_history
                             ? 1
                             : 0;
  p.history_narrow = plan.history_narrow ? 1 : 0;
  {
    // Asynchronous 16-byte copies of whole head segments: blocks of 16 tokens whose segment
    // (K codes, V codes, K meta, V meta) is laid out exactly like a stage, 16-byte aligned, in
    // blocks whose size fits the kernel's 32-bit block offsets.
    const internal::BlockGeometry& g = p.int2_geo;
    const int64_t row = g.head_dim / 4;
    const bool stage_layout = g.tokens == 16 && g.head_segment_bytes == 32 * row + 128 &&
                              g.codes_offset[0] == 0 && g.codes_offset[1] == 16 * row &&
                              g.meta_offset[0] == 32 * row && g.meta_offset[1] == 32 * row + 64;
    p.history_async_copies = stage_layout && Aligned16(p.int2_pool) && g.block_bytes % 16 == 0 &&
                                     g.block_bytes <= std::numeric_limits<uint32_t>::max() &&
                                     shape.tuning.history_async_copies
                                 ? 1
                                 : 0;
  }
  const bool two_tiles = plan.large_group;
  int err = 0;
  if (d == 64) {
    err = two_tiles ? internal::LaunchDecodeAttention<64, 2>(p, stream)
                    : internal::LaunchDecodeAttention<64, 1>(p, stream);
  } else {
    err = two_tiles ? internal::LaunchDecodeAttention<128, 2>(p, stream)
                    : internal::LaunchDecodeAttention<128, 1>(p, stream);
  }
  return CudaStatus(err, "DecodeAttention launch");
}

}  // namespace kvpool::cuda
