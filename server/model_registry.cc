#include "server/model_registry.h"

#include <limits.h>
#include <stdlib.h>

#include <chrono>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/file_read.h"
#include "common/quote.h"
#include "common/status_macros.h"

namespace kvpool::server {
namespace {

constexpr int kMaxLayers = 4096;
constexpr int kMaxHeads = 4096;

bool IsHex64(absl::string_view s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

absl::Status ValidateId(absl::string_view what, absl::string_view id) {
  if (id.empty() || id.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must have 1 to 128 characters, got ", id.size()));
  }
  for (char c : id) {
    const bool ok = absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' ||
                    c == ':' || c == '/' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(what, " '", absl::CHexEscape(id),
                                                     "' has a character outside [A-Za-z0-9._:/-]"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelCodec> DataFreeCodec(RotationKind kind, uint64_t seed, int num_layers,
                                         int head_dim, const QuantConfig& quant,
                                         bool v_prerotated) {
  if (num_layers < 1 || num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers must be in [1, ", kMaxLayers, "], got ", num_layers));
  }
  if (!IsSupportedHeadDim(head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim must be a power of two in [32, 256], got ", head_dim));
  }
  absl::StatusOr<RotationSet> rotations =
      absl::InvalidArgumentError("a dense rotation needs a rotation file (upload or server path)");
  switch (kind) {
    case RotationKind::kIdentity:
      rotations = RotationSet::Identity(num_layers, head_dim);
      break;
    case RotationKind::kHadamard:
      rotations = RotationSet::Hadamard(num_layers, head_dim);
      break;
    case RotationKind::kRandomizedHadamard:
      rotations = RotationSet::RandomizedHadamard(num_layers, head_dim, seed);
      break;
    default:
      break;
  }
  if (!rotations.ok()) return rotations.status();
  ModelCodec codec{"", *std::move(rotations), quant, v_prerotated, "", {}, {}};
  codec.quant = quant;
  codec.v_prerotated = v_prerotated;
  codec.objective = std::string(RotationKindName(kind));
  return codec;
}

absl::StatusOr<std::string> ReadModelFile(const std::string& model_dir, const std::string& path,
                                          uint64_t max_bytes) {
  if (model_dir.empty()) {
    return absl::FailedPreconditionError(
        "server paths are disabled: start kvpoold with --model_dir to allow them");
  }
  if (path.empty()) return absl::InvalidArgumentError("server_path is empty");
  absl::string_view relative = path;
  // An absolute path names a file inside the directory by the directory's own spelling or its
  // resolved one; anything else absolute is outside (ReadRegularFileBeneath refuses it).
  char dir_buf[PATH_MAX];
  const std::string resolved_dir = realpath(model_dir.c_str(), dir_buf) ? dir_buf : model_dir;
  for (const std::string& prefix : {model_dir, resolved_dir}) {
    const std::string with_slash = absl::StrCat(absl::StripSuffix(prefix, "/"), "/");
    if (absl::ConsumePrefix(&relative, with_slash)) break;
  }
  absl::StatusOr<std::string> bytes = ReadRegularFileBeneath(model_dir, relative, max_bytes);
  if (!bytes.ok()) {
    return absl::Status(bytes.status().code(),
                        absl::StrCat("server_path: ", bytes.status().message()));
  }
  return bytes;
}

absl::StatusOr<RegisterResult> ModelRegistry::Register(const TenantId& tenant,
                                                       ModelRegistration req) {
  KVPOOL_RETURN_IF_ERROR(ValidateId("model_id", req.model_id));
  const RotationSet& rot = req.codec.rotations;
  if (req.num_layers == 0) req.num_layers = rot.num_layers();
  if (req.head_dim == 0) req.head_dim = rot.head_dim();
  if (req.num_layers != rot.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_layers ", req.num_layers, " does not match the rotation's ", rot.num_layers()));
  }
  if (req.head_dim != rot.head_dim()) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim ", req.head_dim, " does not match the rotation's ", rot.head_dim()));
  }
  if (req.num_layers < 1 || req.num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers must be in [1, ", kMaxLayers, "], got ", req.num_layers));
  }
  if (!IsSupportedHeadDim(req.head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim must be a power of two in [32, 256], got ", req.head_dim));
  }
  if (req.kv_heads < 1 || req.kv_heads > kMaxHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_heads must be in [1, ", kMaxHeads, "], got ", req.kv_heads));
  }
  if (req.q_heads < 1 || req.q_heads > kMaxHeads || req.q_heads % req.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("q_heads must be a positive multiple of kv_heads (", req.kv_heads, ") up to ",
                     kMaxHeads, ", got ", req.q_heads));
  }
  KVPOOL_RETURN_IF_ERROR(req.codec.quant.Validate(req.head_dim));
  KVPOOL_ASSIGN_OR_RETURN(RowCodec row_codec, RowCodec::Create(req.codec.quant, req.head_dim));
  QuantConfig bypass = req.codec.quant;
  bypass.method = QuantMethod::kBypass;
  KVPOOL_ASSIGN_OR_RETURN(RowCodec bf16_codec, RowCodec::Create(bypass, req.head_dim));

  req.codec.model_id = req.model_id;
  auto model =
      std::make_shared<Model>(std::move(row_codec), std::move(bf16_codec), std::move(req.codec));
  model->tenant = tenant;
  model->id = req.model_id;
  model->num_layers = req.num_layers;
  model->q_heads = req.q_heads;
  model->kv_heads = req.kv_heads;
  model->head_dim = req.head_dim;
  model->version = ComputeCodecVersion(model->codec);
  model->version_hex = ToHex(model->version);
  if (!req.expected_codec_version.empty()) {
    if (!IsHex64(req.expected_codec_version)) {
      return absl::InvalidArgumentError("expected_codec_version must be 64 hex digits");
    }
    if (absl::AsciiStrToLower(req.expected_codec_version) != model->version_hex) {
      return absl::InvalidArgumentError(absl::StrCat("codec version is ", model->version_hex,
                                                     ", expected ", req.expected_codec_version));
    }
  }
  model->block_layout = BlockLayout::ForModel(model->codec.quant, model->kv_heads, model->head_dim);
  model->block_bytes = model->block_layout.block_bytes();
  model->bf16_layout =
      BlockLayout::ForModel(model->bf16_codec.config(), model->kv_heads, model->head_dim);
  model->bf16_page_bytes = model->bf16_layout.block_bytes();
  KVPOOL_RETURN_IF_ERROR(pool_->CheckPageBytes(model->block_bytes));
  KVPOOL_RETURN_IF_ERROR(pool_->CheckPageBytes(model->bf16_page_bytes));
  model->registered_unix_micros = std::chrono::duration_cast<std::chrono::microseconds>(
                                      std::chrono::system_clock::now().time_since_epoch())
                                      .count();

  absl::MutexLock lock(&mu_);
  auto key = std::make_pair(tenant, model->id);
  auto it = models_.find(key);
  if (it != models_.end()) {
    const Model& old = *it->second;
    if (old.version == model->version && old.q_heads == model->q_heads &&
        old.kv_heads == model->kv_heads &&
        old.codec.quant.sink_tokens == model->codec.quant.sink_tokens &&
        old.codec.quant.recent_tokens == model->codec.quant.recent_tokens &&
        old.codec.quant.demotion_batch == model->codec.quant.demotion_batch) {
      return RegisterResult{it->second, true};
    }
    return absl::AlreadyExistsError(
        absl::StrCat("model ", Quote(model->id), " is already registered with codec version ",
                     old.version_hex, " (or other head counts / tier sizes); delete it first"));
  }
  const uint64_t quota = quotas_ != nullptr ? quotas_->Get(tenant).models : 0;
  if (quota > 0) {
    const size_t held = CountOfLocked(tenant);
    if (held + 1 > quota) {
      quotas_->CountRejection(tenant, QuotaKind::kModels);
      return QuotaError(tenant, QuotaKind::kModels, quota, held, 1);
    }
  }
  // Page classes are added only for a model that is being registered (both sizes were checked
  // above, so neither fails): a refused registration leaves the pool as it was.
  KVPOOL_ASSIGN_OR_RETURN(model->block_class, pool_->RegisterClass(model->block_bytes));
  KVPOOL_ASSIGN_OR_RETURN(model->bf16_class, pool_->RegisterClass(model->bf16_page_bytes));
  std::shared_ptr<const Model> shared = std::move(model);
  models_.emplace(std::move(key), shared);
  return RegisterResult{std::move(shared), false};
}

absl::StatusOr<std::shared_ptr<const Model>> ModelRegistry::Get(const TenantId& tenant,
                                                                absl::string_view id) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(std::make_pair(tenant, std::string(id)));
  if (it == models_.end()) {
    return absl::NotFoundError(absl::StrCat("no model ", Quote(id)));
  }
  return it->second;
}

std::vector<std::shared_ptr<const Model>> ModelRegistry::List(const TenantId& tenant) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const Model>> out;
  for (const auto& [key, model] : models_) {
    if (key.first == tenant) out.push_back(model);
  }
  return out;
}

std::vector<TenantId> ModelRegistry::Tenants() const {
  absl::MutexLock lock(&mu_);
  std::vector<TenantId> out;
  for (const auto& [key, model] : models_) {
    if (out.empty() || out.back() != key.first) out.push_back(key.first);
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const Model>> ModelRegistry::Remove(const TenantId& tenant,
                                                                   absl::string_view id) {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(std::make_pair(tenant, std::string(id)));
  if (it == models_.end()) return absl::NotFoundError(absl::StrCat("no model ", Quote(id)));
  std::shared_ptr<const Model> m = std::move(it->second);
  models_.erase(it);
  return m;
}

size_t ModelRegistry::CountOfLocked(const TenantId& tenant) const {
  size_t n = 0;
  for (auto it = models_.lower_bound(std::make_pair(tenant, std::string()));
       it != models_.end() && it->first.first == tenant; ++it) {
    ++n;
  }
  return n;
}

size_t ModelRegistry::CountOf(const TenantId& tenant) const {
  absl::MutexLock lock(&mu_);
  return CountOfLocked(tenant);
}

size_t ModelRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return models_.size();
}

}  // namespace kvpool::server
