#include "server/prefix_index.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "common/status_macros.h"

namespace kvpool::server {
namespace {

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void PutString(std::string* out, const std::string& s) {
  PutU32(out, static_cast<uint32_t>(s.size()));
  out->append(s);
}

}  // namespace

PrefixUnitKey PrefixUnitRange(const PrefixContext& ctx, int index) {
  PrefixUnitKey key;
  if (ctx.sink_tokens > 0 && index == 0) {
    key.kind = PrefixUnitKind::kSink;
    key.token_start = 0;
    key.token_count = ctx.sink_tokens;
    return key;
  }
  const int block = ctx.sink_tokens > 0 ? index - 1 : index;
  key.kind = PrefixUnitKind::kBlock;
  key.token_start = ctx.sink_tokens + block * ctx.block_tokens;
  key.token_count = ctx.block_tokens;
  return key;
}

PrefixHash HashPrefixUnit(const PrefixContext& ctx, const PrefixHash& parent, PrefixUnitKind kind,
                          absl::Span<const uint32_t> tokens) {
  std::string buf;
  buf.reserve(64 + ctx.tenant.size() + ctx.model_id.size() + 32 * 2 + tokens.size() * 4);
  buf.append("kvpool-prefix", 13);
  buf.push_back('\0');
  PutString(&buf, ctx.tenant);
  PutString(&buf, ctx.model_id);
  buf.append(reinterpret_cast<const char*>(ctx.codec_version.data()), ctx.codec_version.size());
  buf.append(reinterpret_cast<const char*>(parent.data()), parent.size());
  PutU32(&buf, static_cast<uint32_t>(kind));
  PutU32(&buf, static_cast<uint32_t>(tokens.size()));
  for (uint32_t t : tokens) PutU32(&buf, t);
  return Sha256(buf.data(), buf.size());
}

std::vector<PrefixUnitKey> ComputePrefixChain(const PrefixContext& ctx,
                                              absl::Span<const uint32_t> token_ids) {
  std::vector<PrefixUnitKey> chain;
  PrefixHash parent{};
  for (int i = 0;; ++i) {
    PrefixUnitKey key = PrefixUnitRange(ctx, i);
    if (key.token_count <= 0) break;
    const size_t end = static_cast<size_t>(key.token_start) + key.token_count;
    if (end > token_ids.size()) break;
    key.hash =
        HashPrefixUnit(ctx, parent, key.kind, token_ids.subspan(key.token_start, key.token_count));
    parent = key.hash;
    chain.push_back(key);
  }
  return chain;
}

std::string PrefixHashHex(const PrefixHash& h) { return ToHex(h); }

PrefixIndex::~PrefixIndex() {
  absl::MutexLock lock(&mu_);
  for (auto& [hash, e] : entries_) pool_->UnrefAll(e.pages);
  entries_.clear();
  lru_.clear();
}

bool PrefixIndex::Publish(const PrefixContext& ctx, const PrefixUnitKey& key,
                          const PrefixHash& parent, absl::Span<const PageId> pages) {
  absl::MutexLock lock(&mu_);
  if (entries_.contains(key.hash)) return false;
  const bool first = key.token_start == 0;
  Entry* parent_entry = nullptr;
  if (!first) {
    auto it = entries_.find(parent);
    // An orphan could never be reached by a chain walk; it would only hold memory.
    if (it == entries_.end()) return false;
    parent_entry = &it->second;
  }
  Entry e;
  e.key = key;
  e.parent = parent;
  e.has_parent = !first;
  e.tenant = ctx.tenant;
  e.model_id = ctx.model_id;
  e.codec_version = ctx.codec_version;
  e.pages.assign(pages.begin(), pages.end());
  e.last_use = ++clock_;
  pool_->RefAll(e.pages);
  if (parent_entry != nullptr) ++parent_entry->children;
  lru_.emplace(e.last_use, key.hash);
  auto [it, inserted] = entries_.emplace(key.hash, std::move(e));
  if (observer_ != nullptr) observer_->OnStored(ViewOf(it->second));
  return inserted;
}

std::vector<PrefixMatch> PrefixIndex::Match(const PrefixContext& ctx,
                                            absl::Span<const PrefixUnitKey> chain, bool take_refs) {
  absl::MutexLock lock(&mu_);
  std::vector<PrefixMatch> out;
  ++lookups_;
  for (const PrefixUnitKey& key : chain) lookup_tokens_ += static_cast<uint64_t>(key.token_count);
  for (const PrefixUnitKey& key : chain) {
    auto it = entries_.find(key.hash);
    if (it == entries_.end()) break;
    Entry& e = it->second;
    // The hash covers all of these; checking them too costs nothing and rules out a collision.
    if (e.tenant != ctx.tenant || e.model_id != ctx.model_id ||
        e.codec_version != ctx.codec_version || e.key.token_start != key.token_start ||
        e.key.token_count != key.token_count || e.key.kind != key.kind) {
      break;
    }
    lru_.erase({e.last_use, key.hash});
    e.last_use = ++clock_;
    lru_.emplace(e.last_use, key.hash);
    if (take_refs) pool_->RefAll(e.pages);
    out.push_back(PrefixMatch{e.key, e.pages});
    hit_tokens_ += static_cast<uint64_t>(key.token_count);
  }
  return out;
}

bool PrefixIndex::Contains(const PrefixHash& hash) const {
  absl::MutexLock lock(&mu_);
  return entries_.contains(hash);
}

PrefixUnitView PrefixIndex::ViewOf(const Entry& e) {
  return PrefixUnitView{&e.tenant, &e.model_id, &e.key, e.has_parent ? &e.parent : nullptr};
}

size_t PrefixIndex::RemoveLocked(const PrefixHash& hash, PrefixRemoval why, bool unref) {
  auto it = entries_.find(hash);
  if (it == entries_.end()) return 0;
  Entry& e = it->second;
  if (observer_ != nullptr) observer_->OnRemoved(ViewOf(e), why);
  if (e.has_parent) {
    auto p = entries_.find(e.parent);
    if (p != entries_.end()) --p->second.children;
  }
  lru_.erase({e.last_use, hash});
  const size_t freed = unref ? pool_->UnrefAll(e.pages) : 0;
  entries_.erase(it);
  return freed;
}

bool PrefixIndex::EvictableLocked(const Entry& e) const {
  for (PageId p : e.pages) {
    if (pool_->RefCount(p) != 1) return false;
  }
  return true;
}

size_t PrefixIndex::EvictOne() {
  absl::MutexLock lock(&mu_);
  for (const auto& [tick, hash] : lru_) {
    const Entry& e = entries_.at(hash);
    if (e.children > 0 || !EvictableLocked(e)) continue;
    const PrefixHash victim = hash;
    ++evicted_;
    return RemoveLocked(victim, PrefixRemoval::kEvicted);
  }
  return 0;
}

std::vector<PrefixHash> PrefixIndex::EvictionOrderLocked(const TenantId& tenant) const {
  // Candidates by (another tenant's, last use): the requester's own units go first.
  using Rank = std::tuple<bool, uint64_t, PrefixHash>;
  std::priority_queue<Rank, std::vector<Rank>, std::greater<Rank>> leaves;
  auto rank = [&](const Entry& e, const PrefixHash& hash) {
    return Rank{e.tenant != tenant, e.last_use, hash};
  };
  for (const auto& [hash, e] : entries_) {
    if (e.children == 0 && EvictableLocked(e)) leaves.push(rank(e, hash));
  }
  absl::flat_hash_map<PrefixHash, int, HashHasher> children_left;
  std::vector<PrefixHash> order;
  while (!leaves.empty()) {
    const PrefixHash hash = std::get<2>(leaves.top());
    leaves.pop();
    order.push_back(hash);
    const Entry& e = entries_.at(hash);
    if (!e.has_parent) continue;
    auto parent = entries_.find(e.parent);
    if (parent == entries_.end()) continue;
    auto [left, inserted] = children_left.try_emplace(e.parent, parent->second.children);
    if (--left->second == 0 && EvictableLocked(parent->second)) {
      leaves.push(rank(parent->second, e.parent));
    }
  }
  return order;
}

absl::Status PrefixIndex::AllocateEvicting(const TenantId& tenant,
                                           absl::Span<const PageRequest> requests,
                                           std::vector<std::vector<PageId>>* out) {
  KVPOOL_ASSIGN_OR_RETURN(const AccountId account, pool_->Account(tenant));
  // Most appends fit the free pages and the tenant's quota: no need to rank the cache for them.
  absl::StatusOr<std::vector<size_t>> fitted = pool_->AllocateReleasing(account, requests, {}, out);
  if (fitted.ok() || !absl::IsResourceExhausted(fitted.status())) return fitted.status();
  absl::MutexLock lock(&mu_);
  // Under the index lock nobody can take a reference on a unit held only by the index (Match
  // is the only way to one), so the order stays valid through the pool's decision.
  const std::vector<PrefixHash> order = EvictionOrderLocked(tenant);
  if (order.empty()) return fitted.status();
  std::vector<absl::Span<const PageId>> groups;
  groups.reserve(order.size());
  for (const PrefixHash& hash : order) groups.push_back(entries_.at(hash).pages);
  KVPOOL_ASSIGN_OR_RETURN(std::vector<size_t> released,
                          pool_->AllocateReleasing(account, requests, groups, out));
  for (size_t i : released) RemoveLocked(order[i], PrefixRemoval::kEvicted, /*unref=*/false);
  evicted_ += released.size();
  return absl::OkStatus();
}

size_t PrefixIndex::DropModel(const TenantId& tenant, const std::string& model_id) {
  absl::MutexLock lock(&mu_);
  std::vector<PrefixHash> victims;
  for (const auto& [hash, e] : entries_) {
    if (e.tenant == tenant && e.model_id == model_id) victims.push_back(hash);
  }
  size_t freed = 0;
  for (const PrefixHash& h : victims) freed += RemoveLocked(h, PrefixRemoval::kModelDropped);
  return freed;
}

std::vector<PrefixHash> PrefixIndex::UnitHashes() const {
  absl::MutexLock lock(&mu_);
  std::vector<PrefixHash> out;
  out.reserve(entries_.size());
  for (const auto& [hash, e] : entries_) out.push_back(hash);
  return out;
}

bool PrefixIndex::RefUnit(const PrefixHash& hash, PrefixUnitPages* out) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(hash);
  if (it == entries_.end()) return false;
  const Entry& e = it->second;
  pool_->RefAll(e.pages);
  *out = PrefixUnitPages{hash, e.tenant, e.model_id, e.codec_version, e.key.kind, e.pages};
  return true;
}

size_t PrefixIndex::DropCorrupt(const PrefixHash& hash) {
  absl::MutexLock lock(&mu_);
  if (!entries_.contains(hash)) return 0;
  // The unit and its descendants: a chain's units come after their parents by token_start.
  absl::flat_hash_set<PrefixHash, HashHasher> doomed = {hash};
  std::vector<const Entry*> by_start;
  for (const auto& [h, e] : entries_) by_start.push_back(&e);
  std::sort(by_start.begin(), by_start.end(),
            [](const Entry* a, const Entry* b) { return a->key.token_start < b->key.token_start; });
  for (const Entry* e : by_start) {
    if (e->has_parent && doomed.contains(e->parent)) doomed.insert(e->key.hash);
  }
  for (const PrefixHash& h : doomed) RemoveLocked(h, PrefixRemoval::kCorrupt);
  return doomed.size();
}

PrefixIndexStats PrefixIndex::Stats() const {
  absl::MutexLock lock(&mu_);
  PrefixIndexStats st;
  st.units = entries_.size();
  st.evicted_units = evicted_;
  st.lookups = lookups_;
  st.lookup_tokens = lookup_tokens_;
  st.hit_tokens = hit_tokens_;
  absl::flat_hash_set<PageId> seen;
  for (const auto& [hash, e] : entries_) {
    for (PageId p : e.pages) {
      if (!seen.insert(p).second) continue;
      const size_t bytes = pool_->PageBytes(p);
      st.bytes += bytes;
      if (pool_->RefCount(p) == 1) st.cached_bytes += bytes;
    }
  }
  return st;
}

void PrefixIndex::SetObserver(PrefixIndexObserver* observer) {
  absl::MutexLock lock(&mu_);
  observer_ = observer;
}

void PrefixIndex::VisitUnits(const std::function<void(const PrefixUnitView&)>& visit,
                             const std::function<void()>& then) const {
  absl::MutexLock lock(&mu_);
  // Parents before children: a unit's token_start is above its parent's.
  std::vector<const Entry*> order;
  order.reserve(entries_.size());
  for (const auto& [hash, e] : entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(),
            [](const Entry* a, const Entry* b) { return a->key.token_start < b->key.token_start; });
  for (const Entry* e : order) visit(ViewOf(*e));
  then();
}

}  // namespace kvpool::server
