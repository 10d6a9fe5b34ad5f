#include "common/grpc_status.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvpool {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const absl::string_view message = status.message();
  std::string text(message.substr(0, kMaxStatusMessageBytes));
  if (message.size() > kMaxStatusMessageBytes) text += "...";
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::move(text));
}

absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view what) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message()));
}

}  // namespace kvpool
