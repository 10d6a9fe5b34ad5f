// A UCX PUSH_BEGIN becomes the one append header every ingest validates, with the same errors as
// AppendKv's header: the token range (a bad token_start named as such), the sequence id.
#include "server/transport/ucx/push_begin_header.h"

#include <climits>
#include <string>

#include "gtest/gtest.h"
#include "server/ingest/append_checks.h"

namespace kvpool::server {
namespace {

namespace wire = ::kvpool::ucx::wire;

wire::PushBeginHeader Header(uint32_t token_start, uint32_t num_tokens) {
  wire::PushBeginHeader h{};
  h.token_start = token_start;
  h.num_tokens = num_tokens;
  h.flags = wire::kEndOfPrefill;
  return h;
}

TEST(PushBeginHeaderTest, CarriesEveryFieldOfTheAppendHeader) {
  wire::PushBegin begin{"seq", {7, 9}};
  const v1::AppendKvHeader h = AppendHeaderOfPushBegin(Header(40, 2), begin);
  EXPECT_EQ(h.sequence_id(), "seq");
  EXPECT_EQ(h.token_start(), 40u);
  EXPECT_EQ(h.num_tokens(), 2u);
  EXPECT_EQ(h.dtype(), v1::DTYPE_BF16);
  EXPECT_TRUE(h.end_of_prefill());
  ASSERT_EQ(h.token_ids_size(), 2);
  EXPECT_EQ(h.token_ids(1), 9u);
  EXPECT_TRUE(ValidateAppendHeader(h, 1024).ok());
}

TEST(PushBeginHeaderTest, TokenRangeIsTheHeaderCheckOfEveryIngest) {
  const absl::Status too_many =
      ValidateAppendHeader(AppendHeaderOfPushBegin(Header(0, 2000), {"seq", {}}), 1024);
  EXPECT_TRUE(absl::IsInvalidArgument(too_many));
  EXPECT_NE(too_many.message().find("num_tokens"), absl::string_view::npos) << too_many;
  const absl::Status far_start = ValidateAppendHeader(
      AppendHeaderOfPushBegin(Header(INT32_MAX - 1000, 10), {"seq", {}}), 1024);
  EXPECT_TRUE(absl::IsInvalidArgument(far_start));
  EXPECT_NE(far_start.message().find("token_start"), absl::string_view::npos) << far_start;
  EXPECT_TRUE(absl::IsInvalidArgument(
      ValidateAppendHeader(AppendHeaderOfPushBegin(Header(0, 10), {"", {}}), 1024)));
}

}  // namespace
}  // namespace kvpool::server
