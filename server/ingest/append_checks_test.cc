// The header and chunk checks every ingest shares.
#include "server/ingest/append_checks.h"

#include <climits>

#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

v1::AppendKvHeader Header(uint32_t token_start, uint32_t num_tokens) {
  v1::AppendKvHeader h;
  h.set_sequence_id("s");
  h.set_token_start(token_start);
  h.set_num_tokens(num_tokens);
  h.set_dtype(v1::DTYPE_BF16);
  return h;
}

TEST(AppendChecksTest, HeaderErrorsNameTheirField) {
  EXPECT_TRUE(ValidateAppendHeader(Header(0, 10), 1024).ok());
  EXPECT_TRUE(ValidateAppendHeader(Header(INT32_MAX - 1024, 1024), 1024).ok());
  struct Case {
    v1::AppendKvHeader header;
    const char* field;
  };
  v1::AppendKvHeader no_id = Header(0, 10);
  no_id.clear_sequence_id();
  v1::AppendKvHeader no_dtype = Header(0, 10);
  no_dtype.set_dtype(v1::DTYPE_UNSPECIFIED);
  v1::AppendKvHeader odd_dtype = Header(0, 10);
  odd_dtype.set_dtype(static_cast<v1::DType>(77));
  for (const Case& c : {Case{no_id, "sequence_id"}, Case{Header(0, 0), "num_tokens"},
                        Case{Header(0, 1025), "num_tokens"}, Case{no_dtype, "dtype"},
                        Case{odd_dtype, "dtype"}, Case{Header(INT32_MAX - 1023, 10), "token_start"},
                        Case{Header(UINT32_MAX, 10), "token_start"}}) {
    const absl::Status s = ValidateAppendHeader(c.header, 1024);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << c.field << ": " << s;
    EXPECT_NE(s.message().find(c.field), absl::string_view::npos) << s;
  }
}

TEST(AppendChecksTest, SpecFollowsTheHeader) {
  v1::AppendKvHeader h = Header(30, 3);
  h.set_end_of_prefill(true);
  h.add_token_ids(5);
  const AppendSpec spec = AppendSpecOf(h);
  EXPECT_EQ(spec.token_start, 30);
  EXPECT_EQ(spec.num_tokens, 3);
  EXPECT_EQ(spec.kind, AppendKind::kFinalPrefill);
  EXPECT_EQ(spec.token_ids, std::vector<uint32_t>{5});
  EXPECT_EQ(AppendSpecOf(Header(0, 1)).kind, AppendKind::kPrefill);
}

TEST(AppendChecksTest, ChunksMustLieInsideTheAppend) {
  EXPECT_TRUE(CheckChunkPlace(0, 0, 10, 2, 10).ok());
  EXPECT_TRUE(CheckChunkPlace(1, 9, 1, 2, 10).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(CheckChunkPlace(2, 0, 10, 2, 10)));
  EXPECT_TRUE(absl::IsInvalidArgument(CheckChunkPlace(-1, 0, 10, 2, 10)));
  EXPECT_TRUE(absl::IsInvalidArgument(CheckChunkPlace(0, 5, 10, 2, 10)));
  EXPECT_TRUE(absl::IsInvalidArgument(CheckChunkPlace(0, 0, 0, 2, 10)));
  EXPECT_TRUE(absl::IsInvalidArgument(CheckChunkPlace(0, UINT32_MAX, 2, 2, 10)));
  EXPECT_TRUE(absl::IsInvalidArgument(CheckChunkPlace(0, 1, UINT32_MAX, 2, 10)));
}

TEST(AppendChecksTest, ChunkBytesNeverWrap) {
  EXPECT_EQ(*ChunkBytes(4, 128), 512u);
  EXPECT_TRUE(absl::IsInvalidArgument(ChunkBytes(UINT32_MAX, SIZE_MAX / 2).status()));
}

}  // namespace
}  // namespace kvpool::server
