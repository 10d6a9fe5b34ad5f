// Test helpers for server/ unit tests: an in-memory core (backend, pool, prefix index, registry,
// sequence store) and deterministic K/V rows.
//
//   TestCore core(/*pool_bytes=*/32 << 20);
//   std::shared_ptr<const Model> m = core.AddModel("m", RotationKind::kIdentity, BypassQuant());
//   std::vector<Bf16> k = TestRows(/*tokens=*/100, m->row_values(), /*seed=*/1);
//
// Not thread-safe to construct; the members are as thread-safe as their classes.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/codec_config.h"
#include "kernels/rotation.h"
#include "server/attention_engine.h"
#include "server/backend.h"
#include "server/block_pool.h"
#include "server/model_registry.h"
#include "server/prefix_index.h"
#include "server/sequence_store.h"
#include "server/tenant_quotas.h"

namespace kvpool::server::testing {

// Small tiers so tests exercise every path: block 8, sink 8, recent 16, demotion batch 8.
QuantConfig SmallQuant(QuantMethod method = QuantMethod::kUniform);
inline QuantConfig BypassQuant() { return SmallQuant(QuantMethod::kBypass); }

struct TestCore {
  explicit TestCore(size_t pool_bytes = 32 << 20, size_t slab_bytes = 256 << 10);
  ~TestCore();

  // Registers a model of `tenant` (2 layers, Hq 4, Hkv 2, D 32 unless given) or fails the
  // test.
  std::shared_ptr<const Model> AddModel(const std::string& id, RotationKind kind,
                                        const QuantConfig& quant, int num_layers = 2,
                                        int q_heads = 4, int kv_heads = 2, int head_dim = 32,
                                        const TenantId& tenant = kDefaultTenant);

  // Quotas the store and the registry read (empty: none).
  TenantQuotaTable quotas;
  std::unique_ptr<ComputeBackend> backend;
  std::unique_ptr<BlockPool> pool;
  std::unique_ptr<PrefixIndex> index;
  std::unique_ptr<ModelRegistry> registry;
  std::unique_ptr<SequenceStore> store;
};

// A backend that hands every call to `inner` (the CPU backend, say): tests derive from it and
// override only what they observe or fake.
class ForwardingBackend : public ComputeBackend {
 public:
  explicit ForwardingBackend(ComputeBackend* inner) : inner_(inner) {}
  absl::string_view name() const override { return inner_->name(); }
  absl::StatusOr<std::unique_ptr<Arena>> AllocateArena(size_t bytes) override {
    return inner_->AllocateArena(bytes);
  }
  absl::Status StageRows(const Model& m, int layer, absl::Span<const Bf16> k,
                         absl::Span<const Bf16> v, absl::Span<const RowWrite> writes) override {
    return inner_->StageRows(m, layer, k, v, writes);
  }
  absl::Status DemoteRows(const Model& m, absl::Span<const RowMove> moves) override {
    return inner_->DemoteRows(m, moves);
  }
  absl::Status ReadRows(const Model& m, const uint8_t* block, bool history, KvTensor t, int slot,
                        int count, absl::Span<float> out) override {
    return inner_->ReadRows(m, block, history, t, slot, count, out);
  }
  absl::Status ReadBf16Rows(const Model& m, const uint8_t* page, KvTensor t, int slot, int count,
                            absl::Span<Bf16> out) override {
    return inner_->ReadBf16Rows(m, page, t, slot, count, out);
  }
  absl::Status ChecksumSlots(const Model& m, absl::Span<const SlotRange> ranges,
                             absl::Span<uint32_t> out) override {
    return inner_->ChecksumSlots(m, ranges, out);
  }
  absl::Status CopyFromPool(void* dst, const uint8_t* src, size_t bytes) override {
    return inner_->CopyFromPool(dst, src, bytes);
  }
  absl::Status Attend(const Model& m, const AttentionCall& call) override {
    return inner_->Attend(m, call);
  }
  absl::StatusOr<std::unique_ptr<ResidentTables>> AllocateTables(size_t words) override {
    return inner_->AllocateTables(words);
  }
  absl::Status PatchTables(ResidentTables* tables, absl::Span<const TableWord> patch) override {
    return inner_->PatchTables(tables, patch);
  }
  absl::StatusOr<std::unique_ptr<HostRegistration>> RegisterHostMemory(void* p,
                                                                       size_t bytes) override {
    return inner_->RegisterHostMemory(p, bytes);
  }
  absl::StatusOr<std::unique_ptr<DeviceMailbox>> CreateDeviceMailbox(size_t bytes) override {
    return inner_->CreateDeviceMailbox(bytes);
  }

 protected:
  ComputeBackend* inner() const { return inner_; }

 private:
  ComputeBackend* const inner_;
};

// `tokens` rows of `row_values` BF16 values: real-like (outlier channels), deterministic.
std::vector<Bf16> TestRows(int tokens, size_t row_values, uint64_t seed);

// Appends `tokens` tokens to every layer of `id` (layer l uses rows seeded seed + l), in chunks
// of `chunk` tokens. Returns the commit status.
absl::Status AppendAll(SequenceStore& store, const Model& model, const std::string& id,
                       int token_start, int tokens, AppendKind kind, uint64_t seed,
                       int chunk = 1 << 30, std::vector<uint32_t> token_ids = {},
                       const TenantId& tenant = kDefaultTenant);

}  // namespace kvpool::server::testing
