#include "server/sequence_snapshot.h"

#include <algorithm>

#include "common/status_macros.h"
#include "kernels/page_checksum.h"
#include "server/internal/sequence.h"

namespace kvpool::server {

SequenceSnapshot::~SequenceSnapshot() {
  if (pool_ != nullptr) pool_->UnrefAll(refs_);
}

PagedKvTables::Sequence SequenceSnapshot::KvSequence(size_t i, int rows) const {
  const Layer& l = layers_.at(i);
  PagedKvTables::Sequence seq;
  seq.sink = {l.sink, 0, sink_};
  seq.history = {l.history, 0, history_};
  seq.recent = {l.recent, recent_head_, recent_};
  seq.rows = rows;
  return seq;
}

const uint8_t* SequenceSnapshot::HistoryBlock(size_t i, size_t b) const {
  return history_pool_.Block(layers_.at(i).history.at(b));
}

absl::Status SequenceSnapshot::MarkCorrupt() const {
  if (!seq_->corrupt.exchange(true)) counters_->corrupt_sequences.fetch_add(1);
  return CorruptSequenceError(id_);
}

absl::Status SequenceSnapshot::VerifyTokens(ComputeBackend* backend, size_t i, int start,
                                            int count) const {
  const Layer& l = layers_.at(i);
  const int bt = model_->block_tokens();
  const int end = start + count;
  std::vector<PageToVerify> pages;
  // Pages of a tier holding positions [tier_begin, tier_end) of the sequence from slot `base`.
  auto add = [&](const std::vector<int32_t>& tier, bool history, int tier_begin, int tier_end,
                 int base) {
    const int a = std::max(start, tier_begin);
    const int b = std::min(end, tier_end);
    if (a >= b) return;
    for (int p = (base + a - tier_begin) / bt; p <= (base + b - 1 - tier_begin) / bt; ++p) {
      pages.push_back({pool_->PageOfBlock(tier.at(p)), history});
    }
  };
  add(l.sink, false, 0, sink_, 0);
  add(l.history, true, sink_, sink_ + history_, 0);
  add(l.recent, false, sink_ + history_, total(), recent_head_);
  if (seq_->corrupt.load()) return CorruptSequenceError(id_);
  const absl::Status s = VerifyPages(backend, *pool_, *model_, pages);
  if (absl::IsDataLoss(s)) return MarkCorrupt();
  return s;
}

absl::Status SequenceSnapshot::CheckHistoryCopy(size_t i, size_t b, const uint8_t* copy) const {
  const PageChecksum c = pool_->Checksum(pool_->PageOfBlock(layers_.at(i).history.at(b)));
  if (c.empty()) return absl::OkStatus();
  const uint32_t sum = PageSlotsChecksum(copy, PageChecksumGeometry::Of(model_->block_layout),
                                         static_cast<int>(c.first), c.count());
  return sum == c.sum ? absl::OkStatus() : MarkCorrupt();
}

std::vector<PageToVerify> SequenceSnapshot::AllPages() const {
  std::vector<PageToVerify> pages;
  for (const Layer& l : layers_) {
    for (int32_t b : l.sink) pages.push_back({pool_->PageOfBlock(b), false});
    for (int32_t b : l.history) pages.push_back({pool_->PageOfBlock(b), true});
    for (int32_t b : l.recent) pages.push_back({pool_->PageOfBlock(b), false});
  }
  return pages;
}

absl::Status SequenceSnapshot::CopyBf16Rows(ComputeBackend* backend, size_t i, bool recent_tier,
                                            int start, int count, absl::Span<Bf16> k,
                                            absl::Span<Bf16> v) const {
  const Layer& l = layers_.at(i);
  const int bt = model_->block_tokens();
  const size_t row = model_->row_values();
  const int base = recent_tier ? recent_head_ : 0;
  const std::vector<int32_t>& pages = recent_tier ? l.recent : l.sink;
  KVPOOL_RETURN_IF_ERROR(
      VerifyTokens(backend, i, (recent_tier ? sink_ + history_ : 0) + start, count));
  for (int done = 0; done < count;) {
    const int slot = base + start + done;
    const int in_page = slot % bt;
    const int take = std::min(count - done, bt - in_page);
    const uint8_t* page = bf16_pool_.Block(pages[slot / bt]);
    const size_t at = static_cast<size_t>(done) * row;
    const size_t len = static_cast<size_t>(take) * row;
    KVPOOL_RETURN_IF_ERROR(
        backend->ReadBf16Rows(*model_, page, KvTensor::kKey, in_page, take, k.subspan(at, len)));
    KVPOOL_RETURN_IF_ERROR(
        backend->ReadBf16Rows(*model_, page, KvTensor::kValue, in_page, take, v.subspan(at, len)));
    done += take;
  }
  return absl::OkStatus();
}

absl::Status SequenceSnapshot::ReadRotated(ComputeBackend* backend, size_t i, int start, int count,
                                           absl::Span<float> k, absl::Span<float> v) const {
  const Layer& l = layers_.at(i);
  const Model& m = *model_;
  const int bt = m.block_tokens();
  const size_t row = m.row_values();
  const int end = start + count;
  KVPOOL_RETURN_IF_ERROR(VerifyTokens(backend, i, start, count));
  // Tier by tier: [first, last) of the sequence's positions in `pages`, whose position 0 is
  // at `base` of the page list.
  auto read = [&](const std::vector<int32_t>& pages, bool history, int tier_begin, int tier_end,
                  int base) -> absl::Status {
    const int a = std::max(start, tier_begin);
    const int b = std::min(end, tier_end);
    for (int t = a; t < b;) {
      const int pos = base + (t - tier_begin);
      const int slot = pos % bt;
      const int take = std::min(b - t, bt - slot);
      const uint8_t* block = (history ? history_pool_ : bf16_pool_).Block(pages[pos / bt]);
      const size_t out = static_cast<size_t>(t - start) * row;
      const size_t len = static_cast<size_t>(take) * row;
      KVPOOL_RETURN_IF_ERROR(
          backend->ReadRows(m, block, history, KvTensor::kKey, slot, take, k.subspan(out, len)));
      KVPOOL_RETURN_IF_ERROR(
          backend->ReadRows(m, block, history, KvTensor::kValue, slot, take, v.subspan(out, len)));
      t += take;
    }
    return absl::OkStatus();
  };
  KVPOOL_RETURN_IF_ERROR(read(l.sink, false, 0, sink_, 0));
  KVPOOL_RETURN_IF_ERROR(read(l.history, true, sink_, sink_ + history_, 0));
  return read(l.recent, false, sink_ + history_, sink_ + history_ + recent_, recent_head_);
}

}  // namespace kvpool::server
