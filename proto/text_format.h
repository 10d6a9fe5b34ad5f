// ParseTextFormat: a protobuf text-format file (the tenants file, the model config) into its
// message, with the first error's position in the status instead of protobuf's log line.
//
//   v1::ModelConfig config;
//   KVPOOL_RETURN_IF_ERROR(ParseTextFormat(text, &config));   // "line 3:7: ..."
//
// Thread-safe.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace kvpool {

// InvalidArgument "line L:C: what is wrong" (1-based) when `text` is not a `*out` in text
// format; `*out` is then unspecified.
[[nodiscard]] absl::Status ParseTextFormat(absl::string_view text, google::protobuf::Message* out);

}  // namespace kvpool
