// How kvpoold writes its log: one line per event, as text (the default) or as JSON (one object
// per line, for log shippers), chosen with --log_format. Both come from spdlog's pattern
// formatter with kvpool's own flags:
//
//   text: 2026-12-02T03:42:23.123 info kvpoold: [request_id=4f1c...] deleted model 'm' ...
//   json: {"time":"2026-12-02T03:42:23.123456Z","level":"info","program":"kvpoold",
//          "thread":1234,"request_id":"4f1c...","msg":"deleted model 'm' ..."}
//
// A line written while a thread works for a call (server/logging/request_context.h) carries
// that call's request id; other lines have none. Messages quote client-sent text, so both
// formats escape it: control characters never break a line, and JSON strings stay valid
// (invalid UTF-8 becomes U+FFFD).
//
//   KVPOOL_ASSIGN_OR_RETURN(LogFormat format, ParseLogFormat(config.log_format));
//   InstallLogFormat(format, "kvpoold");
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "spdlog/formatter.h"

namespace kvpool::server {

enum class LogFormat { kText, kJson };

// "text" or "json".
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);

// The formatter of `format` for lines of `program` (letters, digits, '-', '_' only).
std::unique_ptr<spdlog::formatter> NewLogFormatter(LogFormat format, absl::string_view program);

// Installs NewLogFormatter on every spdlog logger and sends gRPC's own log lines through spdlog,
// so that they get the same format.
void InstallLogFormat(LogFormat format, absl::string_view program);

// `text` for a JSON string's body: quotes, backslashes and control characters escaped, invalid
// UTF-8 replaced by U+FFFD. Appends to `out`.
void AppendJsonEscaped(absl::string_view text, std::string* out);

}  // namespace kvpool::server
