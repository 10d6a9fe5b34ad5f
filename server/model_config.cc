#include "server/model_config.h"

#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "proto/text_format.h"
#include "server/model_registration.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

// A config file is a few KiB; anything far larger is not one.
constexpr size_t kMaxModelConfigBytes = size_t{16} << 20;

std::string EntryName(int index, const v1::ModelConfigEntry& e) {
  std::string name = absl::StrCat("model #", index + 1, " ", Quote(e.spec().model_id()));
  if (!e.tenant().empty()) absl::StrAppend(&name, " of tenant ", Quote(e.tenant()));
  return name;
}

}  // namespace

absl::StatusOr<v1::ModelConfig> ParseModelConfig(absl::string_view text, absl::string_view source,
                                                 const TenantsSource* tenants) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--model_config ", source, ": ", why));
  };
  v1::ModelConfig config;
  if (absl::Status parsed = ParseTextFormat(text, &config); !parsed.ok()) {
    return bad(parsed.message());
  }
  std::set<std::pair<std::string, std::string>> seen;  // (tenant, model id)
  for (int i = 0; i < config.model_size(); ++i) {
    const v1::ModelConfigEntry& e = config.model(i);
    const std::string where = EntryName(i, e);
    if (!e.has_spec()) return bad(absl::StrCat(where, ": no spec"));
    switch (e.spec().rotation_source_case()) {
      case v1::ModelSpec::kServerPath:
      case v1::ModelSpec::kDataFree:
        break;
      case v1::ModelSpec::kUploadSize:
        return bad(absl::StrCat(where,
                                ": upload_size has no meaning in a config file; name the rotation "
                                "file with server_path (inside --model_dir)"));
      default:
        return bad(absl::StrCat(where, ": spec needs a rotation source: server_path or data_free"));
    }
    if (tenants == nullptr && !e.tenant().empty()) {
      return bad(absl::StrCat(where,
                              ": tenant set but the daemon has no --tenants_file (leave it "
                              "empty for the default tenant)"));
    }
    if (tenants != nullptr) {
      if (e.tenant().empty()) {
        return bad(absl::StrCat(where,
                                ": no tenant; with --tenants_file the default tenant serves "
                                "nobody, so name a tenant of the tenants file"));
      }
      if (tenants->current()->Find(e.tenant()) == nullptr) {
        return bad(absl::StrCat(where, ": no such tenant in --tenants_file"));
      }
    }
    if (!seen.emplace(e.tenant(), e.spec().model_id()).second) {
      return bad(absl::StrCat(where, ": the same model id twice for one tenant"));
    }
  }
  return config;
}

absl::Status LoadModelConfig(const std::string& path, const ServiceContext& ctx) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--model_config ", path, ": cannot read"));
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().size() > kMaxModelConfigBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--model_config ", path, ": larger than ", kMaxModelConfigBytes, " bytes"));
  }
  absl::StatusOr<v1::ModelConfig> config = ParseModelConfig(text.str(), path, ctx.tenants);
  if (!config.ok()) return config.status();
  for (int i = 0; i < config->model_size(); ++i) {
    const v1::ModelConfigEntry& e = config->model(i);
    absl::StatusOr<RegisterResult> r = RegisterModelSpec(ctx, e.tenant(), e.spec(), "");
    if (!r.ok()) {
      return absl::Status(
          r.status().code(),
          absl::StrCat("--model_config ", path, ": ", EntryName(i, e), ": ", r.status().message()));
    }
  }
  spdlog::info("--model_config {}: {} models registered", path, config->model_size());
  return absl::OkStatus();
}

}  // namespace kvpool::server
