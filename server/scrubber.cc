#include "server/scrubber.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "spdlog/spdlog.h"

namespace kvpool::server {

Scrubber::Scrubber(SequenceStore* store, ComputeBackend* backend, BlockPool* pool,
                   ScrubberOptions options, PrefixIndex* index, ModelRegistry* registry)
    : store_(store),
      backend_(backend),
      pool_(pool),
      index_(index),
      registry_(registry),
      options_(options) {}

Scrubber::~Scrubber() { Stop(); }

void Scrubber::Start() {
  if (options_.period <= absl::ZeroDuration() || thread_.joinable()) return;
  thread_ = std::thread([this] { Run(); });
}

void Scrubber::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

bool Scrubber::WaitUntil(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
  mu_.AwaitWithDeadline(absl::Condition(&stopped), deadline);
  return !stop_;
}

void Scrubber::Run() {
  for (;;) {
    const absl::Time start = absl::Now();
    if (!SweepOnce()) return;
    if (!WaitUntil(start + options_.period)) return;
  }
}

bool Scrubber::SweepOnce() {
  const absl::Time start = absl::Now();
  const double period_s = absl::ToDoubleSeconds(options_.period);
  double rate = static_cast<double>(pool_->used_bytes()) / period_s;
  if (options_.max_bytes_per_second > 0) {
    rate = std::min(rate, static_cast<double>(options_.max_bytes_per_second));
  }
  IntegrityCounters& counters = store_->integrity();
  absl::flat_hash_set<PageId> verified;  // shared pages: once per sweep
  uint64_t bytes = 0;
  for (const auto& [tenant, id] : store_->Keys()) {
    // One layer at a time: its snapshot holds references (a page cannot be freed and rewritten
    // while it is read) only while it is verified, never while the sweep waits for its pace.
    // Released and already corrupt sequences answer an error here and are skipped.
    for (int layer = 0, layers = 1; layer < layers; ++layer) {
      absl::StatusOr<std::unique_ptr<SequenceSnapshot>> snap =
          store_->Snapshot(tenant, id, {layer});
      if (!snap.ok()) break;
      layers = (*snap)->model().num_layers;
      std::vector<PageToVerify> pages;
      for (const PageToVerify& p : (*snap)->AllPages()) {
        if (!verified.contains(p.page)) pages.push_back(p);
      }
      const size_t layer_bytes = VerifiedBytes(*pool_, (*snap)->model(), pages);
      const absl::Status s = VerifyPages(backend_, *pool_, (*snap)->model(), pages);
      if (absl::IsDataLoss(s)) {
        spdlog::error("scrubber: a sequence of model {}: {}", (*snap)->model().id,
                      std::string(s.message()));
        (void)(*snap)->MarkCorrupt();
        break;
      }
      if (!s.ok()) {
        spdlog::warn("scrubber: verification failed: {}", s.ToString());
        break;
      }
      for (const PageToVerify& p : pages) verified.insert(p.page);
      counters.pages_scrubbed.fetch_add(pages.size());
      counters.bytes_scrubbed.fetch_add(layer_bytes);
      bytes += layer_bytes;
      snap->reset();
      if (rate > 0 && !WaitUntil(start + absl::Seconds(static_cast<double>(bytes) / rate))) {
        return false;
      }
    }
    absl::MutexLock lock(&mu_);
    if (stop_) return false;
  }
  // Then the prefix cache: pages its units share with the sequences above were read already;
  // what is left are the pages only the cache holds (and those of sequences found corrupt).
  if (index_ != nullptr && registry_ != nullptr) {
    for (const PrefixHash& hash : index_->UnitHashes()) {
      bytes += ScrubPrefixUnit(hash, &verified);
      if (rate > 0 && !WaitUntil(start + absl::Seconds(static_cast<double>(bytes) / rate))) {
        return false;
      }
    }
  }
  counters.sweeps_completed.fetch_add(1);
  return true;
}

size_t Scrubber::ScrubPrefixUnit(const PrefixHash& hash, absl::flat_hash_set<PageId>* verified) {
  PrefixUnitPages unit;
  if (!index_->RefUnit(hash, &unit)) return 0;  // evicted meanwhile
  std::vector<PageToVerify> pages;
  for (PageId p : unit.pages) {
    if (!verified->contains(p)) pages.push_back({p, unit.kind == PrefixUnitKind::kBlock});
  }
  size_t bytes = 0;
  absl::StatusOr<std::shared_ptr<const Model>> model = registry_->Get(unit.tenant, unit.model_id);
  // A unit outlives its model only until DropModel removes it; one of an older registration
  // under the same id is not this model's to check.
  if (!pages.empty() && model.ok() && (*model)->version == unit.codec_version) {
    bytes = VerifiedBytes(*pool_, **model, pages);
    const absl::Status s = VerifyPages(backend_, *pool_, **model, pages);
    IntegrityCounters& counters = store_->integrity();
    if (absl::IsDataLoss(s)) {
      const size_t dropped = index_->DropCorrupt(hash);
      spdlog::error("scrubber: prefix unit {} of model {}: {}; dropped {} cached units",
                    PrefixHashHex(hash), unit.model_id, std::string(s.message()), dropped);
      counters.corrupt_prefix_units.fetch_add(1);
      counters.prefix_units_dropped.fetch_add(dropped);
    } else if (!s.ok()) {
      spdlog::warn("scrubber: verification failed: {}", s.ToString());
    } else {
      for (const PageToVerify& p : pages) verified->insert(p.page);
      counters.pages_scrubbed.fetch_add(pages.size());
      counters.bytes_scrubbed.fetch_add(bytes);
    }
  }
  pool_->UnrefAll(unit.pages);
  return bytes;
}

}  // namespace kvpool::server
