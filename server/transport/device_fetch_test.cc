// AssignFetchSlots: which arena slot each new block and page of a FetchToDevice takes (free
// slots in the order given, the caller's partly held block and pages in place), and the
// requests it refuses (16 tokens per block, sink size 4, two layers).
#include "server/transport/device_fetch.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

using ::testing::ElementsAre;

constexpr int kBlockTokens = 16;
constexpr int kSink = 4;

v1::FetchToDeviceRequest Request(int free_history, int free_bf16) {
  v1::FetchToDeviceRequest r;
  r.set_history_slots(64);
  r.set_bf16_slots(64);
  for (int i = 0; i < free_history; ++i) r.add_free_history_slots(10 + i);
  for (int i = 0; i < free_bf16; ++i) r.add_free_bf16_slots(30 + i);
  return r;
}

absl::StatusOr<std::vector<LayerFetchSlots>> Assign(const v1::FetchToDeviceRequest& r,
                                                    const SequenceTiers& now) {
  const v1::ReadBlocksCursor* since = r.read().has_since() ? &r.read().since() : nullptr;
  absl::StatusOr<ReadStarts> starts = PlanRead(since, now, kSink, kBlockTokens);
  if (!starts.ok()) return starts.status();
  return AssignFetchSlots(r, now, *starts, kBlockTokens, 2);
}

TEST(DeviceFetchTest, AFullFetchTakesFreeSlotsInOrder) {
  // Sink 4 (1 page), history 40 (3 blocks), recent [44, 68): chunks 2, 3, 4.
  const auto slots = Assign(Request(6, 8), {7, 4, 40, 24});
  ASSERT_TRUE(slots.ok()) << slots.status();
  EXPECT_THAT((*slots)[0].sink, ElementsAre(30));
  EXPECT_THAT((*slots)[0].history, ElementsAre(10, 11, 12));
  EXPECT_THAT((*slots)[0].recent, ElementsAre(31, 32, 33));
  EXPECT_THAT((*slots)[1].sink, ElementsAre(34));
  EXPECT_THAT((*slots)[1].history, ElementsAre(13, 14, 15));
  EXPECT_THAT((*slots)[1].recent, ElementsAre(35, 36, 37));
}

TEST(DeviceFetchTest, PartlyHeldBlockAndPageAreExtendedInPlace) {
  // Held: history 40 (block 2 half full), recent [44, 68) (chunk 4 holds 64..67). Now history
  // 48 and total 76: block 2 again, rows 68..75 into chunk 4: no free slot needed.
  v1::FetchToDeviceRequest r = Request(0, 0);
  v1::ReadBlocksCursor* c = r.mutable_read()->mutable_since();
  c->set_sequence_incarnation(7);
  c->set_sink_tokens(4);
  c->set_history_tokens(40);
  c->set_recent_tokens(24);
  for (int layer = 0; layer < 2; ++layer) {
    v1::DeviceLayerSlots* held = r.add_held();
    held->set_sink_tail_slot(-1);
    held->set_history_tail_slot(20 + layer);
    held->set_recent_tail_slot(40 + layer);
  }
  const auto slots = Assign(r, {7, 4, 48, 24});
  ASSERT_TRUE(slots.ok()) << slots.status();
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_TRUE((*slots)[layer].sink.empty());
    EXPECT_THAT((*slots)[layer].history, ElementsAre(20 + layer));
    EXPECT_THAT((*slots)[layer].recent, ElementsAre(40 + layer));
  }
  // Without the tails, the request cannot be served.
  r.mutable_held(1)->set_recent_tail_slot(-1);
  EXPECT_EQ(Assign(r, {7, 4, 48, 24}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DeviceFetchTest, RefusesBadSlotsAndTooFewFreeOnes) {
  v1::FetchToDeviceRequest r = Request(6, 8);
  r.set_free_bf16_slots(5, 64);  // outside [0, 64)
  EXPECT_EQ(Assign(r, {7, 4, 40, 24}).status().code(), absl::StatusCode::kInvalidArgument);
  r.set_free_bf16_slots(5, -1);
  EXPECT_EQ(Assign(r, {7, 4, 40, 24}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Assign(Request(5, 8), {7, 4, 40, 24}).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Assign(Request(6, 7), {7, 4, 40, 24}).status().code(),
            absl::StatusCode::kResourceExhausted);
  // A cursor needs one held entry per layer; no cursor, none.
  v1::FetchToDeviceRequest held = Request(6, 8);
  held.add_held();
  EXPECT_EQ(Assign(held, {7, 4, 40, 24}).status().code(), absl::StatusCode::kInvalidArgument);
  v1::ReadBlocksCursor* c = held.mutable_read()->mutable_since();
  c->set_sequence_incarnation(7);
  c->set_sink_tokens(4);
  EXPECT_EQ(Assign(held, {7, 4, 40, 24}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool::server
