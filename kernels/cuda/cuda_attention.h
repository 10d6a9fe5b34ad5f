// INT2 paged decode attention on the GPU: one decode step of one layer for a batch of
// sequences of different lengths, over the BF16 sink, the INT2 history and the BF16 recent
// window, with an exact log-sum-exp merge (docs/oscar-method.md section 11,
// kernels/attention.h). The batch is the paged KV description (kernels/paged_kv.h) with its
// arrays in device memory.
// No CUDA types here; all pointers are device pointers.
//
//   DecodeAttentionShape shape{cfg, /*q_heads=*/64};
//   size_t bytes = *DecodeAttentionWorkspaceBytes(shape, batch);   // cudaMalloc it once
//   KVPOOL_RETURN_IF_ERROR(DecodeAttention(shape, batch, io, workspace, bytes, stream));
//
// Semantics, per sequence b and query head j (KV head j / (Hq / Hkv)), with q' = q * M_K:
//   l_t = q'_j . k'_t / sqrt(D) over the sink, history and recent tokens;
//   lse_j = ln sum_t exp(l_t);   out_j = (sum_t exp(l_t - lse_j) v'_t) * M_V^T
// INT2 rows are dequantized as min + code * scale (folded: the kernel never forms them); an
// empty sequence gives lse = -inf and a zero output. Precision: q'.k runs on fp16 tensor cores
// with fp32 accumulation, the query split into two fp16 terms (hi + lo, about 22 bits) so that
// the logits and the log-sum-exp keep fp32-like accuracy; P * scale enters the PV product as
// fp16 (relative output error well under 1e-2 against float64 on the dequantized data).
//
// Supported: head_dim 64 or 128; INT2 uniform or Lloyd-Max history with one group per row
// (G = D); GQA groups of 1 to 16 query heads per KV head. Others are Unimplemented.
// Thread-safety: stateless; concurrent calls need separate workspaces.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/codec_config.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/cuda/kernel_tuning.h"
#include "kernels/paged_kv.h"

namespace kvpool::cuda {

// The model and the kernels' settings. With the batch's pools, sequence count and token bounds
// (PagedKvBatch) they decide the kernels, the split of the work and the workspace size.
struct DecodeAttentionShape {
  QuantConfig cfg;  // of the history pool's blocks
  int q_heads = 0;
  AttentionTuning tuning;  // the measured defaults unless a caller chooses otherwise
};

struct DecodeIo {
  const float* queries = nullptr;     // [num_seqs][q_heads][D] fp32, original basis
  const float* rotation_k = nullptr;  // D x D fp32 row-major (16-byte aligned); nullptr = I
  const float* rotation_v = nullptr;  // D x D fp32 row-major (16-byte aligned); nullptr = I
  float* out = nullptr;               // [num_seqs][q_heads][D] fp32, original basis
  float* lse = nullptr;               // [num_seqs][q_heads], natural log
};

// Device workspace bytes DecodeAttention needs for `shape` and `batch` (its pools, num_seqs and
// token bounds; the arrays are not read) on the current device. InvalidArgument / Unimplemented
// as DecodeAttention.
[[nodiscard]] absl::StatusOr<size_t> DecodeAttentionWorkspaceBytes(
    const DecodeAttentionShape& shape, const PagedKvBatch& batch);

// How DecodeAttention splits each (sequence, KV head) group's tokens into chunks, one CTA each:
// the count and length of the INT2 history chunks and of the BF16 tier chunks (0 chunks: the
// tier has no work). For logs and benchmarks; errors as DecodeAttentionWorkspaceBytes.
struct DecodeAttentionSplit {
  int history_chunks = 0;
  int history_chunk_tokens = 0;
  int bf16_chunks = 0;
  int bf16_chunk_tokens = 0;
};
[[nodiscard]] absl::StatusOr<DecodeAttentionSplit> DecodeAttentionSplitOf(
    const DecodeAttentionShape& shape, const PagedKvBatch& batch);

// Enqueues the decode step on `stream` (two to four kernel launches: the query rotation, the
// INT2 history and BF16 tier kernels of the tiers with work, and a merge kernel unless the
// attention kernels merge; capturable in a CUDA graph).
// InvalidArgument for inconsistent shapes or null pointers, Unimplemented for unsupported
// settings, FailedPrecondition if `workspace_bytes` is too small. Token counts above the
// batch's bounds are not detected (the excess tokens are ignored).
[[nodiscard]] absl::Status DecodeAttention(const DecodeAttentionShape& shape,
                                           const PagedKvBatch& batch, const DecodeIo& io,
                                           void* workspace, size_t workspace_bytes, Stream stream);

}  // namespace kvpool::cuda
