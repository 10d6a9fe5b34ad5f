// Decode attention of one layer over a paged KV batch in host memory (the CPU path): for every
// query row, the query rotated into the stored basis, attention over the BF16 sink, the BF16
// recent window and the stored history (per-tier passes of kernels/attention.h merged through
// the log-sum-exp, in that order), and the output un-rotated into the original basis. The GPU
// twin is kvpool::cuda::DecodeAttention (kernels/cuda/cuda_attention.h), same batch, same
// semantics; kvpoold's CPU backend and the C API (kernels/capi/) both call this one.
//
//   PagedAttentionModel model{{/*q_heads=*/64, /*kv_heads=*/8, /*head_dim=*/128}, &codec};
//   PagedAttentionRotation rotation;               // identity
//   rotation.k = mk; rotation.v = mv;              // or the layer's D x D matrices
//   KVPOOL_RETURN_IF_ERROR(PagedDecodeAttention(model, batch, rotation, {q, out, lse}));
//
// Semantics per query row i and head j (KV head j / (Hq / Hkv)), q' = q M_K:
//   l_t = q'_j . k'_t / sqrt(D) over the row's sink, recent and history tokens;
//   lse_j = ln sum_t exp(l_t);   out_j = (sum_t exp(l_t - lse_j) v'_t) M_V^T
// An empty row gives lse = -inf and a zero output. Arithmetic: fp32 (kernels/attention.h).
//
// Everything is checked before anything is written: on error `io.out` and `io.lse` are untouched.
// Thread-safety: reentrant (no shared state); concurrent calls may share inputs.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/attention.h"
#include "kernels/paged_kv.h"
#include "kernels/rotation.h"
#include "kernels/row_codec.h"

namespace kvpool {

// The model side of a call: the attention shape and the codec of the history pool's blocks
// (batch.history_pool.layout must be BlockLayout::ForModel(codec.config(), Hkv, D)).
struct PagedAttentionModel {
  AttentionShape shape;
  const RowCodec* history_codec = nullptr;
};

// The layer's rotations: a RotationSet and a layer (kvpoold's models, whatever their kind), or
// else dense D x D fp32 matrices, row-major, x_rot = x * M (nullptr: identity). The dense product
// accumulates each value in fp32 with fused multiply-adds over k = 0..D-1 in order from +0, as
// RotationSet's dense kind does. Matrices are used as given (not checked for orthogonality).
struct PagedAttentionRotation {
  const RotationSet* set = nullptr;
  int layer = 0;
  const float* k = nullptr;
  const float* v = nullptr;
};

// Host buffers of the batch's rows, in the original (unrotated) basis.
struct PagedAttentionIo {
  const float* queries = nullptr;  // [num_seqs][q_heads][D]
  float* out = nullptr;            // [num_seqs][q_heads][D]
  float* lse = nullptr;            // [num_seqs][q_heads], natural log
};

// Attends every row of `batch` (pools and arrays in host memory). InvalidArgument, naming the
// offending value, for: an invalid shape or codec, pool layouts that do not match them, a
// negative count, first token or block stride, a tier that runs past its block table row, a
// block id outside [0, num_blocks) of its pool, counts above the batch's token bounds, null
// pointers where data is read or written, a RotationSet of another head_dim or without `layer`.
[[nodiscard]] absl::Status PagedDecodeAttention(const PagedAttentionModel& model,
                                                const PagedKvBatch& batch,
                                                const PagedAttentionRotation& rotation,
                                                const PagedAttentionIo& io);

}  // namespace kvpool
