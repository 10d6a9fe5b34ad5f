#include "server/logging/log_format.h"

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/logging/request_context.h"
#include "spdlog/logger.h"
#include "spdlog/sinks/ostream_sink.h"

namespace kvpool::server {
namespace {

// The lines `messages` become in `format`, each logged at warn.
std::vector<std::string> LinesOf(LogFormat format, const std::vector<std::string>& messages) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_st>(out);
  spdlog::logger logger("test", sink);
  logger.set_formatter(NewLogFormatter(format, "kvpoold"));
  for (const std::string& m : messages) logger.warn("{}", m);
  logger.flush();
  std::vector<std::string> lines = absl::StrSplit(out.str(), '\n');
  EXPECT_EQ(lines.back(), "");  // every line ends with a newline
  lines.pop_back();
  return lines;
}

// Messages that would break a naive line or JSON writer.
const std::vector<std::string>& HostileMessages() {
  static const std::vector<std::string> kMessages = {
      "plain",
      "quote \" backslash \\ slash /",
      "two\nlines\r\nand a\ttab",
      std::string("nul \0 bell \x07 del \x7f", 18),
      "utf-8 caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80",
      "bad utf-8 \xc3 \xff \xed\xa0\x80 \xf0\x9f",
      "{\"msg\":\"injected\"}",
  };
  return kMessages;
}

TEST(LogFormatTest, ParsesTheFlagValue) {
  EXPECT_EQ(*ParseLogFormat("text"), LogFormat::kText);
  EXPECT_EQ(*ParseLogFormat("json"), LogFormat::kJson);
  EXPECT_FALSE(ParseLogFormat("JSON").ok());
  EXPECT_FALSE(ParseLogFormat("").ok());
}

TEST(LogFormatTest, JsonIsOneValidObjectPerEventWithTheMessageIntact) {
  const std::vector<std::string>& messages = HostileMessages();
  const std::vector<std::string> lines = LinesOf(LogFormat::kJson, messages);
  ASSERT_EQ(lines.size(), messages.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    SCOPED_TRACE(lines[i]);
    const nlohmann::json j = nlohmann::json::parse(lines[i]);  // throws (fails) when invalid
    ASSERT_TRUE(j.is_object());
    EXPECT_EQ(j.at("level"), "warning");
    EXPECT_EQ(j.at("program"), "kvpoold");
    EXPECT_TRUE(j.at("thread").is_number_integer());
    const std::string time = j.at("time");
    EXPECT_EQ(time.size(), std::string("2026-12-02T03:42:23.123456Z").size());
    EXPECT_EQ(time.back(), 'Z');
    EXPECT_FALSE(j.contains("request_id"));
  }
  // Valid text comes back exactly; invalid UTF-8 becomes U+FFFD, one per bad byte.
  for (size_t i : {0, 1, 2, 3, 4, 6}) {
    EXPECT_EQ(nlohmann::json::parse(lines[i]).at("msg"), messages[i]);
  }
  EXPECT_EQ(nlohmann::json::parse(lines[5]).at("msg"),
            "bad utf-8 \xef\xbf\xbd \xef\xbf\xbd \xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd "
            "\xef\xbf\xbd\xef\xbf\xbd");
}

TEST(LogFormatTest, JsonCarriesTheRequestIdInsideACall) {
  std::vector<std::string> lines;
  {
    ScopedRequestId scope("req-\"7\"");
    lines = LinesOf(LogFormat::kJson, {"in a call"});
  }
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json j = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(j.at("request_id"), "req-\"7\"");
  EXPECT_EQ(j.at("msg"), "in a call");
}

TEST(LogFormatTest, TextKeepsOneLinePerEvent) {
  const std::vector<std::string>& messages = HostileMessages();
  const std::vector<std::string> lines = LinesOf(LogFormat::kText, messages);
  ASSERT_EQ(lines.size(), messages.size());
  for (const std::string& line : lines) {
    EXPECT_NE(line.find(" warning kvpoold: "), std::string::npos) << line;
    for (const char c : line) EXPECT_FALSE(static_cast<unsigned char>(c) < 0x20) << line;
  }
  EXPECT_TRUE(absl::EndsWith(lines[2], "kvpoold: two\\nlines\\r\\nand a\\ttab")) << lines[2];
  EXPECT_TRUE(absl::EndsWith(lines[3], "nul \\x00 bell \\x07 del \\x7f")) << lines[3];
}

TEST(LogFormatTest, TextCarriesTheRequestIdInsideACall) {
  std::vector<std::string> lines;
  {
    ScopedRequestId scope("req-7");
    lines = LinesOf(LogFormat::kText, {"in a call"});
  }
  lines.push_back(LinesOf(LogFormat::kText, {"outside"})[0]);
  EXPECT_TRUE(absl::EndsWith(lines[0], "kvpoold: [request_id=req-7] in a call")) << lines[0];
  EXPECT_TRUE(absl::EndsWith(lines[1], "kvpoold: outside")) << lines[1];
}

}  // namespace
}  // namespace kvpool::server
