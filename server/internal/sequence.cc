#include "server/internal/sequence.h"

#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "proto/status.h"

namespace kvpool::server::internal {
namespace {

uint64_t NewIncarnation() {
  static absl::Mutex mu(absl::kConstInit);
  static absl::BitGen* gen = new absl::BitGen();
  absl::MutexLock lock(&mu);
  return absl::Uniform<uint64_t>(absl::IntervalClosed, *gen, 1, ~uint64_t{0});
}

}  // namespace

Sequence::Sequence(TenantId tenant_in, std::string id_in, std::shared_ptr<const Model> model_in)
    : tenant(std::move(tenant_in)),
      id(std::move(id_in)),
      model(std::move(model_in)),
      incarnation(NewIncarnation()),
      layout(TierConfig::FromQuantConfig(model->codec.quant)),
      layers(model->num_layers) {}

std::vector<PageId> Sequence::AllPagesLocked() const {
  std::vector<PageId> pages;
  for (const LayerPages& l : layers) {
    pages.insert(pages.end(), l.sink.begin(), l.sink.end());
    pages.insert(pages.end(), l.history.begin(), l.history.end());
    pages.insert(pages.end(), l.recent.begin(), l.recent.end());
  }
  return pages;
}

SequenceInfo Sequence::InfoLocked(const BlockPool& pool) const {
  SequenceInfo info;
  info.id = id;
  info.model_id = model->id;
  info.tenant = tenant;
  info.state = state;
  info.ttl = ttl;
  info.idle = absl::Now() - absl::FromUnixNanos(last_use_ns.load(std::memory_order_relaxed));
  info.sink = layout.sink();
  info.history = layout.history();
  info.recent = layout.recent();
  info.reused_tokens = reused_tokens;
  info.has_token_ids = token_ids_complete;
  const BlockPool::PageTotals totals = pool.Totals(AllPagesLocked());
  info.pool_bytes = totals.bytes;
  info.shared_bytes = totals.shared_bytes;
  info.bf16_equivalent_bytes =
      static_cast<size_t>(info.total()) * model->bf16_token_bytes() * model->num_layers;
  return info;
}

absl::Status ReleasedError(const std::string& id, bool expired) {
  if (expired) {
    return WithReason(absl::NotFoundError(absl::StrCat("sequence ", Quote(id),
                                                       " expired: its lease ran out without use")),
                      ErrorReason::kExpired);
  }
  return absl::NotFoundError(absl::StrCat("no sequence ", Quote(id)));
}

}  // namespace kvpool::server::internal
