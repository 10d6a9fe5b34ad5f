#include "server/sequence_store.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "openssl/rand.h"
#include "proto/status.h"
#include "server/internal/sequence.h"

namespace kvpool::server {
namespace {

int CeilDiv(int a, int b) { return (a + b - 1) / b; }

absl::Status ExpiredError(const std::string& id) { return internal::ReleasedError(id, true); }

// 32 hex characters of a cryptographically secure generator (OpenSSL's RAND_bytes).
absl::StatusOr<std::string> RandomSequenceId() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    return absl::InternalError("the secure random generator failed");
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id;
  for (unsigned char b : bytes) {
    id.push_back(kHex[b >> 4]);
    id.push_back(kHex[b & 15]);
  }
  return id;
}

}  // namespace

using internal::LayerPages;
using internal::Sequence;

SequenceStore::SequenceStore(BlockPool* pool, PrefixIndex* index, ComputeBackend* backend,
                             absl::Duration default_ttl, TenantQuotaTable* quotas)
    : pool_(pool),
      index_(index),
      backend_(backend),
      demotions_(backend),
      quotas_(quotas),
      default_ttl_(default_ttl) {}

SequenceStore::~SequenceStore() {
  absl::MutexLock lock(&mu_);
  for (auto& [key, seq] : sequences_) {
    absl::MutexLock seq_lock(&seq->mu);
    seq->released = true;
    seq->generation.fetch_add(1, std::memory_order_release);
    pool_->UnrefAll(seq->AllPagesLocked());
    seq->layers.clear();
  }
  sequences_.clear();
}

PrefixContext SequenceStore::ContextOf(const Model& model) {
  PrefixContext ctx;
  ctx.tenant = model.tenant;
  ctx.model_id = model.id;
  ctx.codec_version = model.version;
  ctx.sink_tokens = model.codec.quant.sink_tokens;
  ctx.block_tokens = model.codec.quant.block_tokens;
  return ctx;
}

std::shared_ptr<Sequence> SequenceStore::Find(const TenantId& tenant, const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(std::make_pair(tenant, id));
  return it == sequences_.end() ? nullptr : it->second;
}

absl::Status SequenceStore::Missing(const TenantId& tenant, const std::string& id) const {
  {
    absl::MutexLock lock(&mu_);
    if (expired_ids_.count(std::make_pair(tenant, id)) > 0) return ExpiredError(id);
  }
  return absl::NotFoundError(absl::StrCat("no sequence ", Quote(id)));
}

absl::Status SequenceStore::AllocatePages(const TenantId& tenant,
                                          absl::Span<const PageRequest> requests,
                                          std::vector<std::vector<PageId>>* out) {
  absl::Status s = index_->AllocateEvicting(tenant, requests, out);
  if (quotas_ != nullptr && ReasonOf(s) == ErrorReason::kQuota) {
    quotas_->CountRejection(tenant, QuotaKind::kPoolBytes);
  }
  return s;
}

void SequenceStore::UncountSequenceLocked(const TenantId& tenant) {
  auto it = tenant_sequences_.find(tenant);
  if (it == tenant_sequences_.end()) return;
  if (--it->second == 0) tenant_sequences_.erase(it);
}

size_t SequenceStore::SequencesOf(const TenantId& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = tenant_sequences_.find(tenant);
  return it == tenant_sequences_.end() ? 0 : it->second;
}

absl::StatusOr<std::pair<SequenceInfo, std::vector<PrefixUnitKey>>> SequenceStore::Create(
    const TenantId& tenant, std::shared_ptr<const Model> model, std::string id,
    absl::Span<const uint32_t> prefix_token_ids, absl::Duration ttl) {
  if (model == nullptr) return absl::InvalidArgumentError("no model");
  if (ttl < absl::ZeroDuration()) return absl::InvalidArgumentError("a lease cannot be negative");
  if (!id.empty()) KVPOOL_RETURN_IF_ERROR(ValidateId("sequence_id", id));
  auto reserve_id = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (id.empty()) {
      // Unguessable (128 random bits), so that knowing one id says nothing about another.
      do {
        KVPOOL_ASSIGN_OR_RETURN(id, RandomSequenceId());
      } while (sequences_.count(std::make_pair(tenant, id)) > 0);
    } else if (sequences_.count(std::make_pair(tenant, id)) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("sequence ", Quote(id), " already exists"));
    }
    // The quota counts this sequence from here on, so concurrent creations cannot pass it.
    const uint64_t quota = quotas_ != nullptr ? quotas_->Get(tenant).sequences : 0;
    size_t& held = tenant_sequences_[tenant];
    if (quota > 0 && held + 1 > quota) {
      const size_t usage = held;
      if (held == 0) tenant_sequences_.erase(tenant);
      quotas_->CountRejection(tenant, QuotaKind::kSequences);
      return QuotaError(tenant, QuotaKind::kSequences, quota, usage, 1);
    }
    ++held;
    return absl::OkStatus();
  };
  {
    absl::MutexLock lock(&mu_);
    KVPOOL_RETURN_IF_ERROR(reserve_id());
  }
  auto seq = std::make_shared<Sequence>(tenant, id, model);
  seq->ttl = ttl > absl::ZeroDuration() ? ttl : default_ttl_;
  seq->Touch();
  std::vector<PrefixUnitKey> attached;
  std::vector<PageId> attached_pages;  // references taken by Match, now the sequence's
  bool attach_fits = true;
  if (!prefix_token_ids.empty()) {
    const PrefixContext ctx = ContextOf(*model);
    const std::vector<PrefixUnitKey> chain = ComputePrefixChain(ctx, prefix_token_ids);
    std::vector<PrefixMatch> hits = index_->Match(ctx, chain, /*take_refs=*/true);
    absl::MutexLock seq_lock(&seq->mu);
    const int sink_pages = CeilDiv(ctx.sink_tokens, ctx.block_tokens);
    int tokens = 0;
    for (PrefixMatch& hit : hits) {
      attached_pages.insert(attached_pages.end(), hit.pages.begin(), hit.pages.end());
      for (int layer = 0; layer < model->num_layers; ++layer) {
        LayerPages& l = seq->layers[layer];
        if (hit.key.kind == PrefixUnitKind::kSink) {
          l.sink.assign(hit.pages.begin() + layer * sink_pages,
                        hit.pages.begin() + (layer + 1) * sink_pages);
        } else {
          l.history.push_back(hit.pages[layer]);
        }
      }
      tokens = hit.key.token_start + hit.key.token_count;
      attached.push_back(hit.key);
      seq->chain.push_back(hit.key);
    }
    if (tokens > 0) {
      absl::StatusOr<AppendPlan> plan = seq->layout.PlanAppend(tokens, AppendKind::kPrefill);
      if (!plan.ok() || plan->to_recent != 0 || plan->demote != 0) {
        attach_fits = false;
      } else {
        seq->layout.Commit(*plan, AppendKind::kPrefill);
        seq->token_ids.assign(prefix_token_ids.begin(), prefix_token_ids.begin() + tokens);
        seq->reused_tokens = tokens;
      }
    }
  }
  if (!attach_fits) {
    pool_->UnrefAll(attached_pages);
    absl::MutexLock lock(&mu_);
    UncountSequenceLocked(tenant);
    return absl::InternalError("prefix attach does not fit the sequence layout");
  }
  absl::MutexLock lock(&mu_);
  // The id was free a moment ago; re-check in case a concurrent Create took it.
  if (sequences_.count(std::make_pair(tenant, id)) > 0) {
    pool_->UnrefAll(attached_pages);
    UncountSequenceLocked(tenant);
    return absl::AlreadyExistsError(absl::StrCat("sequence ", Quote(id), " already exists"));
  }
  sequences_.emplace(std::make_pair(tenant, id), seq);
  if (seq->ttl > absl::ZeroDuration()) ++leased_count_;
  // The id names a live sequence again: NotFound for it no longer means it expired.
  if (expired_ids_.erase(std::make_pair(tenant, id)) > 0) {
    expired_order_.erase(
        std::find(expired_order_.begin(), expired_order_.end(), std::make_pair(tenant, id)));
  }
  absl::MutexLock seq_lock(&seq->mu);
  return std::make_pair(seq->InfoLocked(*pool_), std::move(attached));
}

absl::StatusOr<std::unique_ptr<AppendTxn>> SequenceStore::BeginAppend(const TenantId& tenant,
                                                                      const std::string& id,
                                                                      AppendSpec spec,
                                                                      const AdmitPages& admit) {
  std::shared_ptr<Sequence> seq = Find(tenant, id);
  if (seq == nullptr) return Missing(tenant, id);
  seq->Touch();
  const Model& m = *seq->model;
  if (spec.num_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens must be >= 1, got ", spec.num_tokens));
  }
  if (!spec.token_ids.empty() && static_cast<int>(spec.token_ids.size()) != spec.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("token_ids has ", spec.token_ids.size(),
                                                   " entries for ", spec.num_tokens, " tokens"));
  }
  if (seq->corrupt.load()) return CorruptSequenceError(id);
  const int bt = m.block_tokens();
  auto txn = std::unique_ptr<AppendTxn>(new AppendTxn());
  txn->pool_ = pool_;
  txn->backend_ = backend_;
  txn->seq_ = seq;
  txn->model_ = seq->model;
  txn->token_start_ = spec.token_start;
  txn->num_tokens_ = spec.num_tokens;
  txn->token_ids_ = std::move(spec.token_ids);
  int new_sink = 0, new_history = 0, new_recent = 0;
  {
    absl::MutexLock lock(&seq->mu);
    if (seq->released) {
      return internal::ReleasedError(id, seq->expired);
    }
    if (seq->state == SequenceState::kSealed) {
      return absl::FailedPreconditionError(absl::StrCat("sequence ", Quote(id), " is sealed"));
    }
    if (seq->append_active) {
      return absl::AbortedError(
          absl::StrCat("another append to sequence ", Quote(id), " is in progress"));
    }
    if (spec.token_start != seq->layout.total()) {
      return absl::FailedPreconditionError(absl::StrCat("token_start ", spec.token_start,
                                                        " is not the length of sequence '", id,
                                                        "' (", seq->layout.total(), " tokens)"));
    }
    // Plan on a copy of the layout; the sequence's own changes only at Commit.
    MixedSequenceLayout sim = seq->layout;
    const int steps = spec.kind == AppendKind::kDecode ? spec.num_tokens : 1;
    const int per_step = spec.kind == AppendKind::kDecode ? 1 : spec.num_tokens;
    for (int i = 0; i < steps; ++i) {
      KVPOOL_ASSIGN_OR_RETURN(AppendPlan plan, sim.PlanAppend(per_step, spec.kind));
      sim.Commit(plan, spec.kind);
      txn->plans_.emplace_back(plan, spec.kind);
    }
    // Route input tokens and demotions to tier positions.
    const int base_s = seq->layout.sink(), base_h = seq->layout.history();
    const int base_r = seq->layout.recent(), base_head = seq->recent_head;
    int s = base_s, h = base_h, rend = base_head + base_r, rhead = base_head, input = 0;
    auto add_segment = [&](int count, AppendTxn::Tier tier, int* dest) {
      if (count <= 0) return;
      auto& segs = txn->segments_;
      if (!segs.empty() && segs.back().tier == tier &&
          segs.back().input + segs.back().count == input &&
          segs.back().dest + segs.back().count == *dest) {
        segs.back().count += count;
      } else {
        segs.push_back({input, count, tier, *dest});
      }
      input += count;
      *dest += count;
    };
    for (const auto& [plan, kind] : txn->plans_) {
      if (plan.demote > 0) {
        auto& dem = txn->demotions_;
        if (!dem.empty() && dem.back().src + dem.back().count == rhead &&
            dem.back().dst + dem.back().count == h) {
          dem.back().count += plan.demote;
        } else {
          dem.push_back({rhead, h, plan.demote});
        }
        rhead += plan.demote;
        h += plan.demote;
      }
      add_segment(plan.to_sink, AppendTxn::Tier::kSink, &s);
      add_segment(plan.to_history, AppendTxn::Tier::kHistory, &h);
      add_segment(plan.to_recent, AppendTxn::Tier::kRecent, &rend);
      txn->to_sink_ += plan.to_sink;
      txn->to_history_ += plan.to_history;
      txn->to_recent_ += plan.to_recent;
      txn->demoted_ += plan.demote;
    }
    const int base_recent_pages = static_cast<int>(seq->layers[0].recent.size());
    new_sink = CeilDiv(s, bt) - CeilDiv(base_s, bt);
    new_history = CeilDiv(h, bt) - CeilDiv(base_h, bt);
    new_recent = std::max(0, CeilDiv(rend, bt) - base_recent_pages);
    txn->popped_recent_pages_ = std::min(rhead / bt, base_recent_pages + new_recent);
    txn->final_recent_head_ = rhead - txn->popped_recent_pages_ * bt;

    txn->layers_.resize(m.num_layers);
    for (int layer = 0; layer < m.num_layers; ++layer) {
      const LayerPages& pages = seq->layers[layer];
      AppendTxn::LayerState& l = txn->layers_[layer];
      l.base_sink = pages.sink;
      l.base_history_blocks = static_cast<int>(pages.history.size());
      if (base_h % bt != 0) l.base_history_tail = pages.history.back();
      l.base_recent.assign(pages.recent.begin(), pages.recent.end());
      // Keep what we write into or read from alive even if the sequence is released meanwhile.
      txn->base_refs_.insert(txn->base_refs_.end(), l.base_sink.begin(), l.base_sink.end());
      if (l.base_history_tail != kInvalidPage) txn->base_refs_.push_back(l.base_history_tail);
      txn->base_refs_.insert(txn->base_refs_.end(), l.base_recent.begin(), l.base_recent.end());
    }
    pool_->RefAll(txn->base_refs_);
    seq->append_active = true;
    txn->store_ = this;  // from here on, destroying the txn rolls back
  }
  // Reserve every page up front: a full pool fails now, before the client streams anything.
  const size_t layers = m.num_layers;
  if (admit) {
    KVPOOL_RETURN_IF_ERROR(
        admit(layers * (new_history * pool_->ClassPageBytes(m.block_class) +
                        (new_sink + new_recent) * pool_->ClassPageBytes(m.bf16_class))));
  }
  // Demoted rows land in the new INT2 blocks counted here: demotion allocates nothing else.
  const PageRequest requests[2] = {
      {m.block_class, layers * new_history, PageTier::kInt2},
      {m.bf16_class, layers * (new_sink + new_recent), PageTier::kBf16}};
  std::vector<std::vector<PageId>> allocated;
  KVPOOL_RETURN_IF_ERROR(AllocatePages(tenant, requests, &allocated));
  const std::vector<PageId>& blocks = allocated[0];
  const std::vector<PageId>& bf16_pages = allocated[1];
  size_t bi = 0, hi = 0;
  for (size_t layer = 0; layer < layers; ++layer) {
    AppendTxn::LayerState& l = txn->layers_[layer];
    l.new_sink.assign(bf16_pages.begin() + bi, bf16_pages.begin() + bi + new_sink);
    bi += new_sink;
    l.new_recent.assign(bf16_pages.begin() + bi, bf16_pages.begin() + bi + new_recent);
    bi += new_recent;
    l.new_history.assign(blocks.begin() + hi, blocks.begin() + hi + new_history);
    hi += new_history;
  }
  return txn;
}

void SequenceStore::Abort(AppendTxn* txn) {
  {
    absl::MutexLock lock(&txn->seq_->mu);
    txn->seq_->append_active = false;
  }
  txn->Release();
}

absl::StatusOr<AppendResult> SequenceStore::Commit(std::unique_ptr<AppendTxn> txn) {
  KVPOOL_RETURN_IF_ERROR(txn->CheckComplete());
  Sequence& seq = *txn->seq_;
  seq.Touch();
  const Model& m = *seq.model;
  const int bt = m.block_tokens();
  AppendResult result;
  std::vector<PageId> to_unref;
  {
    absl::MutexLock lock(&seq.mu);
    if (seq.released) {
      return seq.expired ? ExpiredError(seq.id)
                         : absl::NotFoundError(absl::StrCat("sequence ", Quote(seq.id),
                                                            " was released during the append"));
    }
    for (size_t layer = 0; layer < seq.layers.size(); ++layer) {
      LayerPages& pages = seq.layers[layer];
      AppendTxn::LayerState& l = txn->layers_[layer];
      pages.sink.insert(pages.sink.end(), l.new_sink.begin(), l.new_sink.end());
      pages.history.insert(pages.history.end(), l.new_history.begin(), l.new_history.end());
      pages.recent.insert(pages.recent.end(), l.new_recent.begin(), l.new_recent.end());
      for (int p = 0; p < txn->popped_recent_pages_; ++p) {
        to_unref.push_back(pages.recent.front());
        pages.recent.pop_front();
      }
      l.new_sink.clear();
      l.new_history.clear();
      l.new_recent.clear();
    }
    for (const auto& [plan, kind] : txn->plans_) {
      seq.layout.Commit(plan, kind);
      if (kind == AppendKind::kFinalPrefill) seq.state = SequenceState::kDecode;
    }
    seq.recent_head = txn->final_recent_head_;
    seq.generation.fetch_add(1, std::memory_order_release);
    if (seq.token_ids_complete && !txn->token_ids_.empty()) {
      seq.token_ids.insert(seq.token_ids.end(), txn->token_ids_.begin(), txn->token_ids_.end());
    } else {
      seq.token_ids_complete = false;
      seq.token_ids.clear();
      seq.token_ids.shrink_to_fit();
    }
    // Publish every newly whole unit (the sink once full, then whole INT2 blocks).
    const PrefixContext ctx = ContextOf(m);
    if (seq.token_ids_complete && seq.layout.sink() == ctx.sink_tokens) {
      const int sink_pages = CeilDiv(ctx.sink_tokens, bt);
      for (;;) {
        PrefixUnitKey key = PrefixUnitRange(ctx, static_cast<int>(seq.chain.size()));
        std::vector<PageId> pages;
        if (key.kind == PrefixUnitKind::kSink) {
          for (const LayerPages& l : seq.layers) {
            pages.insert(pages.end(), l.sink.begin(), l.sink.begin() + sink_pages);
          }
        } else {
          const int block = (key.token_start - ctx.sink_tokens) / bt;
          if ((block + 1) * bt > seq.layout.history()) break;
          for (const LayerPages& l : seq.layers) pages.push_back(l.history[block]);
        }
        const PrefixHash parent = seq.chain.empty() ? PrefixHash{} : seq.chain.back().hash;
        key.hash = HashPrefixUnit(
            ctx, parent, key.kind,
            absl::MakeConstSpan(seq.token_ids).subspan(key.token_start, key.token_count));
        if (index_->Publish(ctx, key, parent, pages)) result.published.push_back(key);
        seq.chain.push_back(key);
      }
    }
    txn->PublishChecksums();  // with the state, under the sequence's lock
    seq.append_active = false;
    result.info = seq.InfoLocked(*pool_);
  }
  result.to_sink = txn->to_sink_;
  result.to_history = txn->to_history_;
  result.to_recent = txn->to_recent_;
  result.demoted = txn->demoted_;
  pool_->UnrefAll(to_unref);
  txn->Release();  // drops the base references; the new pages now belong to the sequence
  return result;
}

absl::StatusOr<SequenceInfo> SequenceStore::Seal(const TenantId& tenant, const std::string& id) {
  std::shared_ptr<Sequence> seq = Find(tenant, id);
  if (seq == nullptr) return Missing(tenant, id);
  seq->Touch();
  absl::MutexLock lock(&seq->mu);
  if (seq->append_active) {
    return absl::AbortedError(absl::StrCat("an append to sequence ", Quote(id), " is in progress"));
  }
  seq->state = SequenceState::kSealed;
  return seq->InfoLocked(*pool_);
}

absl::StatusOr<size_t> SequenceStore::Release(const TenantId& tenant, const std::string& id) {
  {
    absl::MutexLock lock(&mu_);
    auto it = sequences_.find(std::make_pair(tenant, id));
    if (it != sequences_.end()) return ReleaseLocked(it);
  }
  return Missing(tenant, id);
}

size_t SequenceStore::ReleaseLocked(
    std::map<std::pair<TenantId, std::string>, std::shared_ptr<Sequence>>::iterator it) {
  std::shared_ptr<Sequence> seq = std::move(it->second);
  UncountSequenceLocked(it->first.first);
  sequences_.erase(it);
  if (seq->ttl > absl::ZeroDuration()) --leased_count_;
  std::vector<PageId> pages;
  {
    absl::MutexLock lock(&seq->mu);
    seq->released = true;
    seq->generation.fetch_add(1, std::memory_order_release);
    pages = seq->AllPagesLocked();
    seq->layers.assign(seq->layers.size(), LayerPages{});
  }
  return pool_->UnrefAll(pages);
}

size_t SequenceStore::ReleaseExpired(absl::Time now) {
  if (leased_count_.load() == 0) return 0;
  size_t released = 0;
  absl::MutexLock lock(&mu_);
  for (auto it = sequences_.begin(); it != sequences_.end();) {
    Sequence& seq = *it->second;
    if (!seq.ExpiredAt(now)) {
      ++it;
      continue;
    }
    {
      absl::MutexLock seq_lock(&seq.mu);
      // An append in progress is use: its commit renews the lease (an idle stream is the
      // ingest engine's to time out).
      if (seq.append_active) {
        ++it;
        continue;
      }
      seq.expired = true;
    }
    const std::pair<TenantId, std::string> key = it->first;
    ReleaseLocked(it++);
    if (expired_ids_.insert(key).second) expired_order_.push_back(key);
    while (expired_order_.size() > kExpiredIdsRemembered) {
      expired_ids_.erase(expired_order_.front());
      expired_order_.pop_front();
    }
    ++released;
  }
  expired_count_ += released;
  return released;
}

std::pair<size_t, size_t> SequenceStore::ReleaseModel(const TenantId& tenant,
                                                      const std::string& model_id) {
  std::vector<std::string> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, seq] : sequences_) {
      if (key.first == tenant && seq->model->id == model_id) ids.push_back(key.second);
    }
  }
  size_t count = 0, bytes = 0;
  for (const std::string& id : ids) {
    absl::StatusOr<size_t> freed = Release(tenant, id);
    if (freed.ok()) {
      ++count;
      bytes += *freed;
    }
  }
  return {count, bytes};
}

absl::StatusOr<SequenceInfo> SequenceStore::Describe(const TenantId& tenant,
                                                     const std::string& id) const {
  std::shared_ptr<Sequence> seq = Find(tenant, id);
  if (seq == nullptr) return Missing(tenant, id);
  absl::MutexLock lock(&seq->mu);
  return seq->InfoLocked(*pool_);
}

absl::StatusOr<std::unique_ptr<SequenceSnapshot>> SequenceStore::Snapshot(
    const TenantId& tenant, const std::string& id, absl::Span<const int> layers,
    SnapshotPages pages) const {
  std::shared_ptr<Sequence> seq = Find(tenant, id);
  if (seq == nullptr) return Missing(tenant, id);
  seq->Touch();  // reads and attention renew the lease
  const Model& m = *seq->model;
  for (int layer : layers) {
    if (layer < 0 || layer >= m.num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, " out of range [0, ", m.num_layers, ")"));
    }
  }
  if (seq->corrupt.load()) return CorruptSequenceError(id);
  auto snap = std::unique_ptr<SequenceSnapshot>(new SequenceSnapshot());
  snap->seq_ = seq;
  snap->counters_ = integrity_;
  snap->model_ = seq->model;
  snap->id_ = seq->id;
  snap->incarnation_ = seq->incarnation;
  absl::MutexLock lock(&seq->mu);
  if (seq->released) {
    return internal::ReleasedError(id, seq->expired);
  }
  snap->sink_ = seq->layout.sink();
  snap->history_ = seq->layout.history();
  snap->recent_ = seq->layout.recent();
  snap->recent_head_ = seq->recent_head;
  snap->chain_ = seq->chain;
  // The snapshot's references, and the block ids its readers address the pages by.
  auto take = [&](const auto& layer_pages, std::vector<int32_t>* ids) {
    if (pages == SnapshotPages::kNone) return;
    ids->reserve(layer_pages.size());
    for (PageId page : layer_pages) {
      ids->push_back(pool_->BlockId(page));
      snap->refs_.push_back(page);
    }
  };
  auto add = [&](int layer) {
    const LayerPages& p = seq->layers[layer];
    SequenceSnapshot::Layer l;
    l.layer = layer;
    take(p.sink, &l.sink);
    take(p.history, &l.history);
    take(p.recent, &l.recent);
    snap->layers_.push_back(std::move(l));
  };
  if (layers.empty()) {
    for (int layer = 0; layer < m.num_layers; ++layer) add(layer);
  } else {
    // Repeats are merged (first occurrence kept), so a snapshot holds each layer at most once
    // however long the client's list is.
    std::vector<bool> taken(m.num_layers, false);
    for (int layer : layers) {
      if (taken[layer]) continue;
      taken[layer] = true;
      add(layer);
    }
  }
  pool_->RefAll(snap->refs_);
  snap->pool_ = pool_;
  snap->history_pool_ = pool_->View(m.block_layout, m.codec.quant.scale_dtype);
  snap->bf16_pool_ = pool_->View(m.bf16_layout, m.codec.quant.scale_dtype);
  return snap;
}

absl::StatusOr<std::unique_ptr<LayerWatch>> SequenceStore::WatchLayer(const TenantId& tenant,
                                                                      const std::string& id,
                                                                      const Model& model,
                                                                      int layer) const {
  std::shared_ptr<Sequence> seq = Find(tenant, id);
  if (seq == nullptr) return Missing(tenant, id);
  const Model& m = *seq->model;
  if (m.id != model.id || m.version != model.version) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", Quote(id), " belongs to model '",
                                                   m.id, "', not ", Quote(model.id)));
  }
  if (layer < 0 || layer >= m.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", m.num_layers, ")"));
  }
  return std::unique_ptr<LayerWatch>(new LayerWatch(pool_, std::move(seq), layer));
}

std::vector<std::pair<TenantId, std::string>> SequenceStore::Keys() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<TenantId, std::string>> keys;
  keys.reserve(sequences_.size());
  for (const auto& entry : sequences_) keys.push_back(entry.first);
  return keys;
}

std::vector<SequenceInfo> SequenceStore::List(const TenantId& tenant) const {
  std::vector<std::shared_ptr<Sequence>> seqs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, seq] : sequences_) {
      if (key.first == tenant) seqs.push_back(seq);
    }
  }
  std::vector<SequenceInfo> out;
  for (const auto& seq : seqs) {
    absl::MutexLock lock(&seq->mu);
    out.push_back(seq->InfoLocked(*pool_));
  }
  return out;
}

std::map<std::string, StoreTotals> SequenceStore::TotalsByModel(const TenantId& tenant) const {
  std::vector<std::shared_ptr<Sequence>> seqs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, seq] : sequences_) {
      if (key.first == tenant) seqs.push_back(seq);
    }
  }
  std::map<std::string, StoreTotals> out;
  std::map<std::string, absl::flat_hash_set<PageId>> pages;
  for (const auto& seq : seqs) {
    absl::MutexLock lock(&seq->mu);
    StoreTotals& t = out[seq->model->id];
    ++t.sequences;
    t.sink_tokens += seq->layout.sink();
    t.history_tokens += seq->layout.history();
    t.recent_tokens += seq->layout.recent();
    t.bf16_equivalent_bytes += static_cast<size_t>(seq->layout.total()) *
                               seq->model->bf16_token_bytes() * seq->model->num_layers;
    auto& set = pages[seq->model->id];
    for (PageId p : seq->AllPagesLocked()) {
      if (set.insert(p).second) t.pool_bytes += pool_->PageBytes(p);
    }
  }
  return out;
}

size_t SequenceStore::size() const {
  absl::MutexLock lock(&mu_);
  return sequences_.size();
}

}  // namespace kvpool::server
