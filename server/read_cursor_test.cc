// PlanRead: where an incremental ReadBlocks begins per tier, and which cursors it refuses with
// which code (sink size 4, 8 tokens per block in every case).
#include "server/read_cursor.h"

#include "gtest/gtest.h"
#include "proto/status.h"

namespace kvpool::server {
namespace {

constexpr int kSink = 4;
constexpr int kBlockTokens = 8;

v1::ReadBlocksCursor Cursor(uint64_t incarnation, uint32_t sink, uint32_t history,
                            uint32_t recent) {
  v1::ReadBlocksCursor c;
  c.set_sequence_incarnation(incarnation);
  c.set_sink_tokens(sink);
  c.set_history_tokens(history);
  c.set_recent_tokens(recent);
  return c;
}

TEST(ReadCursorTest, WithoutCursorEverythingIsSent) {
  const auto s = PlanRead(nullptr, {7, 4, 20, 6}, kSink, kBlockTokens);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->sink_token, 0);
  EXPECT_EQ(s->history_block, 0);
  EXPECT_EQ(s->recent_token, 24);
}

TEST(ReadCursorTest, AnUnchangedSequenceSendsNothing) {
  const v1::ReadBlocksCursor c = Cursor(7, 4, 20, 6);
  const auto s = PlanRead(&c, {7, 4, 20, 6}, kSink, kBlockTokens);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->sink_token, 4);
  EXPECT_EQ(s->history_block, 3);  // 20 history tokens: 3 blocks, none sent
  EXPECT_EQ(s->recent_token, 30);
  EXPECT_TRUE(SendsNothing(*s, {7, 4, 20, 6}, kBlockTokens));
}

TEST(ReadCursorTest, AnyNewRowOrBlockIsSomethingToSend) {
  const v1::ReadBlocksCursor c = Cursor(7, 4, 20, 6);
  for (const SequenceTiers now :
       {SequenceTiers{7, 4, 20, 7}, SequenceTiers{7, 4, 21, 5}, SequenceTiers{7, 4, 28, 0}}) {
    const auto s = PlanRead(&c, now, kSink, kBlockTokens);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_FALSE(SendsNothing(*s, now, kBlockTokens)) << now.history << " " << now.recent;
  }
  const auto full = PlanRead(nullptr, {7, 4, 20, 6}, kSink, kBlockTokens);
  EXPECT_FALSE(SendsNothing(*full, {7, 4, 20, 6}, kBlockTokens));
  const auto empty = PlanRead(nullptr, {7, 0, 0, 0}, kSink, kBlockTokens);
  EXPECT_TRUE(SendsNothing(*empty, {7, 0, 0, 0}, kBlockTokens));
}

TEST(ReadCursorTest, APartlyHeldBlockIsSentAgainAndNewRecentRowsFollowTheHeldOnes) {
  // Held: history 20 (block 2 holds 4 of 8), recent [24, 30). Now history 28, recent [32, 36):
  // block 2 grew and block 3 is new; rows 30..31 were demoted before the reader saw them.
  const v1::ReadBlocksCursor c = Cursor(7, 4, 20, 6);
  const auto s = PlanRead(&c, {7, 4, 28, 4}, kSink, kBlockTokens);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->history_block, 2);
  EXPECT_EQ(s->recent_token, 32);
  // Held recent rows reaching past the window's start: only the rows after them.
  const v1::ReadBlocksCursor d = Cursor(7, 4, 16, 14);
  const auto t = PlanRead(&d, {7, 4, 24, 10}, kSink, kBlockTokens);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->history_block, 2);
  EXPECT_EQ(t->recent_token, 34);
}

TEST(ReadCursorTest, AFillingSinkSendsItsNewRows) {
  const v1::ReadBlocksCursor c = Cursor(7, 2, 0, 0);
  const auto s = PlanRead(&c, {7, 4, 3, 0}, kSink, kBlockTokens);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->sink_token, 2);
  EXPECT_EQ(s->history_block, 0);
  EXPECT_EQ(s->recent_token, 7);
}

TEST(ReadCursorTest, InconsistentCursorsAreInvalid) {
  for (const v1::ReadBlocksCursor& c :
       {Cursor(7, 5, 0, 0), Cursor(7, 3, 1, 0), Cursor(7, 3, 0, 1), Cursor(7, 0xffffffffu, 0, 0)}) {
    EXPECT_EQ(PlanRead(&c, {7, 4, 20, 6}, kSink, kBlockTokens).status().code(),
              absl::StatusCode::kInvalidArgument)
        << c.ShortDebugString();
  }
}

TEST(ReadCursorTest, CursorsBeyondTheSequenceAreOutOfRange) {
  for (const v1::ReadBlocksCursor& c :
       {Cursor(7, 4, 21, 0), Cursor(7, 4, 20, 7), Cursor(7, 4, 0, 27),
        Cursor(7, 4, 0xffffffffu, 0xffffffffu), Cursor(7, 4, 0, 0xffffffffu)}) {
    EXPECT_EQ(PlanRead(&c, {7, 4, 20, 6}, kSink, kBlockTokens).status().code(),
              absl::StatusCode::kOutOfRange)
        << c.ShortDebugString();
  }
  const v1::ReadBlocksCursor sink = Cursor(7, 4, 0, 0);
  EXPECT_EQ(PlanRead(&sink, {7, 3, 0, 0}, kSink, kBlockTokens).status().code(),
            absl::StatusCode::kOutOfRange);
}

TEST(ReadCursorTest, AnotherIncarnationIsAStaleCursor) {
  const v1::ReadBlocksCursor c = Cursor(8, 4, 20, 6);
  const absl::Status s = PlanRead(&c, {7, 4, 20, 6}, kSink, kBlockTokens).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReasonOf(s), ErrorReason::kStaleCursor);
}

}  // namespace
}  // namespace kvpool::server
