#include "server/cpu_backend.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvpool::server {
namespace {

class HostArena final : public Arena {
 public:
  HostArena(uint8_t* data, size_t size) : data_(data), size_(size) {}
  ~HostArena() override { munmap(data_, size_); }
  uint8_t* data() const override { return data_; }
  size_t size() const override { return size_; }
  bool host_accessible() const override { return true; }

 private:
  uint8_t* data_;
  size_t size_;
};

class CpuBackend final : public ComputeBackend {
 public:
  absl::string_view name() const override { return "cpu"; }

  absl::StatusOr<std::unique_ptr<Arena>> AllocateArena(size_t bytes) override {
    return NewHostArena(bytes);
  }

  absl::Status RotateRows(const RotationSet& rotations, int layer, KvTensor t,
                          absl::Span<const Bf16> in, absl::Span<Bf16> out) override {
    if (in.size() != out.size()) return absl::InternalError("RotateRows: size mismatch");
    // Bit copy: a matrix product with I would turn -0 into +0 and break exactness.
    if (rotations.kind() == RotationKind::kIdentity) {
      if (layer < 0 || layer >= rotations.num_layers()) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
      }
      std::memcpy(out.data(), in.data(), in.size() * sizeof(Bf16));
      return absl::OkStatus();
    }
    return rotations.RotateBf16(layer, t, in, out);
  }

  absl::Status RotateFloat(const RotationSet& rotations, int layer, KvTensor t,
                           absl::Span<const float> in, absl::Span<float> out) override {
    if (rotations.kind() == RotationKind::kIdentity && in.size() == out.size()) {
      std::memcpy(out.data(), in.data(), in.size() * sizeof(float));
      return absl::OkStatus();
    }
    return rotations.Rotate(layer, t, in, out);
  }

  absl::Status UnrotateFloat(const RotationSet& rotations, int layer, KvTensor t,
                             absl::Span<const float> in, absl::Span<float> out) override {
    if (rotations.kind() == RotationKind::kIdentity && in.size() == out.size()) {
      std::memcpy(out.data(), in.data(), in.size() * sizeof(float));
      return absl::OkStatus();
    }
    return rotations.Unrotate(layer, t, in, out);
  }

  absl::Status EncodeIntoBlock(const RowCodec& codec, KvTensor t, const BlockLayout& layout,
                               absl::Span<const Bf16> rows, int first_token,
                               uint8_t* block) override {
    return codec.EncodeIntoBlock(t, layout, rows, first_token, block);
  }

  void DecodeFromBlock(const RowCodec& codec, KvTensor t, const BlockLayout& layout,
                       const uint8_t* block, int first_token, int count,
                       absl::Span<float> out) override {
    codec.DecodeFromBlock(t, layout, block, first_token, count, out);
  }

  void CopyToPool(uint8_t* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void CopyFromPool(void* dst, const uint8_t* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }

  AttentionOutput Attend(const AttentionShape& shape, const RowCodec& codec,
                         const BlockLayout& layout, const SequenceTiers& tiers,
                         absl::Span<const float> q) override {
    AttentionOutput acc;
    acc.out.assign(static_cast<size_t>(shape.q_heads) * shape.head_dim, 0.0f);
    acc.lse.assign(shape.q_heads, -std::numeric_limits<float>::infinity());
    const size_t row = static_cast<size_t>(shape.kv_heads) * shape.head_dim;
    for (const Bf16Segment& seg : tiers.bf16) {
      if (seg.tokens <= 0) continue;
      const size_t n = row * seg.tokens;
      AttentionOutput part = AttendBf16Rows(shape, q, absl::MakeConstSpan(seg.k, n),
                                            absl::MakeConstSpan(seg.v, n), seg.tokens);
      MergeAttention(shape, part, &acc);
    }
    if (tiers.history_tokens > 0) {
      AttentionOutput part = AttendBlocks(
          shape, codec, layout, absl::MakeConstSpan(tiers.history_blocks), tiers.history_tokens, q);
      MergeAttention(shape, part, &acc);
    }
    return acc;
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Arena>> NewHostArena(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("arena size must be > 0");
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map a ", bytes, "-byte pool arena: ", std::strerror(errno)));
  }
  return std::unique_ptr<Arena>(new HostArena(static_cast<uint8_t*>(p), bytes));
}

std::unique_ptr<ComputeBackend> NewCpuBackend() { return std::make_unique<CpuBackend>(); }

absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateBackend(absl::string_view name) {
  if (name == "cpu") return NewCpuBackend();
  if (absl::StartsWith(name, "cuda")) {
    return absl::UnavailableError(
        absl::StrCat("backend '", name, "' is not available in this build (CPU only so far)"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", name, "' (expected cpu or cuda:N)"));
}

}  // namespace kvpool::server
