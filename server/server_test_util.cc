#include "server/server_test_util.h"

#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "server/cpu_backend.h"
#include "tests/support/test_data.h"

namespace kvpool::server::testing {

QuantConfig SmallQuant(QuantMethod method) {
  QuantConfig q;
  q.method = method;
  q.block_tokens = 8;
  q.sink_tokens = 8;
  q.recent_tokens = 16;
  q.demotion_batch = 8;
  return q;
}

TestCore::TestCore(size_t pool_bytes, size_t slab_bytes) {
  backend = NewCpuBackend();
  auto arena = backend->AllocateArena(pool_bytes);
  EXPECT_TRUE(arena.ok()) << arena.status();
  auto p = BlockPool::Create(*std::move(arena), slab_bytes);
  EXPECT_TRUE(p.ok()) << p.status();
  pool = *std::move(p);
  index = std::make_unique<PrefixIndex>(pool.get());
  registry = std::make_unique<ModelRegistry>(pool.get(), &quotas);
  store = std::make_unique<SequenceStore>(pool.get(), index.get(), backend.get(),
                                          absl::ZeroDuration(), &quotas);
}

TestCore::~TestCore() {
  store.reset();
  index.reset();
}

std::shared_ptr<const Model> TestCore::AddModel(const std::string& id, RotationKind kind,
                                                const QuantConfig& quant, int num_layers,
                                                int q_heads, int kv_heads, int head_dim,
                                                const TenantId& tenant) {
  auto codec = DataFreeCodec(kind, /*seed=*/7, num_layers, head_dim, quant);
  EXPECT_TRUE(codec.ok()) << codec.status();
  ModelRegistration req(*std::move(codec));
  req.model_id = id;
  req.q_heads = q_heads;
  req.kv_heads = kv_heads;
  auto r = registry->Register(tenant, std::move(req));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->model : nullptr;
}

std::vector<Bf16> TestRows(int tokens, size_t row_values, uint64_t seed) {
  // Real-like rows of head_dim 32 stacked to fill kv_heads x head_dim.
  const std::vector<float> v =
      kvpool::testing::RealLikeRows(static_cast<int>(tokens * row_values / 32), 32, seed);
  return kvpool::testing::ToBf16(v);
}

absl::Status AppendAll(SequenceStore& store, const Model& model, const std::string& id,
                       int token_start, int tokens, AppendKind kind, uint64_t seed, int chunk,
                       std::vector<uint32_t> token_ids, const TenantId& tenant) {
  AppendSpec spec;
  spec.token_start = token_start;
  spec.num_tokens = tokens;
  spec.kind = kind;
  spec.token_ids = std::move(token_ids);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AppendTxn> txn,
                          store.BeginAppend(tenant, id, std::move(spec)));
  const size_t row = model.row_values();
  for (int layer = 0; layer < model.num_layers; ++layer) {
    const std::vector<Bf16> k = TestRows(tokens, row, seed + 2 * layer);
    const std::vector<Bf16> v = TestRows(tokens, row, seed + 2 * layer + 1);
    for (int off = 0; off < tokens; off += chunk) {
      const int n = std::min(chunk, tokens - off);
      KVPOOL_RETURN_IF_ERROR(txn->StageLayer(layer, off,
                                             absl::MakeConstSpan(k).subspan(off * row, n * row),
                                             absl::MakeConstSpan(v).subspan(off * row, n * row)));
    }
  }
  return store.Commit(std::move(txn)).status();
}

}  // namespace kvpool::server::testing
