#include "server/page_verifier.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "proto/status.h"

namespace kvpool::server {

absl::Status VerifyPages(ComputeBackend* backend, const BlockPool& pool, const Model& model,
                         absl::Span<const PageToVerify> pages) {
  std::vector<SlotRange> ranges;
  std::vector<PageChecksum> expected;
  ranges.reserve(pages.size());
  expected.reserve(pages.size());
  for (const PageToVerify& p : pages) {
    const PageChecksum c = pool.Checksum(p.page);
    if (c.empty()) continue;
    ranges.push_back({pool.Data(p.page), static_cast<int>(c.first), c.count(), p.history});
    expected.push_back(c);
  }
  if (ranges.empty()) return absl::OkStatus();
  std::vector<uint32_t> sums(ranges.size());
  KVPOOL_RETURN_IF_ERROR(backend->ChecksumSlots(model, ranges, absl::MakeSpan(sums)));
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (sums[i] == expected[i].sum) continue;
    return WithReason(
        absl::DataLossError(absl::StrCat(ranges[i].history ? "INT2 block" : "BF16 page",
                                         " failed its checksum (slots ", expected[i].first, "..",
                                         expected[i].end - 1, ")")),
        ErrorReason::kCorrupt);
  }
  return absl::OkStatus();
}

size_t VerifiedBytes(const BlockPool& pool, const Model& model,
                     absl::Span<const PageToVerify> pages) {
  size_t bytes = 0;
  for (const PageToVerify& p : pages) {
    const BlockLayout& l = p.history ? model.block_layout : model.bf16_layout;
    const size_t row =
        static_cast<size_t>(l.kv_heads) * 2 * (l.code_bytes_per_row() + l.meta_bytes_per_row());
    bytes += row * pool.Checksum(p.page).count();
  }
  return bytes;
}

absl::Status CorruptSequenceError(absl::string_view sequence_id) {
  return WithReason(
      absl::DataLossError(absl::StrCat(
          "sequence ", Quote(sequence_id),
          " holds stored bytes that failed their checksum; release it and re-prefill")),
      ErrorReason::kCorrupt);
}

}  // namespace kvpool::server
