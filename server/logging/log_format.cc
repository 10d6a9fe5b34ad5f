#include "server/logging/log_format.h"

#include <cstdint>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpc/support/log.h"
#include "server/logging/request_context.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

void Append(absl::string_view s, spdlog::memory_buf_t& dest) {
  dest.append(s.data(), s.data() + s.size());
}

absl::string_view PayloadOf(const spdlog::details::log_msg& msg) {
  return absl::string_view(msg.payload.data(), msg.payload.size());
}

// Length of the valid UTF-8 sequence starting at s[i] (1..4), or 0 when it is not one.
size_t Utf8SequenceLength(absl::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = byte(i);
  size_t n = 0;
  uint32_t min = 0;
  uint32_t code = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2, min = 0x80, code = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3, min = 0x800, code = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, min = 0x10000, code = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    code = (code << 6) | (byte(i + k) & 0x3F);
  }
  if (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return 0;
  return n;
}

// Text lines: the message with control characters escaped, so one event stays one line.
void AppendTextEscaped(absl::string_view text, spdlog::memory_buf_t& dest) {
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\n') {
      Append("\\n", dest);
    } else if (c == '\r') {
      Append("\\r", dest);
    } else if (c == '\t') {
      Append("\\t", dest);
    } else if (u < 0x20 || u == 0x7F) {
      Append(absl::StrFormat("\\x%02x", u), dest);
    } else {
      dest.push_back(c);
    }
  }
}

// %V: the message, escaped for a text line (like %v).
class TextMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    AppendTextEscaped(PayloadOf(msg), dest);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<TextMessageFlag>();
  }
};

// %Q: "[request_id=ID] " inside a call, nothing outside.
class TextRequestIdFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const absl::string_view id = CurrentRequestId();
    if (id.empty()) return;
    Append("[request_id=", dest);
    AppendTextEscaped(id, dest);
    Append("] ", dest);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<TextRequestIdFlag>();
  }
};

// %J: the message as a JSON string's body.
class JsonMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    std::string escaped;
    AppendJsonEscaped(PayloadOf(msg), &escaped);
    Append(escaped, dest);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

// %q: ,"request_id":"ID" inside a call, nothing outside.
class JsonRequestIdFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const absl::string_view id = CurrentRequestId();
    if (id.empty()) return;
    std::string field = ",\"request_id\":\"";
    AppendJsonEscaped(id, &field);
    field += '"';
    Append(field, dest);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonRequestIdFlag>();
  }
};

// gRPC's own log lines, through spdlog (gpr_set_log_function).
void LogGrpcLine(gpr_log_func_args* args) {
  spdlog::level::level_enum level = spdlog::level::info;
  if (args->severity == GPR_LOG_SEVERITY_DEBUG) level = spdlog::level::debug;
  if (args->severity == GPR_LOG_SEVERITY_ERROR) level = spdlog::level::err;
  spdlog::log(level, "grpc: {} ({}:{})", args->message == nullptr ? "" : args->message,
              args->file == nullptr ? "" : args->file, args->line);
}

}  // namespace

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("--log_format must be text or json, got '", name, "'"));
}

std::unique_ptr<spdlog::formatter> NewLogFormatter(LogFormat format, absl::string_view program) {
  std::unique_ptr<spdlog::pattern_formatter> f;
  if (format == LogFormat::kJson) {
    // UTC with microseconds: shippers merge lines from many hosts.
    f = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
    f->add_flag<JsonMessageFlag>('J').add_flag<JsonRequestIdFlag>('q');
    f->set_pattern(absl::StrCat(R"({"time":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","program":")",
                                program, R"(","thread":%t%q,"msg":"%J"})"));
  } else {
    f = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::local);
    f->add_flag<TextMessageFlag>('V').add_flag<TextRequestIdFlag>('Q');
    f->set_pattern(absl::StrCat("%Y-%m-%dT%H:%M:%S.%e %^%l%$ ", program, ": %Q%V"));
  }
  return f;
}

void InstallLogFormat(LogFormat format, absl::string_view program) {
  spdlog::set_formatter(NewLogFormatter(format, program));
  gpr_set_log_function(LogGrpcLine);
}

void AppendJsonEscaped(absl::string_view text, std::string* out) {
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x80) {
      const size_t n = Utf8SequenceLength(text, i);
      if (n == 0) {
        *out += "\\ufffd";
        ++i;
      } else {
        out->append(text.data() + i, n);
        i += n;
      }
      continue;
    }
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      default:
        if (u < 0x20 || u == 0x7F) {
          absl::StrAppendFormat(out, "\\u%04x", u);
        } else {
          out->push_back(c);
        }
    }
    ++i;
  }
}

}  // namespace kvpool::server
