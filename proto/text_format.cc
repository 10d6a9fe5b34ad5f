#include "proto/text_format.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"

namespace kvpool {
namespace {

// Collects the parser's first error with its position.
class FirstError : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (error_.empty()) error_ = absl::StrCat("line ", line + 1, ":", column + 1, ": ", message);
  }
  const std::string& error() const { return error_; }

 private:
  std::string error_;
};

}  // namespace

absl::Status ParseTextFormat(absl::string_view text, google::protobuf::Message* out) {
  google::protobuf::TextFormat::Parser parser;
  FirstError errors;
  parser.RecordErrorsTo(&errors);
  if (parser.ParseFromString(std::string(text), out)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      errors.error().empty() ? absl::StrCat("not a ", out->GetTypeName(), " in text format")
                             : errors.error());
}

}  // namespace kvpool
