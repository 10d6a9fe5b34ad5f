// ModelRegistry: the models kvpoold serves, each with its rotation set, quant config, codec
// version and pool page classes. Models are immutable once registered and shared by pointer, so
// a sequence keeps using its model even while a forced delete runs.
//
//   ModelRegistry registry(&pool);
//   KVPOOL_ASSIGN_OR_RETURN(ModelCodec codec,
//                           DataFreeCodec(RotationKind::kHadamard, 0, 80, 128, QuantConfig{}));
//   ModelRegistration req(std::move(codec));
//   req.model_id = "llama-70b"; req.q_heads = 64; req.kv_heads = 8;
//   KVPOOL_ASSIGN_OR_RETURN(RegisterResult r, registry.Register(kDefaultTenant, std::move(req)));
//   std::shared_ptr<const Model> m = *registry.Get(kDefaultTenant, "llama-70b");
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/block_layout.h"
#include "kernels/codec_version.h"
#include "kernels/rotation_file.h"
#include "kernels/row_codec.h"
#include "server/block_pool.h"
#include "server/tenant.h"
#include "server/tenant_quotas.h"

namespace kvpool::server {

// A registered model. Immutable.
struct Model {
  Model(RowCodec row_codec_in, RowCodec bf16_codec_in, ModelCodec codec_in)
      : codec(std::move(codec_in)),
        row_codec(std::move(row_codec_in)),
        bf16_codec(std::move(bf16_codec_in)) {}

  TenantId tenant;
  std::string id;
  int num_layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  ModelCodec codec;          // rotations, quant config, v_prerotated, objective
  CodecVersion version{};    // SHA-256 over the canonical codec content
  std::string version_hex;   // 64 hex digits
  RowCodec row_codec;        // rows of head_dim
  RowCodec bf16_codec;       // the BF16 bypass codec (sink and recent pages)
  BlockLayout block_layout;  // INT2 history block of all kv_heads
  BlockLayout bf16_layout;   // BF16 page: the same block format with 16-bit bypass rows
  size_t block_bytes = 0;
  size_t bf16_page_bytes = 0;  // bf16_layout.block_bytes()
  PageClassId block_class = -1;
  PageClassId bf16_class = -1;
  int64_t registered_unix_micros = 0;

  int block_tokens() const { return codec.quant.block_tokens; }
  // Values of one token's row of one tensor: kv_heads x head_dim.
  size_t row_values() const { return static_cast<size_t>(kv_heads) * head_dim; }
  // BF16 bytes of one token, K and V, one layer.
  size_t bf16_token_bytes() const { return row_values() * 2 * 2; }
};

// What to register.
struct ModelRegistration {
  explicit ModelRegistration(ModelCodec codec_in) : codec(std::move(codec_in)) {}

  std::string model_id;
  int num_layers = 0;  // 0: take the codec's
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;  // 0: take the codec's
  ModelCodec codec;
  std::string expected_codec_version;  // "" or 64 hex digits to check against
};

struct RegisterResult {
  std::shared_ptr<const Model> model;
  bool already_registered = false;
};

class ModelRegistry {
 public:
  // `pool` outlives the registry; page classes of every model are registered with it. `quotas`
  // (may be null: no quotas) holds each tenant's models quota and counts its refusals.
  explicit ModelRegistry(BlockPool* pool, TenantQuotaTable* quotas = nullptr)
      : pool_(pool), quotas_(quotas) {}

  // Validates and registers. InvalidArgument (id, shape vs rotation, quant config, page size
  // vs slab, codec version mismatch), AlreadyExists (same id, different codec version),
  // RESOURCE_EXHAUSTED with reason QUOTA when the tenant holds its models quota already. An
  // identical re-registration returns the existing model with already_registered set (and
  // counts nothing). A model holds no pool pages: its rotations live in host memory.
  [[nodiscard]] absl::StatusOr<RegisterResult> Register(const TenantId& tenant,
                                                        ModelRegistration request);
  // NotFound when absent.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<const Model>> Get(const TenantId& tenant,
                                                                 absl::string_view id) const;
  // The tenant's models sorted by id.
  std::vector<std::shared_ptr<const Model>> List(const TenantId& tenant) const;
  // Every tenant with a registered model, sorted.
  std::vector<TenantId> Tenants() const;
  // Removes and returns the model; NotFound when absent.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<const Model>> Remove(const TenantId& tenant,
                                                                    absl::string_view id);
  size_t size() const;
  // Models `tenant` holds.
  size_t CountOf(const TenantId& tenant) const;

 private:
  size_t CountOfLocked(const TenantId& tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  BlockPool* const pool_;
  TenantQuotaTable* const quotas_;
  mutable absl::Mutex mu_;
  std::map<std::pair<TenantId, std::string>, std::shared_ptr<const Model>> models_
      ABSL_GUARDED_BY(mu_);
};

// Identifiers of models and sequences: 1-128 characters of [A-Za-z0-9._:/-].
// InvalidArgument naming `what` otherwise.
[[nodiscard]] absl::Status ValidateId(absl::string_view what, absl::string_view id);

// A ModelCodec for a data-free rotation (identity, Hadamard, randomized Hadamard).
// InvalidArgument for a dense kind or bad sizes.
[[nodiscard]] absl::StatusOr<ModelCodec> DataFreeCodec(RotationKind kind, uint64_t seed,
                                                       int num_layers, int head_dim,
                                                       const QuantConfig& quant,
                                                       bool v_prerotated = false);

// The bytes of the file `path` inside `model_dir` (relative to it, or absolute under it), read
// without following any step out of the directory (common/file_read.h). At most
// `max_bytes`. FailedPrecondition when no model directory is configured; PermissionDenied for
// any path that leads outside it, whether or not its target exists; NotFound for a missing
// file inside it; InvalidArgument for what is not a regular file or is too large.
[[nodiscard]] absl::StatusOr<std::string> ReadModelFile(const std::string& model_dir,
                                                        const std::string& path,
                                                        uint64_t max_bytes);

}  // namespace kvpool::server
