// BlockPool: kvpoold's memory, one arena carved into fixed-size pages with reference counts.
//
// The arena (host memory from the backend) is split into equal slabs. A slab is assigned to one
// page class (a page size: a model's INT2 block, or its BF16 page) on demand and handed back when
// all its pages are free, so models with different block sizes share one arena without
// fragmenting it below slab granularity. Pages are reference counted: Allocate returns pages
// with count 1, Ref/Unref adjust it and a page returns to its slab's free list at 0. Accounting
// is exact: used bytes are always the sum of live pages' sizes.
//
// Besides its PageId (the allocator's handle), a page has a block id: its byte offset in the arena
// / block_stride(), the int32 that the paged KV description (kernels/paged_kv.h) and the kernels
// address it by through View().
//
//   auto pool = BlockPool::Create(std::move(arena), /*slab_bytes=*/4 << 20);
//   PageClassId cls = *(*pool)->RegisterClass(layout.block_bytes());
//   std::vector<PageId> pages;
//   KVPOOL_RETURN_IF_ERROR((*pool)->Allocate(cls, 10, &pages));  // all or nothing
//   uint8_t* data = (*pool)->Data(pages[0]);
//   (*pool)->UnrefAll(pages);                                     // frees them
//
// Beside the pages, the pool keeps each page's checksum record (PageChecksum): which slots were
// written and the checksum of their rows (kernels/page_checksum.h). Writers set it when their
// rows become visible (AppendTxn's commit); readers and the scrubber verify against it. A fresh
// page's record is empty.
//
// Accounts: every page is charged, from its allocation to its free, to the account its
// allocation named (a tenant: AllocateReleasing's `account`), in one tier (BF16 page or INT2
// block), however many references it gains later. An account may have a limit (its pool_bytes
// quota: an allocation that would pass it fails with RESOURCE_EXHAUSTED, reason QUOTA) and a
// guaranteed share: bytes of other accounts' allocations never take the part of its guarantee it
// does not use yet, and releases on another account's behalf never take it below its guarantee.
// Accounts without limits (the default) change nothing.
//
// Thread-safe: every method may be called concurrently. Data() is lock-free (pure arithmetic),
// and so are Checksum(), SetChecksum() and PageOf() for a page the caller holds a reference on.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"
#include "kernels/paged_kv.h"
#include "server/backend.h"
#include "server/tenant.h"

namespace kvpool::server {

// A page: slab index in the high bits, slot in the slab in the low 16 bits.
using PageId = uint32_t;
using PageClassId = int;

inline constexpr PageId kInvalidPage = 0xffffffffu;

// Who pays for a page: an index into the pool's accounts, one per tenant name.
using AccountId = uint16_t;
inline constexpr AccountId kDefaultAccount = 0;  // the default tenant ""

// The tier a page is charged in.
enum class PageTier : uint8_t { kBf16 = 0, kInt2 = 1 };
inline constexpr int kPageTiers = 2;

// An account's limits; 0 = none.
struct AccountLimits {
  size_t max_bytes = 0;         // the tenant's pool_bytes quota
  size_t guaranteed_bytes = 0;  // never taken from it on another account's behalf
};

struct AccountUsage {
  size_t tier_bytes[kPageTiers] = {0, 0};  // by PageTier
  AccountLimits limits;
  size_t bytes() const { return tier_bytes[0] + tier_bytes[1]; }
};

// A page's checksum record: slots [first, end) hold written rows whose checksum is `sum`.
struct PageChecksum {
  uint32_t first = 0;
  uint32_t end = 0;
  uint32_t sum = 0;
  bool empty() const { return end <= first; }
  int count() const { return empty() ? 0 : static_cast<int>(end - first); }
  bool operator==(const PageChecksum& o) const {
    return first == o.first && end == o.end && sum == o.sum;
  }
};

struct PageClassStats {
  size_t page_bytes = 0;
  size_t pages_in_use = 0;
  size_t slabs = 0;
};

// `count` pages of class `cls`: one part of an allocation of several classes at once.
struct PageRequest {
  PageClassId cls = 0;
  size_t count = 0;
  PageTier tier = PageTier::kBf16;
};

struct BlockPoolStats {
  size_t capacity_bytes = 0;
  size_t slab_bytes = 0;
  size_t slabs_total = 0;
  size_t slabs_in_use = 0;
  size_t used_bytes = 0;    // sum of live pages' sizes
  size_t shared_bytes = 0;  // of those, pages with a reference count > 1
  size_t pages_in_use = 0;
  std::vector<PageClassStats> classes;
};

class BlockPool {
 public:
  // Takes the arena; slab_bytes must be a multiple of 64 (and of the block stride) and at most
  // the arena size. InvalidArgument otherwise.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(std::unique_ptr<Arena> arena,
                                                           size_t slab_bytes);

  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // The class for pages of `page_bytes` (a multiple of 16, at most slab_bytes; rounded up to the
  // block stride); classes of equal size are one class. InvalidArgument when the size does not
  // fit.
  [[nodiscard]] absl::StatusOr<PageClassId> RegisterClass(size_t page_bytes);
  // RegisterClass's checks alone (nothing is registered).
  [[nodiscard]] absl::Status CheckPageBytes(size_t page_bytes) const;
  size_t ClassPageBytes(PageClassId cls) const;

  // Appends `count` fresh pages of `cls` (reference count 1, contents unspecified) to `out`,
  // charged to the default account as BF16 pages, regardless of limits (AllocateReleasing
  // applies them). All or nothing: ResourceExhausted leaves the pool and `out` unchanged.
  [[nodiscard]] absl::Status Allocate(PageClassId cls, size_t count, std::vector<PageId>* out);

  // Allocates every request for `account` (out->at(i) gets request i's pages; all or nothing).
  // When they do not fit (the free pages, the account's limit, the part of the pool other
  // accounts' unused guarantees hold), first drops one reference on each page of groups of
  // `releasable` (pages whose only reference the caller holds), taken in the given order: a
  // group of the account itself whenever something does not fit yet; a group of another account
  // only when the pool (not the limit) is short, and only if its owner stays at or above its
  // guarantee; of those, only the groups the fit needs are released (one whose pages are of a
  // class the request does not use and whose slab stays in use, or that a later group made
  // unnecessary, is kept; the latest in the order are left first). Returns the indices of the
  // released groups, ascending. Fails with nothing
  // released or allocated: RESOURCE_EXHAUSTED with reason QUOTA (limit, usage and request in the
  // message) when the account's limit cannot be met, plain RESOURCE_EXHAUSTED when the pool
  // cannot make room. The fit is worked out under one lock from the slabs' exact occupancy (a
  // freed page only makes room for its own class until its whole slab is free).
  [[nodiscard]] absl::StatusOr<std::vector<size_t>> AllocateReleasing(
      AccountId account, absl::Span<const PageRequest> requests,
      absl::Span<const absl::Span<const PageId>> releasable, std::vector<std::vector<PageId>>* out);

  // The account of tenant `name`, created (no limits) on first use. ResourceExhausted past
  // 65535 accounts.
  [[nodiscard]] absl::StatusOr<AccountId> Account(const TenantId& name);
  // Replaces every account's limits at once: those in `limits` get theirs (created as needed),
  // every other account none. Pages already charged stay charged: a lowered limit only refuses
  // new allocations.
  [[nodiscard]] absl::Status SetAccountLimits(const std::map<TenantId, AccountLimits>& limits);
  // Bytes charged to tenant `name` by tier, and its limits (zeros for an unknown name).
  AccountUsage UsageOf(const TenantId& name) const;
  // The account charged for `page` (a live page).
  AccountId OwnerOf(PageId page) const;

  void Ref(PageId page);
  void RefAll(absl::Span<const PageId> pages);
  // Drops one reference; the page is free at zero. Returns the bytes freed (0 or page size).
  size_t Unref(PageId page);
  size_t UnrefAll(absl::Span<const PageId> pages);
  int RefCount(PageId page) const;
  size_t PageBytes(PageId page) const;
  // Bytes of `pages`, and of those among them with more than one reference, under one lock
  // (a long sequence has tens of thousands of pages).
  struct PageTotals {
    size_t bytes = 0;
    size_t shared_bytes = 0;
  };
  PageTotals Totals(absl::Span<const PageId> pages) const;

  // Start of the page's bytes in the arena.
  uint8_t* Data(PageId page) const {
    return base_ + static_cast<size_t>(page >> 16) * slab_bytes_ + slot_offsets_(page);
  }

  // The page's block id: (Data(page) - arena start) / block_stride(), below 2^31.
  int32_t BlockId(PageId page) const {
    return static_cast<int32_t>(static_cast<int64_t>(Data(page) - base_) / block_stride_);
  }
  // Bytes between consecutive block ids: 16, or the smallest larger power of two that keeps the
  // ids of an arena beyond 32 GiB below 2^31.
  int64_t block_stride() const { return block_stride_; }
  // The arena as a pool of blocks of `layout` addressed by block id.
  PagedKvView View(const BlockLayout& layout, ScaleDtype scale_dtype) const;

  // The page holding `data` (a pointer into a live page's bytes, as from Data()).
  PageId PageOf(const uint8_t* data) const {
    const size_t off = static_cast<size_t>(data - base_);
    const size_t slab = off / slab_bytes_;
    return static_cast<PageId>((slab << 16) | ((off % slab_bytes_) / slab_page_bytes_[slab]));
  }

  // The page whose bytes start at block id `block` (the inverse of BlockId).
  PageId PageOfBlock(int32_t block) const {
    return PageOf(base_ + static_cast<size_t>(block) * static_cast<size_t>(block_stride_));
  }

  // The page's checksum record (empty for a fresh page), and its replacement. Slot numbers fit
  // 16 bits (a page holds at most 1024 tokens).
  PageChecksum Checksum(PageId page) const {
    const uint64_t v = ChecksumWord(page).load(std::memory_order_acquire);
    return {static_cast<uint32_t>(v >> 48), static_cast<uint32_t>((v >> 32) & 0xffffu),
            static_cast<uint32_t>(v)};
  }
  void SetChecksum(PageId page, const PageChecksum& c) {
    ChecksumWord(page).store((static_cast<uint64_t>(c.first & 0xffffu) << 48) |
                                 (static_cast<uint64_t>(c.end & 0xffffu) << 32) | c.sum,
                             std::memory_order_release);
  }

  BlockPoolStats Stats() const;
  size_t capacity_bytes() const { return num_slabs_ * slab_bytes_; }
  size_t slab_bytes() const { return slab_bytes_; }
  size_t used_bytes() const;
  const Arena& arena() const { return *arena_; }

 private:
  // `page_bytes` rounded up to a multiple of the block stride.
  size_t StridePageBytes(size_t page_bytes) const;

  struct Slab {
    PageClassId cls = -1;
    size_t page_bytes = 0;  // cached for Data()
    std::vector<uint16_t> free_slots;
    std::vector<uint32_t> refcounts;  // per slot; 0 = free
    std::vector<AccountId> owners;    // per slot: who pays for it
    std::vector<PageTier> tiers;      // per slot: in which tier
    size_t in_use = 0;
  };
  struct AccountState {
    TenantId name;
    AccountLimits limits;
    size_t tier_bytes[kPageTiers] = {0, 0};
    size_t bytes() const { return tier_bytes[0] + tier_bytes[1]; }
  };
  struct PageClass {
    size_t page_bytes = 0;
    size_t pages_per_slab = 0;
    size_t pages_in_use = 0;
    size_t slabs = 0;
    std::set<int> slabs_with_free;  // lowest index first: keeps usage compact
  };

  BlockPool(std::unique_ptr<Arena> arena, size_t slab_bytes, size_t num_slabs,
            int64_t block_stride);
  size_t slot_offsets_(PageId page) const {
    return static_cast<size_t>(page & 0xffffu) * slab_page_bytes_[page >> 16];
  }
  Slab& SlabOf(PageId page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::atomic<uint64_t>& ChecksumWord(PageId page) const {
    return checksums_[page >> 16][page & 0xffffu];
  }
  // Allocate's work once capacity is known to suffice.
  void AllocateLocked(PageClassId cls, size_t count, AccountId account, PageTier tier,
                      std::vector<PageId>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Bytes of the guarantees of accounts other than `account` that they do not use yet.
  size_t UnusedGuaranteesLocked(AccountId account) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t UnrefLocked(PageId page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::unique_ptr<Arena> arena_;
  uint8_t* base_;
  const size_t slab_bytes_;
  const size_t num_slabs_;
  const int64_t block_stride_;
  // Page size of each slab, read without the lock by Data(): an entry is written only while its
  // slab is assigned, before any page of it is handed out (under mu_, which the caller that got
  // the page id also went through).
  std::vector<size_t> slab_page_bytes_;
  // Checksum records per slab and slot, replaced (under mu_) only when a free slab is assigned to
  // a class with more pages per slab than its array holds: the same reasoning as above.
  std::vector<std::unique_ptr<std::atomic<uint64_t>[]>> checksums_;
  std::vector<size_t> checksum_slots_ ABSL_GUARDED_BY(mu_);

  mutable absl::Mutex mu_;
  std::vector<Slab> slabs_ ABSL_GUARDED_BY(mu_);
  std::vector<PageClass> classes_ ABSL_GUARDED_BY(mu_);
  std::set<int> free_slabs_ ABSL_GUARDED_BY(mu_);
  size_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<AccountState> accounts_ ABSL_GUARDED_BY(mu_);
  std::map<TenantId, AccountId> account_ids_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::server
