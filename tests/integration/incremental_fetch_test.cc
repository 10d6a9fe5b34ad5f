// Incremental fetch of attention-ready blocks (ReadBlocks with a cursor) into a client mirror
// (client/kv_mirror.h), through a real kvpoold: after every fetch the mirror equals a fresh full
// ReadBlocks byte for byte, also read through its PagedKvBatch; a fetch moves exactly the
// blocks and rows the mirror lacked; demoted rows free their pages for reuse; hostile cursors
// are refused with precise codes and change nothing; a released sequence answers NOT_FOUND and
// one created anew under the same id is read in full.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kv_mirror.h"
#include "common/status_macros.h"
#include "proto/status.h"
#include "tests/integration/integration_util.h"
#include "tests/integration/mirror_check.h"

namespace kvpool::integration {
namespace {

using client::FetchStats;
using client::KvMirror;
using client::KvMirrorOptions;
using client::LayerBlocks;

class IncrementalFetchTest : public DaemonTest {};

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr int kBlockTokens = 16;
constexpr int kSink = 8;
constexpr int kRecent = 24;               // W
constexpr int kDemotion = 8;              // B: recent stays in [W, W + B - 1] while decoding
constexpr size_t kRowBytes = 2 * 64 * 2;  // one token of K (or V): kv_heads x head_dim BF16

v1::QuantConfig SmallTiers() {
  v1::QuantConfig q;
  q.set_block_tokens(kBlockTokens);
  q.set_sink_tokens(kSink);
  q.set_recent_tokens(kRecent);
  q.set_demotion_batch(kDemotion);
  return q;
}

size_t RowValues() { return static_cast<size_t>(kShape.kv_heads) * kShape.head_dim; }

std::string Tokens(const std::vector<Bf16>& rows, int start, int n) {
  return std::string(reinterpret_cast<const char*>(rows.data() + start * RowValues()),
                     n * RowValues() * sizeof(Bf16));
}

absl::Status Append(const KvpoolClient& c, const std::string& id, const SequenceKv& kv, int start,
                    int n, bool end_of_prefill) {
  v1::AppendKvHeader header;
  header.set_sequence_id(id);
  header.set_token_start(start);
  header.set_num_tokens(n);
  header.set_dtype(v1::DTYPE_BF16);
  header.set_end_of_prefill(end_of_prefill);
  std::vector<std::string> ks, vs;
  std::vector<client::LayerKv> layers;
  for (int l = 0; l < kShape.num_layers; ++l) {
    ks.push_back(Tokens(kv.k[l], start, n));
    vs.push_back(Tokens(kv.v[l], start, n));
  }
  for (int l = 0; l < kShape.num_layers; ++l) layers.push_back({l, ks[l], vs[l]});
  return c.AppendKv(header, layers).status();
}

absl::Status Decode(const KvpoolClient& c, const std::string& id, const SequenceKv& kv, int start,
                    int steps) {
  for (int t = start; t < start + steps; ++t) {
    v1::AppendDecodeRequest request;
    request.set_sequence_id(id);
    request.set_token_start(t);
    request.set_num_tokens(1);
    request.set_dtype(v1::DTYPE_BF16);
    std::string k, v;
    for (int l = 0; l < kShape.num_layers; ++l) {
      k += Tokens(kv.k[l], t, 1);
      v += Tokens(kv.v[l], t, 1);
    }
    request.set_k(k);
    request.set_v(v);
    KVPOOL_RETURN_IF_ERROR(c.AppendDecode(request).status());
  }
  return absl::OkStatus();
}

// Tier sizes now (DescribeSequence).
v1::SequenceInfo Info(const KvpoolClient& c, const std::string& id) {
  absl::StatusOr<v1::SequenceInfo> info = c.DescribeSequence(id);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? *info : v1::SequenceInfo{};
}

// Payload bytes a fetch must move from `held` (the cursor before) to `now`: the history blocks
// from the one holding history token held.history (if history grew), sink rows after the held
// ones, recent rows after the held ones or from the window's start; K and V, every layer.
uint64_t ExpectedBytes(const v1::ReadBlocksCursor& held, const v1::SequenceInfo& now,
                       size_t block_bytes) {
  const uint64_t history = now.history_tokens();
  const uint64_t blocks = (history + kBlockTokens - 1) / kBlockTokens;
  const uint64_t first_block =
      held.history_tokens() < history ? held.history_tokens() / kBlockTokens : blocks;
  const uint64_t window = now.sink_tokens() + history;
  const uint64_t held_end = held.sink_tokens() + held.history_tokens() + held.recent_tokens();
  const uint64_t rows = (now.sink_tokens() - held.sink_tokens()) +
                        (window + now.recent_tokens() - std::max(held_end, window));
  return kShape.num_layers * ((blocks - first_block) * block_bytes + rows * 2 * kRowBytes);
}

// Fetches `id`, checks the bytes moved against the cursor before and the tiers now, and the
// mirror against a full read.
void FetchAndCheck(const KvpoolClient& c, KvMirror* mirror, const std::string& id,
                   size_t block_bytes) {
  const v1::ReadBlocksCursor before =
      mirror->Held(id) != nullptr ? *mirror->Held(id) : v1::ReadBlocksCursor{};
  absl::StatusOr<FetchStats> moved = mirror->Fetch(id);
  ASSERT_TRUE(moved.ok()) << moved.status();
  const v1::SequenceInfo now = Info(c, id);
  EXPECT_EQ(moved->bytes, ExpectedBytes(before, now, block_bytes))
      << "held " << before.ShortDebugString() << ", now " << now.ShortDebugString();
  ExpectMirrorIsFullRead(c, *mirror, id, kShape.num_layers);
}

TEST_F(IncrementalFetchTest, MirrorFollowsPrefillDecodeAndDemotionMovingOnlyNewData) {
  absl::StatusOr<v1::ModelInfo> model =
      RegisterDataFree(client(), "mirror", kShape, v1::ROTATION_KIND_HADAMARD, 3, SmallTiers());
  ASSERT_TRUE(model.ok()) << model.status();
  const size_t block_bytes = model->block_layout().block_bytes();
  constexpr KvMirrorOptions kSlots{/*history_slots=*/64, /*bf16_slots=*/64};
  absl::StatusOr<std::unique_ptr<KvMirror>> mirror = KvMirror::Create(&client(), "mirror", kSlots);
  ASSERT_TRUE(mirror.ok()) << mirror.status();

  const SequenceKv kv = MakeSequenceKv(kShape, 200, 7);
  ASSERT_TRUE(client().CreateSequence("mirror", "s").ok());
  // A non-final prefill chunk: a partial sink page and a partial history block.
  KV_ASSERT_OK(Append(client(), "s", kv, 0, 2, false));
  FetchAndCheck(client(), mirror->get(), "s", block_bytes);
  KV_ASSERT_OK(Append(client(), "s", kv, 2, 21, false));
  FetchAndCheck(client(), mirror->get(), "s", block_bytes);
  // The final prefill: more history, the last W tokens recent.
  KV_ASSERT_OK(Append(client(), "s", kv, 23, 77, true));
  FetchAndCheck(client(), mirror->get(), "s", block_bytes);
  EXPECT_EQ(Info(client(), "s").recent_tokens(), static_cast<uint32_t>(kRecent));

  // Nothing new: nothing moves.
  absl::StatusOr<FetchStats> idle = (*mirror)->Fetch("s");
  ASSERT_TRUE(idle.ok()) << idle.status();
  EXPECT_EQ(idle->bytes, 0u);
  EXPECT_EQ(idle->history_blocks, 0u);
  EXPECT_FALSE(idle->full);

  // Decode steps, fetched at different strides: each crossing of W + B demotes B rows.
  int at = 100;
  for (int steps : {1, 5, 8, 13, 3, 40}) {
    const uint32_t history_before = Info(client(), "s").history_tokens();
    KV_ASSERT_OK(Decode(client(), "s", kv, at, steps));
    at += steps;
    SCOPED_TRACE(absl::StrCat("after ", steps, " decode steps, at ", at));
    FetchAndCheck(client(), mirror->get(), "s", block_bytes);
    if (steps >= kDemotion) {
      EXPECT_GT(Info(client(), "s").history_tokens(), history_before);
    }
  }
  // The slots in use are exactly the pages and blocks of the tiers now: demoted rows' pages
  // went back to the allocator.
  const v1::SequenceInfo now = Info(client(), "s");
  const int window = now.sink_tokens() + now.history_tokens();
  const int recent_pages =
      (window + now.recent_tokens() + kBlockTokens - 1) / kBlockTokens - window / kBlockTokens;
  const int sink_pages = (now.sink_tokens() + kBlockTokens - 1) / kBlockTokens;
  const int blocks = (now.history_tokens() + kBlockTokens - 1) / kBlockTokens;
  EXPECT_EQ(
      (*mirror)->free_bf16_slots(),
      static_cast<size_t>(kSlots.bf16_slots - kShape.num_layers * (sink_pages + recent_pages)));
  EXPECT_EQ((*mirror)->free_history_slots(),
            static_cast<size_t>(kSlots.history_slots - kShape.num_layers * blocks));
  KV_ASSERT_OK((*mirror)->Drop("s"));
  EXPECT_EQ((*mirror)->free_bf16_slots(), static_cast<size_t>(kSlots.bf16_slots));
  EXPECT_EQ((*mirror)->free_history_slots(), static_cast<size_t>(kSlots.history_slots));
}

TEST_F(IncrementalFetchTest, HostileCursorsAreRefusedAndChangeNothing) {
  KV_ASSERT_OK(
      RegisterDataFree(client(), "cursor", kShape, v1::ROTATION_KIND_HADAMARD, 4, SmallTiers())
          .status());
  KV_ASSERT_OK(
      CreateAndAppend(client(), "cursor", "h", MakeSequenceKv(kShape, 60, 8), true).status());
  absl::StatusOr<std::unique_ptr<KvMirror>> mirror =
      KvMirror::Create(&client(), "cursor", {32, 32});
  ASSERT_TRUE(mirror.ok()) << mirror.status();
  ASSERT_TRUE((*mirror)->Fetch("h").ok());
  const v1::ReadBlocksCursor good = *(*mirror)->Held("h");
  EXPECT_EQ(good.sink_tokens(), static_cast<uint32_t>(kSink));
  EXPECT_EQ(good.history_tokens(), 60u - kSink - kRecent);

  auto read = [&](const v1::ReadBlocksCursor& since) {
    return [&, since]() -> absl::Status {
      v1::ReadBlocksRequest request;
      request.set_sequence_id("h");
      *request.mutable_since() = since;
      return client().ReadBlocks(request).status();
    };
  };
  v1::ReadBlocksCursor c = good;
  c.set_history_tokens(good.history_tokens() + 1);
  ExpectRejectedAndPoolUnchanged(client(), absl::StatusCode::kOutOfRange, "history beyond",
                                 read(c));
  c = good;
  c.set_recent_tokens(good.recent_tokens() + 1);
  ExpectRejectedAndPoolUnchanged(client(), absl::StatusCode::kOutOfRange, "total beyond", read(c));
  c = good;
  c.set_history_tokens(0xffffffffu);
  c.set_recent_tokens(0xffffffffu);
  ExpectRejectedAndPoolUnchanged(client(), absl::StatusCode::kOutOfRange, "huge", read(c));
  c = good;
  c.set_sink_tokens(kSink + 1);
  ExpectRejectedAndPoolUnchanged(client(), absl::StatusCode::kInvalidArgument, "sink above size",
                                 read(c));
  c = good;
  c.set_sink_tokens(kSink - 1);
  ExpectRejectedAndPoolUnchanged(client(), absl::StatusCode::kInvalidArgument,
                                 "history before the sink is full", read(c));
  c = good;
  c.set_sequence_incarnation(good.sequence_incarnation() ^ 1);
  absl::Status stale = read(c)();
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
  EXPECT_EQ(ReasonOf(stale), ErrorReason::kStaleCursor) << stale;

  // The sequence and the mirror are as they were: the next fetch moves nothing.
  absl::StatusOr<FetchStats> again = (*mirror)->Fetch("h");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->bytes, 0u);
  ExpectMirrorIsFullRead(client(), **mirror, "h", kShape.num_layers);
}

TEST_F(IncrementalFetchTest, ReleasedIsNotFoundAndANewSequenceUnderTheIdIsReadInFull) {
  KV_ASSERT_OK(
      RegisterDataFree(client(), "life", kShape, v1::ROTATION_KIND_HADAMARD, 5, SmallTiers())
          .status());
  KV_ASSERT_OK(
      CreateAndAppend(client(), "life", "r", MakeSequenceKv(kShape, 70, 9), true).status());
  absl::StatusOr<std::unique_ptr<KvMirror>> mirror = KvMirror::Create(&client(), "life", {32, 32});
  ASSERT_TRUE(mirror.ok()) << mirror.status();
  ASSERT_TRUE((*mirror)->Fetch("r").ok());
  const v1::ReadBlocksCursor first = *(*mirror)->Held("r");
  const size_t free_bf16 = (*mirror)->free_bf16_slots();

  ASSERT_TRUE(client().ReleaseSequence("r").ok());
  EXPECT_EQ((*mirror)->Fetch("r").status().code(), absl::StatusCode::kNotFound);
  ASSERT_NE((*mirror)->Held("r"), nullptr);  // unchanged: the caller decides
  EXPECT_EQ((*mirror)->Held("r")->ShortDebugString(), first.ShortDebugString());
  EXPECT_EQ((*mirror)->free_bf16_slots(), free_bf16);

  // Same id, other data and length: the old cursor is stale, the mirror reads it in full.
  KV_ASSERT_OK(
      CreateAndAppend(client(), "life", "r", MakeSequenceKv(kShape, 90, 10), true).status());
  absl::StatusOr<FetchStats> fresh = (*mirror)->Fetch("r");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_TRUE(fresh->full);
  EXPECT_NE((*mirror)->Held("r")->sequence_incarnation(), first.sequence_incarnation());
  ExpectMirrorIsFullRead(client(), **mirror, "r", kShape.num_layers);
}

TEST_F(IncrementalFetchTest, AFetchThatDoesNotFitChangesNothing) {
  KV_ASSERT_OK(
      RegisterDataFree(client(), "tight", kShape, v1::ROTATION_KIND_HADAMARD, 6, SmallTiers())
          .status());
  KV_ASSERT_OK(
      CreateAndAppend(client(), "tight", "a", MakeSequenceKv(kShape, 40, 11), true).status());
  KV_ASSERT_OK(
      CreateAndAppend(client(), "tight", "b", MakeSequenceKv(kShape, 200, 12), true).status());
  // "a": 1 sink page, 1 block, 2 recent pages per layer; "b" needs 11 blocks per layer.
  absl::StatusOr<std::unique_ptr<KvMirror>> mirror = KvMirror::Create(&client(), "tight", {8, 8});
  ASSERT_TRUE(mirror.ok()) << mirror.status();
  ASSERT_TRUE((*mirror)->Fetch("a").ok());
  const size_t free_history = (*mirror)->free_history_slots();
  const size_t free_bf16 = (*mirror)->free_bf16_slots();
  EXPECT_EQ((*mirror)->Fetch("b").status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*mirror)->Held("b"), nullptr);
  EXPECT_EQ((*mirror)->free_history_slots(), free_history);
  EXPECT_EQ((*mirror)->free_bf16_slots(), free_bf16);
  ExpectMirrorIsFullRead(client(), **mirror, "a", kShape.num_layers);
}

TEST_F(IncrementalFetchTest, AHostPoolAnswersUnavailableForADeviceFetch) {
  if (TestingOnGpu()) GTEST_SKIP() << "a GPU daemon serves device fetches (device_fetch_test)";
  KV_ASSERT_OK(
      RegisterDataFree(client(), "dev", kShape, v1::ROTATION_KIND_HADAMARD, 7, SmallTiers())
          .status());
  KV_ASSERT_OK(
      CreateAndAppend(client(), "dev", "d", MakeSequenceKv(kShape, 30, 13), true).status());
  absl::StatusOr<std::unique_ptr<KvMirror>> mirror = KvMirror::Create(&client(), "dev", {8, 8});
  ASSERT_TRUE(mirror.ok()) << mirror.status();
  const absl::StatusOr<FetchStats> fetched =
      (*mirror)->FetchToDevice("d", {/*session_id=*/1, std::string(64, '\0'), 0});
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kUnavailable) << fetched.status();
  EXPECT_EQ((*mirror)->Held("d"), nullptr);
  EXPECT_EQ((*mirror)->free_bf16_slots(), 8u);
}

}  // namespace
}  // namespace kvpool::integration
