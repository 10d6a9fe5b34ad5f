// PrefixIndex: the daemon's cache of shareable prefix units, found through a hash chain over
// token ids, so a new sequence can start from KV another sequence already stored.
//
// A unit is the BF16 sink (tokens [0, S0)) or one whole INT2 history block (block_tokens tokens
// starting at S0 + i * block_tokens), covering every layer. Its hash is
//   SHA-256("kvpool-prefix\0" || tenant || model id || codec version || parent hash || kind ||
//           token ids)
// (strings length-prefixed, integers little-endian; the first unit's parent is all zeros), so a
// unit never matches another tenant's, model's or codec version's. The index holds one
// reference on each page of a unit: units stay cached after their sequences are released, until
// evicted (least recently used leaf first, and only when nothing else references its pages).
//
//   std::vector<PrefixUnitKey> chain = ComputePrefixChain(ctx, token_ids);
//   std::vector<PrefixMatch> hit = index.Match(ctx, chain, /*take_refs=*/true);
//   ...attach hit[i].pages to a new sequence (the refs are now the sequence's)...
//
// Thread-safe. Lock order: a caller may hold a sequence lock; the index calls the pool under its
// own lock and never calls back.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/codec_version.h"
#include "server/block_pool.h"
#include "server/tenant.h"

namespace kvpool::server {

using PrefixHash = std::array<uint8_t, 32>;

enum class PrefixUnitKind : uint8_t { kSink = 1, kBlock = 2 };

// Everything a unit hash is scoped by.
struct PrefixContext {
  TenantId tenant;
  std::string model_id;
  CodecVersion codec_version{};
  int sink_tokens = 0;
  int block_tokens = 16;
};

// The position of unit `index` of a chain: unit 0 is the sink when sink_tokens > 0, then whole
// blocks.
struct PrefixUnitKey {
  PrefixHash hash{};
  PrefixUnitKind kind = PrefixUnitKind::kBlock;
  int token_start = 0;
  int token_count = 0;
};

// Token range of unit `index` under `ctx`.
PrefixUnitKey PrefixUnitRange(const PrefixContext& ctx, int index);
// Hash of one unit given its parent's hash and its token ids.
PrefixHash HashPrefixUnit(const PrefixContext& ctx, const PrefixHash& parent, PrefixUnitKind kind,
                          absl::Span<const uint32_t> tokens);
// The chain of every complete unit covered by `token_ids` (from position 0).
std::vector<PrefixUnitKey> ComputePrefixChain(const PrefixContext& ctx,
                                              absl::Span<const uint32_t> token_ids);
std::string PrefixHashHex(const PrefixHash& h);

// A unit found by Match: its key and pages (per layer: the sink's pages, layer-major, or one
// block).
struct PrefixMatch {
  PrefixUnitKey key;
  std::vector<PageId> pages;
};

struct PrefixIndexStats {
  size_t units = 0;
  size_t bytes = 0;         // pages referenced by units
  size_t cached_bytes = 0;  // of those, pages only the index references
  uint64_t evicted_units = 0;
  // Since start, over every Match (LookupPrefix and sequences created from token ids): the
  // lookups, the tokens their chains covered and the tokens found.
  uint64_t lookups = 0;
  uint64_t lookup_tokens = 0;
  uint64_t hit_tokens = 0;
};

// A unit as the index's observer sees it.
struct PrefixUnitView {
  const TenantId* tenant = nullptr;
  const std::string* model_id = nullptr;
  const PrefixUnitKey* key = nullptr;
  const PrefixHash* parent = nullptr;  // null for a chain's first unit
};

// kCorrupt: its pages failed their checksum (the scrubber), or its parent's did.
enum class PrefixRemoval : uint8_t { kEvicted, kModelDropped, kCorrupt };

// A unit's pages as the scrubber verifies them, with one reference taken on each for the caller.
struct PrefixUnitPages {
  PrefixHash hash{};
  TenantId tenant;
  std::string model_id;
  CodecVersion codec_version{};
  PrefixUnitKind kind = PrefixUnitKind::kBlock;  // sink: BF16 pages; block: INT2 blocks
  std::vector<PageId> pages;
};

// Told of every unit added to or removed from the index (server/events/ feeds routers from
// it). Called under the index's lock: it must neither block nor call into the index.
class PrefixIndexObserver {
 public:
  virtual ~PrefixIndexObserver() = default;
  virtual void OnStored(const PrefixUnitView& unit) = 0;
  virtual void OnRemoved(const PrefixUnitView& unit, PrefixRemoval why) = 0;
};

class PrefixIndex {
 public:
  explicit PrefixIndex(BlockPool* pool) : pool_(pool) {}
  ~PrefixIndex();  // drops every reference

  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  // Adds a unit (taking one reference on each of `pages`). Returns false and changes nothing
  // when the hash is present already or its parent (for a non-first unit) is not.
  bool Publish(const PrefixContext& ctx, const PrefixUnitKey& key, const PrefixHash& parent,
               absl::Span<const PageId> pages);

  // The longest run of `chain` (from its start) present in the index. With `take_refs`, one
  // reference on every returned page is taken for the caller, atomically with the lookup.
  // Marks the matched units as recently used.
  std::vector<PrefixMatch> Match(const PrefixContext& ctx, absl::Span<const PrefixUnitKey> chain,
                                 bool take_refs);
  bool Contains(const PrefixHash& hash) const;

  // Evicts the least recently used leaf unit whose pages only the index references. Returns
  // the pool bytes freed (0 when nothing is evictable).
  size_t EvictOne();
  // Allocates `requests` from the pool for `tenant`'s account (BlockPool::AllocateReleasing),
  // evicting cached units only when that makes the whole allocation fit, taken in eviction
  // order (leaves whose pages only the index references; `tenant`'s least recently used first,
  // then other tenants' least recently used): its own units when the pool or its pool_bytes
  // quota is short, another tenant's only when the pool is short and never below that tenant's
  // guaranteed share. ResourceExhausted (reason QUOTA over the quota) when that cannot make
  // room: then nothing is evicted and nothing allocated.
  [[nodiscard]] absl::Status AllocateEvicting(const TenantId& tenant,
                                              absl::Span<const PageRequest> requests,
                                              std::vector<std::vector<PageId>>* out);
  // Drops every unit of (tenant, model_id); returns the pool bytes freed.
  size_t DropModel(const TenantId& tenant, const std::string& model_id);

  // The hash of every unit, for the scrubber to walk.
  std::vector<PrefixHash> UnitHashes() const;
  // Unit `hash` with a reference taken on each of its pages (the caller drops them: a page
  // cannot be freed and rewritten while it is verified); false when the unit is gone.
  bool RefUnit(const PrefixHash& hash, PrefixUnitPages* out) const;
  // Drops unit `hash`, whose pages failed their checksum, and every unit chained after it
  // (none could be matched without it), so that later lookups miss instead of serving it.
  // Sequences holding the pages keep them. Returns the units dropped (0 when already gone).
  size_t DropCorrupt(const PrefixHash& hash);

  PrefixIndexStats Stats() const;

  // Sets the observer (null: none); it must outlive the index or be unset first.
  void SetObserver(PrefixIndexObserver* observer);
  // Calls `visit` for every unit (parents before children), then `then`, all under the index's
  // lock: whatever `then` registers sees every later change and none twice.
  void VisitUnits(const std::function<void(const PrefixUnitView&)>& visit,
                  const std::function<void()>& then) const;

 private:
  struct Entry {
    PrefixUnitKey key;
    PrefixHash parent{};
    bool has_parent = false;
    TenantId tenant;
    std::string model_id;
    CodecVersion codec_version{};
    std::vector<PageId> pages;
    int children = 0;
    uint64_t last_use = 0;
  };
  struct HashHasher {
    size_t operator()(const PrefixHash& h) const {
      size_t v;
      static_assert(sizeof(v) <= sizeof(PrefixHash));
      std::memcpy(&v, h.data(), sizeof(v));
      return v;
    }
  };

  // Drops the unit (and, with `unref`, its page references) and tells the observer why.
  size_t RemoveLocked(const PrefixHash& hash, PrefixRemoval why, bool unref = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static PrefixUnitView ViewOf(const Entry& e);
  bool EvictableLocked(const Entry& e) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every unit that evictions could remove, in the order they would: a unit becomes a leaf
  // once its children are gone, so the order is worked out as if evicting one by one.
  std::vector<PrefixHash> EvictionOrderLocked(const TenantId& tenant) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  BlockPool* const pool_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<PrefixHash, Entry, HashHasher> entries_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<uint64_t, PrefixHash>> lru_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t evicted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t lookups_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t lookup_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t hit_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  PrefixIndexObserver* observer_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace kvpool::server
