// The CUDA codec: quantize K/V rows into paged blocks on arrival, and dequantize blocks to BF16,
// with the same semantics and block format as the CPU RowCodec (kernels/row_codec.h,
// kernels/block_layout.h). This header has no CUDA types, so code built without nvcc (the
// server) can include it; the pointers it takes are device pointers. Pools are PagedKvViews, the
// pool view of the paged KV description (kernels/paged_kv.h).
//
//   PagedKvView kv{pool, BlockLayout::ForModel(cfg, 8, 128), cfg.scale_dtype, num_blocks};
//   SequenceBatch batch{1, d_row_offsets, d_first_token, d_block_table, max_blocks, n};
//   ArrivalRows in{d_rows, d_rotation_k, /*rotated_rows=*/nullptr};
//   KVPOOL_RETURN_IF_ERROR(QuantizeOnArrival(cfg, kv, batch, KvTensor::kKey, in, d_err, stream));
//   KVPOOL_RETURN_IF_ERROR(TakeCodecErrors(d_err, stream));   // waits for the stream
//
// Thread-safety: the functions keep no state; calls on one stream run in order, calls that
// write the same blocks from different streams race.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"
#include "kernels/cuda/kernel_tuning.h"
#include "kernels/paged_kv.h"

struct CUstream_st;

namespace kvpool::cuda {

// A CUDA stream (cudaStream_t); nullptr is the legacy default stream.
using Stream = CUstream_st*;

// Rows of several sequences, each a run of consecutive tokens. Sequence i owns the input rows
// [row_offsets[i], row_offsets[i+1]); its r-th row is the token at position
// p = first_token[i] + r of the sequence, stored in block block_tables[i * block_table_stride +
// p / T] at slot p % T (T = layout.tokens). All three arrays are device int32.
struct SequenceBatch {
  int num_seqs = 0;
  const int32_t* row_offsets = nullptr;   // [num_seqs + 1], row_offsets[0] = 0, non-decreasing
  const int32_t* first_token = nullptr;   // [num_seqs]
  const int32_t* block_tables = nullptr;  // [num_seqs][block_table_stride]
  int block_table_stride = 0;
  int total_rows = 0;  // row_offsets[num_seqs], known on the host
};

// Input rows that already sit in BF16 pages of a pool (the recent window, on demotion): input
// row r of sequence i of the batch is the token first_token[i] + r of `kv`, found through
// block_tables. `kv` has a BF16 layout (bits 16) with the destination's kv_heads and head_dim.
// The batch's row_offsets count the rows of both sides.
struct PagedRows {
  PagedKvView kv;
  const int32_t* first_token = nullptr;   // [num_seqs], device
  const int32_t* block_tables = nullptr;  // [num_seqs][block_table_stride], device
  int block_table_stride = 0;
};

// Input of QuantizeOnArrival: `rows`, or `paged` (then `rows` must be null).
//
// `page_checksums` (optional, device, 4-byte aligned) has the shape of the batch's block tables,
// [num_seqs][block_table_stride]: the kernel adds to entry i * stride + j the page checksum terms
// (kernels/page_checksum.h) of every word it stores in the page block_tables[i * stride + j], in
// the same launch (no second pass over the pool). Zeroed by the caller, the entry ends as the
// PageSlotsChecksum of the slots written there once both K and V are written (the sum is
// additive over tensors and slots). A row that fails (error_word) adds nothing.
struct ArrivalRows {
  const uint16_t* rows = nullptr;      // BF16 [total_rows][Hkv][D], original (unrotated) basis
  const float* rotation = nullptr;     // D x D fp32 row-major, x_rot = x * M; nullptr = identity
  uint16_t* rotated_rows = nullptr;    // optional out: the rotated rows rounded to BF16
  const PagedRows* paged = nullptr;    // the rows read from BF16 pages instead of `rows`
  uint32_t* page_checksums = nullptr;  // optional out: running page checksums, see above
};

// Rotates each row by `rotation`, rounds it to BF16, clips it (exact order statistic),
// quantizes and packs it into its slot of the paged blocks. Enqueued on `stream`; returns
// InvalidArgument at once for bad shapes or settings (then nothing is enqueued). Data errors found
// by the kernel (a non-finite rotated row, a scale or min overflowing the 16-bit type, a block id
// outside [0, num_blocks)) are ORed into the device word `error_word` and reported by
// TakeCodecErrors; such a row's slot is left unwritten, all other rows are written. `tuning`
// chooses between kernels with equal results (kernel_tuning.h).
[[nodiscard]] absl::Status QuantizeOnArrival(const QuantConfig& cfg, const PagedKvView& kv,
                                             const SequenceBatch& batch, KvTensor tensor,
                                             const ArrivalRows& in, uint32_t* error_word,
                                             Stream stream, const ArrivalTuning& tuning = {});

// One QuantizeOnArrival call's arguments.
struct ArrivalJob {
  QuantConfig cfg;
  PagedKvView kv;
  SequenceBatch batch;
  KvTensor tensor = KvTensor::kKey;
  ArrivalRows in;
};

// QuantizeOnArrival for every job, in one launch when they all take the tensor-core arrival
// kernel at one head dim (at most 6 jobs: a chunk's K and V of its sink, history and recent
// runs), else one launch per job: a launch has a fixed cost that is most of a small chunk's
// arrival time (kernels/cuda/NOTES.md, run 6). The jobs must write disjoint rows; the results
// equal per-job calls.
[[nodiscard]] absl::Status QuantizeOnArrivalJobs(absl::Span<const ArrivalJob> jobs,
                                                 uint32_t* error_word, Stream stream,
                                                 const ArrivalTuning& tuning = {});

// Demotion of recent-window tokens: re-quantizes the BF16 rows `from` (already rotated, so no
// rotation) into their history slots named by `to`, K and V, in one launch for any number of
// sequences and layers (a layer's blocks are just other block ids; two launches for the
// configurations that the tensor-core arrival kernel does not take). Codes equal
// QuantizeOnArrival of the same rows with the identity rotation. Errors as for QuantizeOnArrival;
// a block id of `from` outside its pool is reported like one of `to`. `page_checksums`, when set,
// as ArrivalRows::page_checksums for the batch `to` (K and V both add to it).
[[nodiscard]] absl::Status DemoteToHistory(const QuantConfig& cfg, const PagedKvView& history,
                                           const SequenceBatch& to, const PagedRows& from,
                                           uint32_t* error_word, Stream stream,
                                           const ArrivalTuning& tuning = {},
                                           uint32_t* page_checksums = nullptr);

// Dequantizes the stored rows named by `batch` (tokens first_token[i] + r, r in
// [0, row_offsets[i+1] - row_offsets[i])) to BF16 [total_rows][Hkv][D] in the rotated basis:
// x = min + code * scale in fp32, rounded to nearest even (BF16 bypass blocks are copied).
// Block ids outside [0, num_blocks) are reported through `error_word` (the row is left
// unwritten).
[[nodiscard]] absl::Status DequantizeToBf16(const QuantConfig& cfg, const PagedKvView& kv,
                                            const SequenceBatch& batch, KvTensor tensor,
                                            uint16_t* out, uint32_t* error_word, Stream stream);

// DequantizeToBf16, then back to the original basis for engines without an INT2 kernel that
// attend in the model's own basis: x = x_rot * U in fp32 from the decoded values, rounded to
// nearest even. U is the inverse of the rows' rotation M (M^T: rotations are orthogonal), D x D
// fp32 row-major, 16-byte aligned.
[[nodiscard]] absl::Status DequantizeToOriginalBf16(const QuantConfig& cfg, const PagedKvView& kv,
                                                    const SequenceBatch& batch, KvTensor tensor,
                                                    const float* unrotation, uint16_t* out,
                                                    uint32_t* error_word, Stream stream);

// Waits for `stream`, reads the device error word, resets it to 0 and turns it into a status:
// OK, InvalidArgument (non-finite row), OutOfRange (scale/min overflow, bad block id), or the
// CUDA error of the stream.
[[nodiscard]] absl::Status TakeCodecErrors(uint32_t* error_word, Stream stream);

// Number of CUDA devices, 0 when there is no driver or device.
int CudaDeviceCount();

}  // namespace kvpool::cuda
