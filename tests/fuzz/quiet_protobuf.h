// QuietProtobufLogs: silences protobuf's log lines (invalid UTF-8 in a string field, ...) in a
// fuzz target: malformed messages are what it feeds, and a failed parse is already the answer.
//
//   static const bool quiet = (QuietProtobufLogs(), true);
#pragma once

#include <string>

#include "google/protobuf/stubs/logging.h"

namespace kvpool::fuzz {

inline void QuietProtobufLogs() {
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
}

}  // namespace kvpool::fuzz
