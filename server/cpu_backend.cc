#include "server/cpu_backend.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/arrival_encoder.h"
#include "kernels/page_checksum.h"
#include "kernels/paged_attention.h"
#include "server/model_registry.h"

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

  // Rotation and encode per block in one pass (ArrivalEncoder: the rotated rows stay in cache).
  // A V that arrives pre-rotated is encoded as it is.
  absl::Status StageRows(const Model& m, int layer, absl::Span<const Bf16> k,
                         absl::Span<const Bf16> v, absl::Span<const RowWrite> writes) override {
    if (k.size() != v.size()) return absl::InternalError("StageRows: K and V sizes differ");
    KVPOOL_ASSIGN_OR_RETURN(ArrivalEncoder history,
                            ArrivalEncoder::Create(&m.codec.rotations, m.row_codec));
    KVPOOL_ASSIGN_OR_RETURN(ArrivalEncoder bf16,
                            ArrivalEncoder::Create(&m.codec.rotations, m.bf16_codec));
    const size_t row = m.row_values();
    for (const RowWrite& w : writes) {
      const ArrivalEncoder& enc = w.history ? history : bf16;
      const BlockLayout& layout = w.history ? m.block_layout : m.bf16_layout;
      const size_t from = static_cast<size_t>(w.input_row) * row;
      const size_t len = static_cast<size_t>(w.count) * row;
      KVPOOL_RETURN_IF_ERROR(enc.EncodeIntoBlock(layer, KvTensor::kKey, layout,
                                                 k.subspan(from, len), w.slot, w.block));
      if (m.codec.v_prerotated) {
        KVPOOL_RETURN_IF_ERROR(enc.codec().EncodeIntoBlock(KvTensor::kValue, layout,
                                                           v.subspan(from, len), w.slot, w.block));
      } else {
        KVPOOL_RETURN_IF_ERROR(enc.EncodeIntoBlock(layer, KvTensor::kValue, layout,
                                                   v.subspan(from, len), w.slot, w.block));
      }
      // Right after the encode, while the block's rows are in cache.
      if (w.checksum != nullptr) {
        *w.checksum = PageSlotsChecksum(w.block, PageChecksumGeometry::Of(layout), w.slot, w.count);
      }
    }
    return absl::OkStatus();
  }

  absl::Status DemoteRows(const Model& m, absl::Span<const RowMove> moves) override {
    std::vector<Bf16> rows;
    for (const RowMove& mv : moves) {
      rows.resize(static_cast<size_t>(mv.count) * m.row_values());
      for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
        KVPOOL_RETURN_IF_ERROR(
            ReadBf16Rows(m, mv.src, t, mv.src_slot, mv.count, absl::MakeSpan(rows)));
        KVPOOL_RETURN_IF_ERROR(
            m.row_codec.EncodeIntoBlock(t, m.block_layout, rows, mv.dst_slot, mv.dst));
      }
      if (mv.checksum != nullptr) {
        *mv.checksum = PageSlotsChecksum(mv.dst, PageChecksumGeometry::Of(m.block_layout),
                                         mv.dst_slot, mv.count);
      }
    }
    return absl::OkStatus();
  }

  absl::Status ChecksumSlots(const Model& m, absl::Span<const SlotRange> ranges,
                             absl::Span<uint32_t> out) override {
    if (out.size() != ranges.size()) return absl::InternalError("ChecksumSlots: sizes differ");
    const PageChecksumGeometry history = PageChecksumGeometry::Of(m.block_layout);
    const PageChecksumGeometry bf16 = PageChecksumGeometry::Of(m.bf16_layout);
    for (size_t i = 0; i < ranges.size(); ++i) {
      const SlotRange& r = ranges[i];
      out[i] = PageSlotsChecksum(r.page, r.history ? history : bf16, r.first_slot, r.count);
    }
    return absl::OkStatus();
  }

  absl::Status ReadRows(const Model& m, const uint8_t* block, bool history, KvTensor t, int slot,
                        int count, absl::Span<float> out) override {
    const RowCodec& codec = history ? m.row_codec : m.bf16_codec;
    codec.DecodeFromBlock(t, history ? m.block_layout : m.bf16_layout, block, slot, count, out);
    return absl::OkStatus();
  }

  absl::Status ReadBf16Rows(const Model& m, const uint8_t* page, KvTensor t, int slot, int count,
                            absl::Span<Bf16> out) override {
    const BlockLayout& l = m.bf16_layout;
    const size_t row_bytes = static_cast<size_t>(l.head_dim) * sizeof(Bf16);
    for (int h = 0; h < l.kv_heads; ++h) {
      const uint8_t* src = page + l.CodesOffset(t, h) + static_cast<size_t>(slot) * row_bytes;
      for (int r = 0; r < count; ++r) {
        std::memcpy(out.data() + (static_cast<size_t>(r) * l.kv_heads + h) * l.head_dim,
                    src + r * row_bytes, row_bytes);
      }
    }
    return absl::OkStatus();
  }

  absl::Status CopyFromPool(void* dst, const uint8_t* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  // One implementation of the CPU decode step for kvpoold and the C API: kernels/paged_attention
  // (the query rotated, the sink, recent and history passes merged, the output un-rotated).
  absl::Status Attend(const Model& m, const AttentionCall& call) override {
    if (call.on_device) return absl::UnimplementedError("the CPU backend attends host memory");
    const PagedAttentionModel model{{m.q_heads, m.kv_heads, m.head_dim}, &m.row_codec};
    PagedAttentionRotation rotation;
    rotation.set = &m.codec.rotations;
    rotation.layer = call.layer;
    int row = 0;
    for (const AttentionRows& io : call.io) {
      if (io.rows < 0 || io.rows > call.kv.num_seqs - row) {
        return absl::InternalError("Attend: more query rows than the batch holds");
      }
      const absl::Status s = PagedDecodeAttention(model, call.kv.Rows(row, io.rows), rotation,
                                                  {io.queries, io.out, io.lse});
      // The batch comes from the daemon's own tables: a rejected one is a bug here.
      if (!s.ok()) return absl::InternalError(absl::StrCat("Attend: ", s.message()));
      row += io.rows;
    }
    if (row != call.kv.num_seqs) {
      return absl::InternalError("Attend: fewer query rows than the batch holds");
    }
    return absl::OkStatus();
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

}  // namespace kvpool::server
