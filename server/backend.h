// ComputeBackend: where kvpoold's pool memory lives and what runs the codec math on it.
//
// The CPU backend (cpu_backend.h) is the embedded default: host memory and the kernels/ CPU code.
// A CUDA backend implements the same interface later (device arena, CUDA kernels), registered by
// name in CreateBackend; nothing here changes with build flags.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<ComputeBackend> backend, CreateBackend("cpu"));
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Arena> arena, backend->AllocateArena(1 << 30));
//   KVPOOL_RETURN_IF_ERROR(backend->RotateRows(rotations, layer, KvTensor::kKey, in, out));
//
// Thread-safety: a backend is shared by all worker threads; every method must be safe to call
// concurrently (on disjoint output memory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/attention.h"
#include "kernels/bf16.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"
#include "kernels/rotation.h"
#include "kernels/row_codec.h"

namespace kvpool::server {

// One contiguous allocation holding the whole block pool.
class Arena {
 public:
  virtual ~Arena() = default;
  virtual uint8_t* data() const = 0;
  virtual size_t size() const = 0;
  // Whether the CPU may read and write data() directly.
  virtual bool host_accessible() const = 0;
};

// BF16 rows of one tier segment in pool memory: K and V, each [tokens][kv_heads][head_dim].
struct Bf16Segment {
  const Bf16* k = nullptr;
  const Bf16* v = nullptr;
  int tokens = 0;
};

// What one sequence's layer holds, as pointers into pool memory, for attention.
struct SequenceTiers {
  std::vector<Bf16Segment> bf16;               // sink and recent pieces (order irrelevant)
  std::vector<const uint8_t*> history_blocks;  // INT2 blocks in history order
  int history_tokens = 0;
};

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;

  virtual absl::string_view name() const = 0;

  // The pool's memory, `bytes` long. ResourceExhausted when it cannot be had.
  virtual absl::StatusOr<std::unique_ptr<Arena>> AllocateArena(size_t bytes) = 0;

  // Arrival path: BF16 rows (multiple of D values) rotated by (layer, t) and rounded to BF16.
  // An identity rotation copies bits unchanged (so exactness holds for -0 too).
  virtual absl::Status RotateRows(const RotationSet& rotations, int layer, KvTensor t,
                                  absl::Span<const Bf16> in, absl::Span<Bf16> out) = 0;
  // fp32 rows times M (queries) or times M^T (outputs), in place of a separate output.
  virtual absl::Status RotateFloat(const RotationSet& rotations, int layer, KvTensor t,
                                   absl::Span<const float> in, absl::Span<float> out) = 0;
  virtual absl::Status UnrotateFloat(const RotationSet& rotations, int layer, KvTensor t,
                                     absl::Span<const float> in, absl::Span<float> out) = 0;

  // Clip + quantize rotated rows [n][kv_heads][D] into tokens [first_token, first_token + n) of
  // a pool block (RowCodec::EncodeIntoBlock semantics: nothing written on error).
  virtual absl::Status EncodeIntoBlock(const RowCodec& codec, KvTensor t, const BlockLayout& layout,
                                       absl::Span<const Bf16> rows, int first_token,
                                       uint8_t* block) = 0;
  // Decodes tokens [first_token, first_token + count) of a pool block to fp32 rows.
  virtual void DecodeFromBlock(const RowCodec& codec, KvTensor t, const BlockLayout& layout,
                               const uint8_t* block, int first_token, int count,
                               absl::Span<float> out) = 0;

  // Byte copies into and out of pool memory.
  virtual void CopyToPool(uint8_t* dst, const void* src, size_t bytes) = 0;
  virtual void CopyFromPool(void* dst, const uint8_t* src, size_t bytes) = 0;

  // Decode attention of rotated queries `q` ([Hq][D]) over one sequence's tiers; output in the
  // rotated V basis, natural-log LSE per head.
  virtual AttentionOutput Attend(const AttentionShape& shape, const RowCodec& codec,
                                 const BlockLayout& layout, const SequenceTiers& tiers,
                                 absl::Span<const float> q) = 0;
};

// The backend of `name` ("cpu"; "cuda:N" later). InvalidArgument for an unknown name,
// Unavailable for a known one this build or machine cannot provide.
absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateBackend(absl::string_view name);

}  // namespace kvpool::server
