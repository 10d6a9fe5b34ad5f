#include "server/block_pool.h"

#include <algorithm>
#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/tenant_quotas.h"

namespace kvpool::server {
namespace {

// Block ids are int32 byte offsets / stride: 16 bytes (every page size is a multiple of 16) up to
// a 32 GiB arena, a larger power of two beyond.
int64_t BlockStrideFor(size_t arena_bytes) {
  int64_t stride = 16;
  while (arena_bytes / static_cast<uint64_t>(stride) > static_cast<uint64_t>(INT32_MAX)) {
    stride *= 2;
  }
  return stride;
}

}  // namespace

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(std::unique_ptr<Arena> arena,
                                                             size_t slab_bytes) {
  if (arena == nullptr) return absl::InvalidArgumentError("BlockPool needs an arena");
  if (slab_bytes == 0 || slab_bytes % 64 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("slab size must be a positive multiple of 64, got ", slab_bytes));
  }
  const size_t num_slabs = arena->size() / slab_bytes;
  if (num_slabs == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pool of ", arena->size(), " bytes is smaller than one slab of ", slab_bytes, " bytes"));
  }
  // Slab index lives in 16 bits of a PageId (0xffff is reserved for kInvalidPage).
  if (num_slabs >= 0xffff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pool has ", num_slabs, " slabs; at most 65534 are addressable: raise --slab_bytes"));
  }
  const int64_t stride = BlockStrideFor(arena->size());
  if (slab_bytes % stride != 0) {
    return absl::InvalidArgumentError(absl::StrCat("slab size ", slab_bytes,
                                                   " must be a multiple of ", stride,
                                                   " for a pool of ", arena->size(), " bytes"));
  }
  return std::unique_ptr<BlockPool>(new BlockPool(std::move(arena), slab_bytes, num_slabs, stride));
}

BlockPool::BlockPool(std::unique_ptr<Arena> arena, size_t slab_bytes, size_t num_slabs,
                     int64_t block_stride)
    : arena_(std::move(arena)),
      base_(arena_->data()),
      slab_bytes_(slab_bytes),
      num_slabs_(num_slabs),
      block_stride_(block_stride),
      slab_page_bytes_(num_slabs, 0),
      checksums_(num_slabs),
      checksum_slots_(num_slabs, 0),
      slabs_(num_slabs) {
  for (size_t i = 0; i < num_slabs; ++i) free_slabs_.insert(static_cast<int>(i));
  accounts_.push_back(AccountState{kDefaultTenant, {}, {0, 0}});
  account_ids_.emplace(kDefaultTenant, kDefaultAccount);
}

absl::Status BlockPool::CheckPageBytes(size_t page_bytes) const {
  if (page_bytes == 0 || page_bytes % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page size must be a positive multiple of 16, got ", page_bytes));
  }
  page_bytes = StridePageBytes(page_bytes);
  if (page_bytes > slab_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("page of ", page_bytes,
                                                   " bytes does not fit a slab of ", slab_bytes_,
                                                   " bytes (raise --slab_bytes)"));
  }
  return absl::OkStatus();
}

size_t BlockPool::StridePageBytes(size_t page_bytes) const {
  // Every page offset a multiple of the stride: whole block ids.
  const size_t stride = static_cast<size_t>(block_stride_);
  return (page_bytes + stride - 1) / stride * stride;
}

absl::StatusOr<PageClassId> BlockPool::RegisterClass(size_t page_bytes) {
  KVPOOL_RETURN_IF_ERROR(CheckPageBytes(page_bytes));
  page_bytes = StridePageBytes(page_bytes);
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < classes_.size(); ++i) {
    if (classes_[i].page_bytes == page_bytes) return static_cast<PageClassId>(i);
  }
  PageClass c;
  c.page_bytes = page_bytes;
  c.pages_per_slab = std::min<size_t>(slab_bytes_ / page_bytes, 0x10000);
  classes_.push_back(std::move(c));
  return static_cast<PageClassId>(classes_.size() - 1);
}

size_t BlockPool::ClassPageBytes(PageClassId cls) const {
  absl::MutexLock lock(&mu_);
  return classes_.at(cls).page_bytes;
}

absl::Status BlockPool::Allocate(PageClassId cls, size_t count, std::vector<PageId>* out) {
  absl::MutexLock lock(&mu_);
  if (cls < 0 || static_cast<size_t>(cls) >= classes_.size()) {
    return absl::InternalError(absl::StrCat("unknown page class ", cls));
  }
  if (count == 0) return absl::OkStatus();
  PageClass& c = classes_[cls];
  // Check capacity first so that a failure changes nothing.
  size_t available = free_slabs_.size() * c.pages_per_slab;
  for (int s : c.slabs_with_free) available += slabs_[s].free_slots.size();
  if (available < count) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "block pool exhausted: need ", count, " pages of ", c.page_bytes, " bytes, ", available,
        " available (", used_bytes_, " of ", capacity_bytes(), " bytes in use)"));
  }
  AllocateLocked(cls, count, kDefaultAccount, PageTier::kBf16, out);
  return absl::OkStatus();
}

void BlockPool::AllocateLocked(PageClassId cls, size_t count, AccountId account, PageTier tier,
                               std::vector<PageId>* out) {
  PageClass& c = classes_[cls];
  out->reserve(out->size() + count);
  for (size_t i = 0; i < count; ++i) {
    if (c.slabs_with_free.empty()) {
      const int s = *free_slabs_.begin();
      free_slabs_.erase(free_slabs_.begin());
      Slab& slab = slabs_[s];
      slab.cls = cls;
      slab.page_bytes = c.page_bytes;
      slab.refcounts.assign(c.pages_per_slab, 0);
      slab.owners.assign(c.pages_per_slab, kDefaultAccount);
      slab.tiers.assign(c.pages_per_slab, PageTier::kBf16);
      slab.free_slots.resize(c.pages_per_slab);
      // Pop from the back: hand out low slots first.
      for (size_t k = 0; k < c.pages_per_slab; ++k) {
        slab.free_slots[k] = static_cast<uint16_t>(c.pages_per_slab - 1 - k);
      }
      slab.in_use = 0;
      slab_page_bytes_[s] = c.page_bytes;
      if (checksum_slots_[s] < c.pages_per_slab) {
        checksums_[s].reset(new std::atomic<uint64_t>[c.pages_per_slab]);
        checksum_slots_[s] = c.pages_per_slab;
      }
      ++c.slabs;
      c.slabs_with_free.insert(s);
    }
    const int s = *c.slabs_with_free.begin();
    Slab& slab = slabs_[s];
    const uint16_t slot = slab.free_slots.back();
    slab.free_slots.pop_back();
    slab.refcounts[slot] = 1;
    slab.owners[slot] = account;
    slab.tiers[slot] = tier;
    checksums_[s][slot].store(0, std::memory_order_relaxed);  // published with the page id
    ++slab.in_use;
    if (slab.free_slots.empty()) c.slabs_with_free.erase(s);
    out->push_back((static_cast<PageId>(s) << 16) | slot);
  }
  c.pages_in_use += count;
  used_bytes_ += count * c.page_bytes;
  accounts_[account].tier_bytes[static_cast<int>(tier)] += count * c.page_bytes;
}

size_t BlockPool::UnusedGuaranteesLocked(AccountId account) const {
  size_t unused = 0;
  for (size_t a = 0; a < accounts_.size(); ++a) {
    const AccountState& s = accounts_[a];
    if (a != account && s.limits.guaranteed_bytes > s.bytes()) {
      unused += s.limits.guaranteed_bytes - s.bytes();
    }
  }
  return unused;
}

absl::StatusOr<std::vector<size_t>> BlockPool::AllocateReleasing(
    AccountId account, absl::Span<const PageRequest> requests,
    absl::Span<const absl::Span<const PageId>> releasable, std::vector<std::vector<PageId>>* out) {
  absl::MutexLock lock(&mu_);
  if (account >= accounts_.size()) {
    return absl::InternalError(absl::StrCat("unknown account ", account));
  }
  std::vector<size_t> need(classes_.size(), 0);
  size_t request_bytes = 0;
  for (const PageRequest& r : requests) {
    if (r.cls < 0 || static_cast<size_t>(r.cls) >= classes_.size()) {
      return absl::InternalError(absl::StrCat("unknown page class ", r.cls));
    }
    need[r.cls] += r.count;
    request_bytes += r.count * classes_[r.cls].page_bytes;
  }
  const AccountState& me = accounts_[account];
  // Free bytes other accounts' unused guarantees hold: releasing their pages never changes it
  // (a release stops at its owner's guarantee).
  const size_t held_for_others = UnusedGuaranteesLocked(account);
  // The pool as it would be after releasing a set of groups: whole free slabs, and per class
  // the free slots of its partly used slabs (Allocate fills those before taking a free slab).
  struct Simulation {
    size_t free_slabs = 0;
    std::vector<size_t> free_slots;
    size_t released_bytes = 0;  // by every release chosen so far
    absl::flat_hash_map<AccountId, size_t> released_by_owner;
    absl::flat_hash_map<PageId, uint32_t> drops;   // references dropped per page
    absl::flat_hash_map<int, size_t> slab_in_use;  // occupancy of touched slabs
    std::vector<size_t> released;                  // the groups, in order
  };
  Simulation base;
  base.free_slabs = free_slabs_.size();
  base.free_slots.assign(classes_.size(), 0);
  for (size_t cls = 0; cls < classes_.size(); ++cls) {
    for (int s : classes_[cls].slabs_with_free) base.free_slots[cls] += slabs_[s].free_slots.size();
  }
  auto released_of = [](const Simulation& sim, AccountId a) {
    auto it = sim.released_by_owner.find(a);
    return it == sim.released_by_owner.end() ? size_t{0} : it->second;
  };
  auto pool_fits = [&](const Simulation& sim) {
    if (used_bytes_ - sim.released_bytes + request_bytes + held_for_others > capacity_bytes()) {
      return false;
    }
    size_t slabs_needed = 0;
    for (size_t cls = 0; cls < classes_.size(); ++cls) {
      if (need[cls] <= sim.free_slots[cls]) continue;
      const size_t per_slab = classes_[cls].pages_per_slab;
      slabs_needed += (need[cls] - sim.free_slots[cls] + per_slab - 1) / per_slab;
    }
    return slabs_needed <= sim.free_slabs;
  };
  auto quota_fits = [&](const Simulation& sim) {
    return me.limits.max_bytes == 0 ||
           me.bytes() - released_of(sim, account) + request_bytes <= me.limits.max_bytes;
  };
  // Adds group `g` to `sim` unless it would free nothing, or it is another account's and may not
  // be released (the pool fits already, or its owner would fall below its guarantee).
  auto release = [&](Simulation* sim, size_t g) {
    const bool pool_ok = pool_fits(*sim);
    // The pages this group would free, and whose they are.
    std::vector<PageId> freed;
    size_t freed_bytes = 0;
    absl::flat_hash_map<PageId, uint32_t> local;
    for (PageId p : releasable[g]) {
      const Slab& slab = slabs_[p >> 16];
      const size_t slot = p & 0xffffu;
      if (slab.cls < 0 || slot >= slab.refcounts.size()) continue;
      auto d = sim->drops.find(p);
      const uint32_t dropped = (d == sim->drops.end() ? 0 : d->second) + ++local[p];
      if (dropped == slab.refcounts[slot]) {
        freed.push_back(p);
        freed_bytes += slab.page_bytes;
      }
    }
    if (freed.empty()) return;
    const AccountId owner = slabs_[freed.front() >> 16].owners[freed.front() & 0xffffu];
    if (owner != account) {
      // Another account's pages help only the pool, and never below its guarantee.
      if (pool_ok) return;
      const AccountState& o = accounts_[owner];
      if (o.bytes() - released_of(*sim, owner) - freed_bytes < o.limits.guaranteed_bytes) return;
    }
    for (const auto& [p, n] : local) sim->drops[p] += n;
    for (PageId p : freed) {
      const int s = static_cast<int>(p >> 16);
      const Slab& slab = slabs_[s];
      sim->released_by_owner[slab.owners[p & 0xffffu]] += slab.page_bytes;
      auto [it, inserted] = sim->slab_in_use.try_emplace(s, slab.in_use);
      if (--it->second > 0) {
        ++sim->free_slots[slab.cls];
      } else {
        // The whole slab comes free: its slots stop counting for its class.
        sim->free_slots[slab.cls] -= classes_[slab.cls].pages_per_slab - 1;
        ++sim->free_slabs;
      }
    }
    sim->released_bytes += freed_bytes;
    sim->released.push_back(g);
  };
  auto fits = [&](const Simulation& sim) { return pool_fits(sim) && quota_fits(sim); };
  std::vector<size_t> released;
  if (!fits(base)) {
    // Release groups in order until everything fits...
    Simulation sim = base;
    for (size_t g = 0; g < releasable.size() && !fits(sim); ++g) release(&sim, g);
    if (!quota_fits(sim)) {
      return QuotaError(me.name, QuotaKind::kPoolBytes, me.limits.max_bytes, me.bytes(),
                        request_bytes);
    }
    if (!pool_fits(sim)) {
      size_t pages = 0;
      for (const PageRequest& r : requests) pages += r.count;
      return absl::ResourceExhaustedError(
          absl::StrCat("block pool exhausted: need ", pages, " pages (", request_bytes,
                       " bytes), and evicting every evictable cached unit would not make room (",
                       used_bytes_, " of ", capacity_bytes(), " bytes in use, ", held_for_others,
                       " held for other tenants' guaranteed shares)"));
    }
    // ...then keep only the groups the fit needs: one that freed pages of a class the request
    // does not use, in slabs that stay in use, or bytes a later group's made unnecessary, is
    // left alone. The latest chosen are dropped first, so what is released stays the earliest
    // in the given order.
    released = sim.released;
    for (size_t i = released.size(); i-- > 0;) {
      Simulation without = base;
      for (size_t j = 0; j < released.size(); ++j) {
        if (j != i) release(&without, released[j]);
      }
      if (fits(without)) {
        released = without.released;
        i = std::min(i, released.size());
      }
    }
    for (size_t g : released) {
      for (PageId p : releasable[g]) UnrefLocked(p);
    }
  }
  out->assign(requests.size(), {});
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i].count > 0) {
      AllocateLocked(requests[i].cls, requests[i].count, account, requests[i].tier, &(*out)[i]);
    }
  }
  return released;
}

absl::StatusOr<AccountId> BlockPool::Account(const TenantId& name) {
  absl::MutexLock lock(&mu_);
  auto it = account_ids_.find(name);
  if (it != account_ids_.end()) return it->second;
  if (accounts_.size() > 0xffff) {
    return absl::ResourceExhaustedError("the pool keeps at most 65536 tenant accounts");
  }
  const AccountId id = static_cast<AccountId>(accounts_.size());
  accounts_.push_back(AccountState{name, {}, {0, 0}});
  account_ids_.emplace(name, id);
  return id;
}

absl::Status BlockPool::SetAccountLimits(const std::map<TenantId, AccountLimits>& limits) {
  absl::MutexLock lock(&mu_);
  size_t new_accounts = 0;
  for (const auto& [name, l] : limits) new_accounts += account_ids_.count(name) == 0 ? 1 : 0;
  if (accounts_.size() + new_accounts > 0x10000) {
    return absl::ResourceExhaustedError("the pool keeps at most 65536 tenant accounts");
  }
  for (AccountState& a : accounts_) a.limits = AccountLimits{};
  for (const auto& [name, l] : limits) {
    auto [it, inserted] = account_ids_.try_emplace(name, static_cast<AccountId>(accounts_.size()));
    if (inserted) accounts_.push_back(AccountState{name, {}, {0, 0}});
    accounts_[it->second].limits = l;
  }
  return absl::OkStatus();
}

AccountUsage BlockPool::UsageOf(const TenantId& name) const {
  absl::MutexLock lock(&mu_);
  AccountUsage u;
  auto it = account_ids_.find(name);
  if (it == account_ids_.end()) return u;
  const AccountState& a = accounts_[it->second];
  u.tier_bytes[0] = a.tier_bytes[0];
  u.tier_bytes[1] = a.tier_bytes[1];
  u.limits = a.limits;
  return u;
}

AccountId BlockPool::OwnerOf(PageId page) const {
  absl::MutexLock lock(&mu_);
  const Slab& slab = slabs_[page >> 16];
  const size_t slot = page & 0xffffu;
  return slot < slab.owners.size() ? slab.owners[slot] : kDefaultAccount;
}

BlockPool::Slab& BlockPool::SlabOf(PageId page) { return slabs_[page >> 16]; }

void BlockPool::Ref(PageId page) {
  absl::MutexLock lock(&mu_);
  ++SlabOf(page).refcounts[page & 0xffffu];
}

void BlockPool::RefAll(absl::Span<const PageId> pages) {
  absl::MutexLock lock(&mu_);
  for (PageId p : pages) ++SlabOf(p).refcounts[p & 0xffffu];
}

size_t BlockPool::UnrefLocked(PageId page) {
  const int s = static_cast<int>(page >> 16);
  Slab& slab = slabs_[s];
  const uint16_t slot = static_cast<uint16_t>(page & 0xffffu);
  uint32_t& rc = slab.refcounts[slot];
  if (rc == 0) return 0;  // a double free is a bug; never corrupt the free lists for it
  if (--rc > 0) return 0;
  PageClass& c = classes_[slab.cls];
  const bool was_full = slab.free_slots.empty();
  slab.free_slots.push_back(slot);
  --slab.in_use;
  --c.pages_in_use;
  used_bytes_ -= c.page_bytes;
  accounts_[slab.owners[slot]].tier_bytes[static_cast<int>(slab.tiers[slot])] -= c.page_bytes;
  if (slab.in_use == 0) {
    // Whole slab free: give it back so that any class can use it.
    c.slabs_with_free.erase(s);
    --c.slabs;
    slab.cls = -1;
    slab.free_slots.clear();
    slab.free_slots.shrink_to_fit();
    slab.refcounts.clear();
    slab.refcounts.shrink_to_fit();
    slab.owners.clear();
    slab.owners.shrink_to_fit();
    slab.tiers.clear();
    slab.tiers.shrink_to_fit();
    free_slabs_.insert(s);
  } else if (was_full) {
    c.slabs_with_free.insert(s);
  }
  return c.page_bytes;
}

size_t BlockPool::Unref(PageId page) {
  absl::MutexLock lock(&mu_);
  return UnrefLocked(page);
}

size_t BlockPool::UnrefAll(absl::Span<const PageId> pages) {
  absl::MutexLock lock(&mu_);
  size_t freed = 0;
  for (PageId p : pages) freed += UnrefLocked(p);
  return freed;
}

int BlockPool::RefCount(PageId page) const {
  absl::MutexLock lock(&mu_);
  const Slab& slab = slabs_[page >> 16];
  const size_t slot = page & 0xffffu;
  return slot < slab.refcounts.size() ? static_cast<int>(slab.refcounts[slot]) : 0;
}

size_t BlockPool::PageBytes(PageId page) const { return slab_page_bytes_[page >> 16]; }

BlockPool::PageTotals BlockPool::Totals(absl::Span<const PageId> pages) const {
  PageTotals t;
  absl::MutexLock lock(&mu_);
  for (PageId p : pages) {
    const size_t bytes = slab_page_bytes_[p >> 16];
    t.bytes += bytes;
    const Slab& slab = slabs_[p >> 16];
    const size_t slot = p & 0xffffu;
    if (slot < slab.refcounts.size() && slab.refcounts[slot] > 1) t.shared_bytes += bytes;
  }
  return t;
}

size_t BlockPool::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_bytes_;
}

PagedKvView BlockPool::View(const BlockLayout& layout, ScaleDtype scale_dtype) const {
  PagedKvView v;
  v.pool = base_;
  v.layout = layout;
  v.scale_dtype = scale_dtype;
  v.num_blocks = static_cast<int64_t>(arena_->size() / static_cast<size_t>(block_stride_));
  v.block_stride = block_stride_;
  return v;
}

BlockPoolStats BlockPool::Stats() const {
  absl::MutexLock lock(&mu_);
  BlockPoolStats st;
  st.capacity_bytes = capacity_bytes();
  st.slab_bytes = slab_bytes_;
  st.slabs_total = num_slabs_;
  st.slabs_in_use = num_slabs_ - free_slabs_.size();
  st.used_bytes = used_bytes_;
  for (const PageClass& c : classes_) {
    st.classes.push_back({c.page_bytes, c.pages_in_use, c.slabs});
    st.pages_in_use += c.pages_in_use;
  }
  for (const Slab& slab : slabs_) {
    if (slab.cls < 0) continue;
    for (uint32_t rc : slab.refcounts) {
      if (rc > 1) st.shared_bytes += slab.page_bytes;
    }
  }
  return st;
}

}  // namespace kvpool::server
