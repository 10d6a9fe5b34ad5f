// AssignFetchSlots: which arena slot each new block and page of a FetchToDevice takes (free
// slots in the order given, the caller's partly held block and pages in place), and the
// requests it refuses (16 tokens per block, sink size 4, two layers). PlanDeviceCopies against
// a real store on the CPU backend, its copies carried out in host memory: after every fetch of a
// growing sequence the arena holds every block and row where the answers said.
#include "server/transport/device_fetch.h"

#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/read_snapshot.h"
#include "server/server_test_util.h"

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

// Carries out `copies` with the CPU (pool and arena are host memory here).
void RunOnHost(const std::vector<DeviceCopy>& copies) {
  for (const DeviceCopy& c : copies) {
    for (size_t r = 0; r < c.rows; ++r) {
      std::memcpy(c.dst + r * c.dst_pitch, c.src + r * c.src_pitch, c.bytes);
    }
  }
}

TEST(DeviceFetchTest, CopiesPutEveryBlockAndRowWhereTheAnswerSays) {
  using testing::AppendAll;
  testing::TestCore core;
  // Block 8, sink 8, recent 16, demotion batch 8: decode demotes every 8 steps.
  auto m = core.AddModel("m", RotationKind::kHadamard, testing::SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 37, AppendKind::kFinalPrefill, 1, 5).ok());
  const int bt = m->block_tokens();
  constexpr int kSlots = 64;
  const size_t history_bytes = kSlots * m->block_bytes;
  std::vector<uint8_t> arena(history_bytes + kSlots * m->bf16_page_bytes, 0xab);
  // What the caller holds, as the answers said: per layer, block index / chunk -> slot.
  struct Held {
    std::map<int64_t, int32_t> history, sink, recent;
  };
  std::vector<Held> held(m->num_layers);
  std::set<int32_t> used_history, used_bf16;
  v1::ReadBlocksCursor cursor;
  bool first = true;
  int at = 37;
  for (int steps : {0, 1, 5, 9, 16, 3}) {
    SCOPED_TRACE(::testing::Message() << steps << " decode steps at " << at);
    for (int t = 0; t < steps; ++t, ++at) {
      ASSERT_TRUE(AppendAll(*core.store, *m, "s", at, 1, AppendKind::kDecode, 100 + at).ok());
    }
    auto snap = core.store->Snapshot(kDefaultTenant, "s", {});
    ASSERT_TRUE(snap.ok()) << snap.status();
    const SequenceSnapshot& s = **snap;
    v1::FetchToDeviceRequest request;
    request.set_history_slots(kSlots);
    request.set_bf16_slots(kSlots);
    for (int32_t i = 0; i < kSlots; ++i) {
      if (!used_history.count(i)) request.add_free_history_slots(i);
      if (!used_bf16.count(i)) request.add_free_bf16_slots(i);
    }
    if (!first) {
      *request.mutable_read()->mutable_since() = cursor;
      const int64_t end =
          int64_t{cursor.sink_tokens()} + cursor.history_tokens() + cursor.recent_tokens();
      for (const Held& h : held) {
        v1::DeviceLayerSlots* tail = request.add_held();
        tail->set_sink_tail_slot(
            cursor.sink_tokens() % bt ? h.sink.at((cursor.sink_tokens() - 1) / bt) : -1);
        tail->set_history_tail_slot(
            cursor.history_tokens() % bt ? h.history.at(cursor.history_tokens() / bt) : -1);
        tail->set_recent_tail_slot(
            cursor.recent_tokens() > 0 && end % bt ? h.recent.at((end - 1) / bt) : -1);
      }
    }
    const SequenceTiers now = TiersOf(s);
    const auto starts = PlanRead(first ? nullptr : &cursor, now, m->codec.quant.sink_tokens, bt);
    ASSERT_TRUE(starts.ok()) << starts.status();
    const auto slots = AssignFetchSlots(request, now, *starts, bt, m->num_layers);
    ASSERT_TRUE(slots.ok()) << slots.status();
    const auto copies = PlanDeviceCopies(core.backend.get(), s, *starts, *slots, arena.data(),
                                         arena.data() + history_bytes);
    ASSERT_TRUE(copies.ok()) << copies.status();
    RunOnHost(*copies);
    for (int i = 0; i < m->num_layers; ++i) {
      const LayerFetchSlots& w = (*slots)[i];
      for (size_t j = 0; j < w.history.size(); ++j) {
        held[i].history[starts->history_block + j] = w.history[j];
        used_history.insert(w.history[j]);
      }
      for (size_t j = 0; j < w.sink.size(); ++j) {
        held[i].sink[starts->sink_token / bt + j] = w.sink[j];
        used_bf16.insert(w.sink[j]);
      }
      for (size_t j = 0; j < w.recent.size(); ++j) {
        held[i].recent[starts->recent_token / bt + j] = w.recent[j];
        used_bf16.insert(w.recent[j]);
      }
    }
    // Every block and row of the sequence now lies in the arena.
    const BlockLayout& l = m->bf16_layout;
    const size_t head_row = l.code_bytes_per_row();
    const size_t row = m->row_values();
    for (int i = 0; i < m->num_layers; ++i) {
      for (int b = 0; b < (s.history() + bt - 1) / bt; ++b) {
        EXPECT_EQ(std::memcmp(arena.data() + held[i].history.at(b) * m->block_bytes,
                              s.HistoryBlock(i, b), m->block_bytes),
                  0)
            << "layer " << i << " block " << b;
      }
      for (bool recent : {false, true}) {
        const int count = recent ? s.recent() : s.sink();
        const int begin = recent ? s.sink() + s.history() : 0;
        std::vector<Bf16> k(count * row), v(count * row);
        ASSERT_TRUE(s.CopyBf16Rows(core.backend.get(), i, recent, 0, count, absl::MakeSpan(k),
                                   absl::MakeSpan(v))
                        .ok());
        const auto& pages = recent ? held[i].recent : held[i].sink;
        for (int t = 0; t < count; ++t) {
          const int p = begin + t;
          const uint8_t* page =
              arena.data() + history_bytes + pages.at(p / bt) * m->bf16_page_bytes;
          for (int h = 0; h < l.kv_heads; ++h) {
            const size_t at_slot = (p % bt) * head_row;
            EXPECT_EQ(std::memcmp(page + l.CodesOffset(KvTensor::kKey, h) + at_slot,
                                  k.data() + (t * l.kv_heads + h) * l.head_dim, head_row),
                      0)
                << "layer " << i << " position " << p << " head " << h << " K";
            EXPECT_EQ(std::memcmp(page + l.CodesOffset(KvTensor::kValue, h) + at_slot,
                                  v.data() + (t * l.kv_heads + h) * l.head_dim, head_row),
                      0)
                << "layer " << i << " position " << p << " head " << h << " V";
          }
        }
      }
    }
    cursor.set_sequence_incarnation(s.incarnation());
    cursor.set_sink_tokens(s.sink());
    cursor.set_history_tokens(s.history());
    cursor.set_recent_tokens(s.recent());
    first = false;
  }
}

}  // namespace
}  // namespace kvpool::server
