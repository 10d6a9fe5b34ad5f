// The checks of received UCX data messages on hand-built messages (tests/fuzz/ucx_wire_fuzz.cc
// runs them on arbitrary bytes).
#include "dataplane/ucx_wire_parse.h"

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::ucx::wire {
namespace {

template <typename T>
std::string Raw(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(v));
}

std::string Floats(size_t n, float v) {
  std::string s(n * sizeof(float), '\0');
  for (size_t i = 0; i < n; ++i) std::memcpy(s.data() + i * sizeof(float), &v, sizeof(v));
  return s;
}

absl::StatusOr<size_t> ModelM(const std::string& id) {
  if (id == "m") return size_t{8};
  return absl::NotFoundError("no model '" + id + "'");
}

TEST(UcxWireParseTest, PushBeginSplitsIdAndTokenIds) {
  PushBeginHeader h{};
  h.num_tokens = 2;
  h.sequence_id_bytes = 3;
  h.num_token_ids = 2;
  const std::string payload = "seq" + Raw(uint32_t{7}) + Raw(uint32_t{9});
  absl::StatusOr<PushBegin> b = ParsePushBegin(h, payload);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->sequence_id, "seq");
  EXPECT_EQ(b->token_ids, (std::vector<uint32_t>{7, 9}));
  EXPECT_TRUE(absl::IsInvalidArgument(ParsePushBegin(h, payload + "x").status()));
  h.num_token_ids = 1;  // neither 0 nor num_tokens
  EXPECT_TRUE(absl::IsInvalidArgument(ParsePushBegin(h, "seq" + Raw(uint32_t{7})).status()));
  // (The token range of PUSH_BEGIN is the daemon's header check, as for every ingest:
  // server/transport/ucx/push_begin_header_test.cc.)
}

TEST(UcxWireParseTest, LayerDataMustHoldItsRowsWithinTheLimit) {
  LayerDataHeader h{};
  h.num_tokens = 4;
  EXPECT_TRUE(CheckLayerData(h, 4 * 128, 128, 1 << 20).ok());
  EXPECT_FALSE(CheckLayerData(h, 4 * 128 - 2, 128, 1 << 20).ok());
  EXPECT_FALSE(CheckLayerData(h, 4 * 128, 128, 256).ok());
  h.tensor = 2;
  EXPECT_FALSE(CheckLayerData(h, 4 * 128, 128, 1 << 20).ok());
  h.tensor = kTensorKey;
  h.num_tokens = 0xffffffffu;  // x row bytes near 2^64 must not wrap to a small size
  EXPECT_FALSE(CheckLayerData(h, 0, size_t{1} << 40, 1 << 20).ok());
}

TEST(UcxWireParseTest, AttendHeaderIsCheckedBeforeThePayloadIsReceived) {
  AttendHeader h{};
  h.batch = 2;
  EXPECT_TRUE(CheckAttendHeader(h, 1000, 256, 1 << 20).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(CheckAttendHeader(h, (1 << 20) + 1, 256, 1 << 20)));
  h.batch = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(CheckAttendHeader(h, 1000, 256, 1 << 20)));
  h.batch = 257;
  EXPECT_TRUE(absl::IsInvalidArgument(CheckAttendHeader(h, 1000, 256, 1 << 20)));
}

TEST(UcxWireParseTest, AttendPayloadParsesAndMustBeExact) {
  AttendHeader h{};
  h.batch = 2;
  h.model_id_bytes = 1;
  const std::string payload = "m" + Raw(SequenceQueryMeta{1, 1}) + Raw(SequenceQueryMeta{2, 2}) +
                              "a" + "bc" + Floats(8, 1.0f) + Floats(16, 2.0f);
  absl::StatusOr<AttendPayload> p = ParseAttend(h, payload, ModelM);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->model_id, "m");
  ASSERT_EQ(p->queries.size(), 2u);
  EXPECT_EQ(p->queries[1].sequence_id, "bc");
  EXPECT_EQ(p->queries[1].num_queries, 2u);
  EXPECT_EQ(p->queries[1].q, std::vector<float>(16, 2.0f));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseAttend(h, payload + "x", ModelM).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseAttend(h, payload.substr(0, 20), ModelM).status()));
  EXPECT_TRUE(absl::IsNotFound(ParseAttend(h, "n" + payload.substr(1), ModelM).status()));
}

TEST(UcxWireParseTest, AttendDoneMustAnswerWhatWasAsked) {
  AttendDoneHeader h{};
  h.batch = 1;
  h.q_heads = 2;
  h.head_dim = 4;
  const std::vector<uint32_t> asked = {3};
  const std::string payload =
      Raw(SequenceResultMeta{40, 3}) + Floats(3 * 8, 0.5f) + Floats(3 * 2, 1.5f);
  absl::StatusOr<std::vector<AttendResult>> r = ParseAttendDone(h, payload, asked, 8);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].attended_tokens, 40u);
  EXPECT_EQ((*r)[0].out, std::vector<float>(24, 0.5f));
  EXPECT_EQ((*r)[0].lse, std::vector<float>(6, 1.5f));
  EXPECT_LE(payload.size(), MaxAttendDoneBytes(asked, 8));
  // Another query count, another shape, a byte too many: the daemon broke the protocol.
  EXPECT_TRUE(absl::IsInternal(ParseAttendDone(h, payload, {2}, 8).status()));
  EXPECT_TRUE(absl::IsInternal(ParseAttendDone(h, payload, asked, 16).status()));
  EXPECT_TRUE(absl::IsInternal(ParseAttendDone(h, payload + "x", asked, 8).status()));
}

TEST(UcxWireParseTest, AttendDoneSizesDoNotWrap) {
  // Heads x dim near 2^64 and a huge query count: the expected size saturates instead of
  // wrapping to the few bytes received.
  AttendDoneHeader h{};
  h.batch = 1;
  h.q_heads = 0xffffffffu;
  h.head_dim = 0xffffffffu;
  const size_t query_values = size_t{0xffffffffu} * 0xffffffffu;
  const std::string payload = Raw(SequenceResultMeta{1, 0x40000000u});
  EXPECT_TRUE(absl::IsInternal(ParseAttendDone(h, payload, {0x40000000u}, query_values).status()));
}

TEST(UcxWireParseTest, StatusCodesOutsideTheCanonicalOnesAreInternal) {
  EXPECT_TRUE(StatusFromWire(0, "").ok());
  EXPECT_TRUE(absl::IsNotFound(StatusFromWire(5, "no model")));
  EXPECT_TRUE(absl::IsInternal(StatusFromWire(99, "?")));
  EXPECT_TRUE(absl::IsInternal(StatusFromWire(-1, "?")));
}

}  // namespace
}  // namespace kvpool::ucx::wire
