#include "proto/status.h"

#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace kvpool {
namespace {

constexpr absl::string_view kErrorInfoUrl = "type.googleapis.com/google.rpc.ErrorInfo";
constexpr absl::string_view kDomain = "kvpool";

constexpr std::pair<ErrorReason, absl::string_view> kNames[] = {
    {ErrorReason::kEvicted, "EVICTED"},   {ErrorReason::kExpired, "EXPIRED"},
    {ErrorReason::kQuota, "QUOTA"},       {ErrorReason::kLimit, "LIMIT"},
    {ErrorReason::kCorrupt, "CORRUPT"},   {ErrorReason::kWrongOwner, "WRONG_OWNER"},
    {ErrorReason::kDraining, "DRAINING"}, {ErrorReason::kStaleCursor, "STALE_CURSOR"},
};

std::optional<google::rpc::ErrorInfo> InfoOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kErrorInfoUrl);
  if (!payload) return std::nullopt;
  google::rpc::ErrorInfo info;
  if (!info.ParseFromString(std::string(*payload)) || info.domain() != kDomain) {
    return std::nullopt;
  }
  return info;
}

}  // namespace

absl::string_view ErrorReasonName(ErrorReason reason) {
  for (const auto& [r, name] : kNames) {
    if (r == reason) return name;
  }
  return "UNKNOWN";
}

std::optional<ErrorReason> ParseErrorReason(absl::string_view name) {
  for (const auto& [r, n] : kNames) {
    if (n == name) return r;
  }
  return std::nullopt;
}

absl::Status WithReason(absl::Status status, ErrorReason reason,
                        const std::map<std::string, std::string>& metadata) {
  if (status.ok()) return status;
  google::rpc::ErrorInfo info;
  info.set_reason(std::string(ErrorReasonName(reason)));
  info.set_domain(std::string(kDomain));
  for (const auto& [k, v] : metadata) (*info.mutable_metadata())[k] = v;
  status.SetPayload(kErrorInfoUrl, absl::Cord(info.SerializeAsString()));
  return status;
}

std::optional<ErrorReason> ReasonOf(const absl::Status& status) {
  std::optional<google::rpc::ErrorInfo> info = InfoOf(status);
  if (!info) return std::nullopt;
  return ParseErrorReason(info->reason());
}

std::map<std::string, std::string> ReasonMetadata(const absl::Status& status) {
  std::map<std::string, std::string> out;
  if (std::optional<google::rpc::ErrorInfo> info = InfoOf(status)) {
    for (const auto& [k, v] : info->metadata()) out[k] = v;
  }
  return out;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const absl::string_view message = status.message();
  std::string text(message.substr(0, kMaxStatusMessageBytes));
  if (message.size() > kMaxStatusMessageBytes) text += "...";
  const auto code = static_cast<grpc::StatusCode>(status.code());
  std::optional<google::rpc::ErrorInfo> info = InfoOf(status);
  if (!info) return grpc::Status(code, std::move(text));
  google::rpc::Status details;
  details.set_code(static_cast<int>(status.code()));
  details.set_message(text);
  details.add_details()->PackFrom(*info);
  return grpc::Status(code, std::move(text), details.SerializeAsString());
}

absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view what) {
  if (status.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(status.error_code()),
                   absl::StrCat(what, ": ", status.error_message()));
  google::rpc::Status details;
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) {
    return out;
  }
  for (const google::protobuf::Any& any : details.details()) {
    google::rpc::ErrorInfo info;
    if (any.Is<google::rpc::ErrorInfo>() && any.UnpackTo(&info) && info.domain() == kDomain) {
      out.SetPayload(kErrorInfoUrl, absl::Cord(info.SerializeAsString()));
      break;
    }
  }
  return out;
}

}  // namespace kvpool
