// Host side of the CUDA codec: argument checks, the block geometry, and the one central
// dispatch from run-time head_dim to the instantiated kernels (codec_d*.cu).
#include "kernels/cuda/cuda_codec.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/codec_params.h"
#include "kernels/cuda/host_internal.h"

namespace kvpool::cuda {
namespace {

using internal::ArrivalParams;
using internal::BatchParams;
using internal::DequantParams;
using internal::MakeGeometry;

bool IsPowerOfTwo(int v) { return v > 0 && (v & (v - 1)) == 0; }

bool SameLayout(const BlockLayout& a, const BlockLayout& b) {
  return a.tokens == b.tokens && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim &&
         a.group_size == b.group_size && a.bits == b.bits;
}

// The pool pointer, block count and stride of a view; `what` prefixes the messages.
absl::Status CheckArena(const PagedKvView& kv, const char* what) {
  if (kv.pool == nullptr || reinterpret_cast<uintptr_t>(kv.pool) % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "pool must be a non-null, 16-byte aligned device pointer"));
  }
  if (kv.num_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(what, "num_blocks must be >= 1"));
  }
  if (kv.block_stride < 0 || kv.block_stride % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "block_stride ", kv.block_stride, " must be 0 or a multiple of 16"));
  }
  return absl::OkStatus();
}

absl::Status CheckModel(const QuantConfig& cfg, const PagedKvView& kv) {
  const BlockLayout& l = kv.layout;
  if (!IsSupportedHeadDim(l.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported head_dim ", l.head_dim));
  }
  KVPOOL_RETURN_IF_ERROR(cfg.Validate(l.head_dim));
  if (l.kv_heads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("kv_heads must be >= 1, got ", l.kv_heads));
  }
  if (!SameLayout(l, BlockLayout::ForModel(cfg, l.kv_heads, l.head_dim))) {
    return absl::InvalidArgumentError("block layout does not match the model's QuantConfig");
  }
  if (kv.scale_dtype != cfg.scale_dtype) {
    return absl::InvalidArgumentError("scale dtype does not match the model's QuantConfig");
  }
  if (l.bits != 16) {
    if (!IsPowerOfTwo(l.group_size) || l.head_dim % l.group_size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_size ", l.group_size, " must be a power of two dividing D"));
    }
    if (l.bits != 2 && l.bits != 4) {
      return absl::InvalidArgumentError(absl::StrCat("unsupported bits ", l.bits));
    }
  }
  return CheckArena(kv, "");
}

absl::Status CheckBatch(const SequenceBatch& b) {
  if (b.total_rows < 0 || b.num_seqs < 0) {
    return absl::InvalidArgumentError("negative row or sequence count");
  }
  if (b.total_rows == 0) return absl::OkStatus();
  if (b.num_seqs < 1 || b.row_offsets == nullptr || b.first_token == nullptr ||
      b.block_tables == nullptr || b.block_table_stride < 1) {
    return absl::InvalidArgumentError(
        "a non-empty batch needs sequences, row offsets, first tokens and block tables");
  }
  return absl::OkStatus();
}

BatchParams Batch(const SequenceBatch& b) {
  BatchParams p;
  p.row_offsets = b.row_offsets;
  p.first_token = b.first_token;
  p.block_tables = b.block_tables;
  p.block_table_stride = b.block_table_stride;
  p.num_seqs = b.num_seqs;
  p.total_rows = b.total_rows;
  return p;
}

// c of the clip order statistic (docs/oscar-method.md section 6), -1 when clipping is off.
int ClipRank(float ratio, int head_dim) {
  if (!(ratio > 0.0f)) return -1;
  const float c = std::floor(ratio * static_cast<float>(head_dim));
  if (c < 0.0f) return 0;
  if (c > static_cast<float>(head_dim - 1)) return head_dim - 1;
  return static_cast<int>(c);
}

// Paged input rows: BF16 pages of the destination's shape, and tables for a non-empty batch.
absl::Status CheckPagedRows(const PagedRows& src, const BlockLayout& dst, const SequenceBatch& b) {
  const BlockLayout& l = src.kv.layout;
  if (l.bits != 16 || l.kv_heads != dst.kv_heads || l.head_dim != dst.head_dim || l.tokens < 1) {
    return absl::InvalidArgumentError(
        "paged input rows must be BF16 pages with the destination's kv_heads and head_dim");
  }
  KVPOOL_RETURN_IF_ERROR(CheckArena(src.kv, "paged input "));
  if (b.total_rows > 0 &&
      (src.first_token == nullptr || src.block_tables == nullptr || src.block_table_stride < 1)) {
    return absl::InvalidArgumentError("paged input rows need first tokens and block tables");
  }
  return absl::OkStatus();
}

// The kernel parameters of one arrival call, after checking its arguments.
absl::StatusOr<ArrivalParams> ArrivalParamsOf(const QuantConfig& cfg, const PagedKvView& kv,
                                              const SequenceBatch& batch, KvTensor tensor,
                                              const ArrivalRows& in, uint32_t* error_word,
                                              const ArrivalTuning& tuning) {
  KVPOOL_RETURN_IF_ERROR(CheckModel(cfg, kv));
  KVPOOL_RETURN_IF_ERROR(CheckBatch(batch));
  if (error_word == nullptr) return absl::InvalidArgumentError("error_word is null");
  if (in.paged != nullptr) {
    KVPOOL_RETURN_IF_ERROR(CheckPagedRows(*in.paged, kv.layout, batch));
    if (in.rows != nullptr) {
      return absl::InvalidArgumentError("arrival rows are both flat and paged");
    }
  } else if (batch.total_rows > 0 && in.rows == nullptr) {
    return absl::InvalidArgumentError("input rows are null");
  }
  if (in.rotation != nullptr && reinterpret_cast<uintptr_t>(in.rotation) % 16 != 0) {
    return absl::InvalidArgumentError("rotation must be 16-byte aligned");
  }
  if (reinterpret_cast<uintptr_t>(in.page_checksums) % alignof(uint32_t) != 0) {
    return absl::InvalidArgumentError("page checksums must be 4-byte aligned");
  }
  ArrivalParams p;
  p.geo = MakeGeometry(kv);
  p.batch = Batch(batch);
  p.rows = in.rows;
  p.paged = {};
  if (in.paged != nullptr) {
    p.paged.pool = in.paged->kv.pool;
    p.paged.geo = MakeGeometry(in.paged->kv);
    p.paged.first_token = in.paged->first_token;
    p.paged.block_tables = in.paged->block_tables;
    p.paged.block_table_stride = in.paged->block_table_stride;
  }
  p.rotation = in.rotation;
  p.rotated_rows = in.rotated_rows;
  p.pool = kv.pool;
  p.error_word = error_word;
  p.tensor = static_cast<int32_t>(tensor);
  p.clip_rank = ClipRank(cfg.ClipRatio(tensor), kv.layout.head_dim);
  p.scale_is_bf16 = cfg.scale_dtype == ScaleDtype::kBf16 ? 1 : 0;
  p.lloyd_max = cfg.method == QuantMethod::kLloydMax ? 1 : 0;
  p.use_mma_kernel = tuning.mma_kernel ? 1 : 0;
  p.page_checksums = in.page_checksums;
  return p;
}

int LaunchOne(const ArrivalParams& p, int head_dim, Stream stream) {
  switch (head_dim) {
    case 64:
      return internal::LaunchArrival<64>(p, stream);
    case 128:
      return internal::LaunchArrival<128>(p, stream);
    default:
      return internal::LaunchArrival<0>(p, stream);
  }
}

}  // namespace

absl::Status QuantizeOnArrival(const QuantConfig& cfg, const PagedKvView& kv,
                               const SequenceBatch& batch, KvTensor tensor, const ArrivalRows& in,
                               uint32_t* error_word, Stream stream, const ArrivalTuning& tuning) {
  KVPOOL_ASSIGN_OR_RETURN(const ArrivalParams p,
                          ArrivalParamsOf(cfg, kv, batch, tensor, in, error_word, tuning));
  if (batch.total_rows == 0) return absl::OkStatus();
  return CudaStatus(LaunchOne(p, kv.layout.head_dim, stream), "QuantizeOnArrival launch");
}

absl::Status QuantizeOnArrivalJobs(absl::Span<const ArrivalJob> jobs, uint32_t* error_word,
                                   Stream stream, const ArrivalTuning& tuning) {
  // Every job is checked before anything launches (bad input changes nothing).
  std::vector<std::pair<ArrivalParams, int>> all;  // (params, head_dim) of non-empty jobs
  for (const ArrivalJob& j : jobs) {
    KVPOOL_ASSIGN_OR_RETURN(const ArrivalParams p, ArrivalParamsOf(j.cfg, j.kv, j.batch, j.tensor,
                                                                   j.in, error_word, tuning));
    if (j.batch.total_rows > 0) all.emplace_back(p, j.kv.layout.head_dim);
  }
  if (all.empty()) return absl::OkStatus();
  const int d = all.front().second;
  bool fusable = (d == 64 || d == 128) &&
                 all.size() <= static_cast<size_t>(internal::kMaxArrivalJobs) && tuning.fuse_jobs;
  for (const auto& [p, dim] : all) fusable = fusable && dim == d;
  if (fusable) {
    internal::ArrivalJobsParams fused{};
    for (const auto& [p, dim] : all) fused.job[fused.count++] = p;
    const int err = d == 64 ? internal::LaunchArrivalJobs<64>(fused, stream)
                            : internal::LaunchArrivalJobs<128>(fused, stream);
    if (err != internal::kArrivalNotFused) {
      return CudaStatus(err, "QuantizeOnArrivalJobs launch");
    }
  }
  for (const auto& [p, dim] : all) {
    KVPOOL_RETURN_IF_ERROR(CudaStatus(LaunchOne(p, dim, stream), "QuantizeOnArrival launch"));
  }
  return absl::OkStatus();
}

absl::Status DemoteToHistory(const QuantConfig& cfg, const PagedKvView& history,
                             const SequenceBatch& to, const PagedRows& from, uint32_t* error_word,
                             Stream stream, const ArrivalTuning& tuning, uint32_t* page_checksums) {
  ArrivalJob jobs[2];
  for (int t = 0; t < 2; ++t) {
    jobs[t].cfg = cfg;
    jobs[t].kv = history;
    jobs[t].batch = to;
    jobs[t].tensor = static_cast<KvTensor>(t);
    jobs[t].in.paged = &from;  // rotated already: identity rotation
    jobs[t].in.page_checksums = page_checksums;
  }
  return QuantizeOnArrivalJobs(jobs, error_word, stream, tuning);
}

namespace {

absl::Status Dequantize(const QuantConfig& cfg, const PagedKvView& kv, const SequenceBatch& batch,
                        KvTensor tensor, const float* unrotation, uint16_t* out,
                        uint32_t* error_word, Stream stream) {
  KVPOOL_RETURN_IF_ERROR(CheckModel(cfg, kv));
  KVPOOL_RETURN_IF_ERROR(CheckBatch(batch));
  if (error_word == nullptr) return absl::InvalidArgumentError("error_word is null");
  if (unrotation != nullptr && reinterpret_cast<uintptr_t>(unrotation) % 16 != 0) {
    return absl::InvalidArgumentError("unrotation must be 16-byte aligned");
  }
  if (batch.total_rows == 0) return absl::OkStatus();
  if (out == nullptr) return absl::InvalidArgumentError("output is null");
  DequantParams p;
  p.geo = MakeGeometry(kv);
  p.batch = Batch(batch);
  p.pool = kv.pool;
  p.out = out;
  p.error_word = error_word;
  p.tensor = static_cast<int32_t>(tensor);
  p.scale_is_bf16 = cfg.scale_dtype == ScaleDtype::kBf16 ? 1 : 0;
  p.unrotation = unrotation;
  int err = 0;
  switch (kv.layout.head_dim) {
    case 64:
      err = internal::LaunchDequant<64>(p, stream);
      break;
    case 128:
      err = internal::LaunchDequant<128>(p, stream);
      break;
    default:
      err = internal::LaunchDequant<0>(p, stream);
      break;
  }
  return CudaStatus(err, "dequantization launch");
}

}  // namespace

absl::Status DequantizeToBf16(const QuantConfig& cfg, const PagedKvView& kv,
                              const SequenceBatch& batch, KvTensor tensor, uint16_t* out,
                              uint32_t* error_word, Stream stream) {
  return Dequantize(cfg, kv, batch, tensor, nullptr, out, error_word, stream);
}

absl::Status DequantizeToOriginalBf16(const QuantConfig& cfg, const PagedKvView& kv,
                                      const SequenceBatch& batch, KvTensor tensor,
                                      const float* unrotation, uint16_t* out, uint32_t* error_word,
                                      Stream stream) {
  if (unrotation == nullptr) return absl::InvalidArgumentError("unrotation is null");
  return Dequantize(cfg, kv, batch, tensor, unrotation, out, error_word, stream);
}

absl::Status TakeCodecErrors(uint32_t* error_word, Stream stream) {
  if (error_word == nullptr) return absl::InvalidArgumentError("error_word is null");
  uint32_t bits = 0;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(&bits, error_word, sizeof(bits), cudaMemcpyDeviceToHost, stream),
                 "reading the codec error word"));
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(error_word, 0, sizeof(bits), stream),
                                    "resetting the codec error word"));
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "codec stream"));
  if (bits & internal::kErrorNonFinite) {
    return absl::InvalidArgumentError("a K/V row holds NaN or Inf (after rotation)");
  }
  if (bits & internal::kErrorOutOfRange) {
    return absl::OutOfRangeError(
        "a K/V row has a value of magnitude >= 2^16 (after rotation), or a scale or minimum "
        "overflows the 16-bit scale type");
  }
  if (bits & internal::kErrorBadBlock) {
    return absl::OutOfRangeError("a block table entry is outside the pool");
  }
  return absl::OkStatus();
}

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace kvpool::cuda

namespace kvpool::cuda::internal {

BlockGeometry MakeGeometry(const PagedKvView& kv) {
  const BlockLayout& l = kv.layout;
  BlockGeometry g;
  g.block_bytes = kv.stride_bytes();
  g.head_segment_bytes = static_cast<int64_t>(l.head_segment_bytes());
  for (int t = 0; t < 2; ++t) {
    const auto tensor = static_cast<KvTensor>(t);
    g.codes_offset[t] = static_cast<int64_t>(l.CodesOffset(tensor, 0));
    g.meta_offset[t] = static_cast<int64_t>(l.MetaOffset(tensor, 0));
  }
  g.code_bytes_per_row = static_cast<int32_t>(l.code_bytes_per_row());
  g.meta_bytes_per_row = static_cast<int32_t>(l.meta_bytes_per_row());
  g.tokens = l.tokens;
  g.kv_heads = l.kv_heads;
  g.head_dim = l.head_dim;
  g.group_size = l.bits == 16 ? l.head_dim : l.group_size;
  g.bits = l.bits;
  g.num_blocks = kv.num_blocks;
  return g;
}

}  // namespace kvpool::cuda::internal
