#include "dataplane/attention_wire.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

CallHeader SomeHeader() {
  CallHeader h;
  h.plan_id = 7;
  h.layer = 31;
  h.call = (uint64_t{1} << 40) + 3;
  h.query_bytes = 8 * 64 * 128 * 4;
  h.lse_bytes = 8 * 64 * 4;
  return h;
}

TEST(AttentionWireTest, CallHeaderRoundTrips) {
  const std::array<uint8_t, kCallHeaderBytes> b = EncodeCallHeader(SomeHeader());
  // Little-endian magic "KVAQ" at the start.
  EXPECT_EQ(std::string(b.begin(), b.begin() + 4), "KVAQ");
  absl::StatusOr<CallHeader> h = DecodeCallHeader(b);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->plan_id, 7u);
  EXPECT_EQ(h->layer, 31);
  EXPECT_EQ(h->call, (uint64_t{1} << 40) + 3);
  EXPECT_EQ(h->query_bytes, 8u * 64 * 128 * 4);
  EXPECT_EQ(h->lse_bytes, 8u * 64 * 4);
}

TEST(AttentionWireTest, NegativeLayerSurvivesTheWire) {
  CallHeader in = SomeHeader();
  in.layer = -2;  // the daemon rejects it per call (InvalidArgument), the channel stays
  absl::StatusOr<CallHeader> h = DecodeCallHeader(EncodeCallHeader(in));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->layer, -2);
}

TEST(AttentionWireTest, CallHeaderRejectsWhatCannotBeParsed) {
  auto bad = [](auto mutate) {
    std::array<uint8_t, kCallHeaderBytes> b = EncodeCallHeader(SomeHeader());
    mutate(b);
    return DecodeCallHeader(b).status();
  };
  EXPECT_EQ(bad([](auto& b) { b[0] ^= 1; }).code(), absl::StatusCode::kInvalidArgument);  // magic
  EXPECT_EQ(bad([](auto& b) { b[4] = 2; }).code(), absl::StatusCode::kInvalidArgument);   // version
  EXPECT_EQ(bad([](auto& b) { b[63] = 1; }).code(), absl::StatusCode::kInvalidArgument);  // pad
  EXPECT_EQ(bad([](auto& b) { std::fill(b.begin() + 8, b.begin() + 12, 0); }).code(),
            absl::StatusCode::kInvalidArgument);  // plan 0
  EXPECT_EQ(bad([](auto& b) { std::fill(b.begin() + 16, b.begin() + 24, 0); }).code(),
            absl::StatusCode::kInvalidArgument);  // call 0

  auto sized = [](uint64_t q, uint64_t l) {
    CallHeader h = SomeHeader();
    h.query_bytes = q;
    h.lse_bytes = l;
    return DecodeCallHeader(EncodeCallHeader(h)).status();
  };
  EXPECT_TRUE(sized(512, 4).ok());
  EXPECT_TRUE(sized(kMaxCallQueryBytes, 4).ok());
  EXPECT_FALSE(sized(0, 4).ok());
  EXPECT_FALSE(sized(514, 2).ok());                     // not a multiple of 4
  EXPECT_FALSE(sized(kMaxCallQueryBytes + 4, 4).ok());  // too large
  EXPECT_FALSE(sized(512, 0).ok());
  EXPECT_FALSE(sized(512, 12).ok());    // does not divide
  EXPECT_FALSE(sized(512, 1024).ok());  // larger than the queries
  const std::array<uint8_t, kCallHeaderBytes> b = EncodeCallHeader(SomeHeader());
  EXPECT_FALSE(DecodeCallHeader(absl::MakeConstSpan(b).subspan(0, 63)).ok());
}

TEST(AttentionWireTest, OkStatusRoundTripsWithTokenCounts) {
  CallStatus s;
  s.call = 99;
  s.attended_tokens = {8192, 0, 32768};
  std::vector<uint8_t> b(kCallStatusBytes, 0xAB);
  ASSERT_TRUE(EncodeCallStatus(s, absl::MakeSpan(b)).ok());
  absl::StatusOr<CallStatus> got = DecodeCallStatus(b);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->call, 99u);
  EXPECT_TRUE(got->status.ok());
  EXPECT_EQ(got->attended_tokens, (std::vector<uint32_t>{8192, 0, 32768}));
}

TEST(AttentionWireTest, ErrorStatusKeepsCodeAndCutsLongMessages) {
  CallStatus s;
  s.call = 5;
  s.status = absl::NotFoundError("no sequence 'gone'");
  std::vector<uint8_t> b(kCallStatusBytes);
  ASSERT_TRUE(EncodeCallStatus(s, absl::MakeSpan(b)).ok());
  absl::StatusOr<CallStatus> got = DecodeCallStatus(b);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->status, absl::NotFoundError("no sequence 'gone'"));
  EXPECT_TRUE(got->attended_tokens.empty());

  s.status = absl::InvalidArgumentError(std::string(1000, 'x'));
  ASSERT_TRUE(EncodeCallStatus(s, absl::MakeSpan(b)).ok());
  got = DecodeCallStatus(b);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(got->status.message(), std::string(kStatusMessageBytes, 'x'));
}

TEST(AttentionWireTest, StatusRejectsMalformedBlocks) {
  CallStatus s;
  s.call = 1;
  s.attended_tokens.assign(kMaxPlanSequences + 1, 1);
  std::vector<uint8_t> b(kCallStatusBytes);
  EXPECT_FALSE(EncodeCallStatus(s, absl::MakeSpan(b)).ok());  // too many counts
  s.attended_tokens.assign(2, 1);
  std::vector<uint8_t> short_block(kCallStatusBytes - 1);
  EXPECT_FALSE(EncodeCallStatus(s, absl::MakeSpan(short_block)).ok());
  ASSERT_TRUE(EncodeCallStatus(s, absl::MakeSpan(b)).ok());
  std::vector<uint8_t> bad = b;
  bad[0] ^= 1;  // magic
  EXPECT_FALSE(DecodeCallStatus(bad).ok());
  bad = b;
  bad[16] = 17;  // no such status code
  EXPECT_FALSE(DecodeCallStatus(bad).ok());
  bad = b;
  bad[21] = 0x10;  // 4098 counts
  EXPECT_FALSE(DecodeCallStatus(bad).ok());
  bad = b;
  bad[25] = 0x10;  // a 4096-byte message
  EXPECT_FALSE(DecodeCallStatus(bad).ok());
  EXPECT_FALSE(DecodeCallStatus(short_block).ok());
}

TEST(AttentionWireTest, PlanShapeFixesTheCallSizes) {
  absl::StatusOr<AttentionPlanShape> s = MakeAttentionPlanShape(32, 2, 64, 128, 256);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->rows(), 64u);
  EXPECT_EQ(s->query_bytes(), 64u * 64 * 128 * 4);
  EXPECT_EQ(s->lse_bytes(), 64u * 64 * 4);
}

TEST(AttentionWireTest, PlanShapeLimits) {
  EXPECT_FALSE(MakeAttentionPlanShape(0, 1, 64, 128, 256).ok());
  EXPECT_FALSE(MakeAttentionPlanShape(257, 1, 64, 128, 256).ok());  // --max_attention_batch
  EXPECT_TRUE(MakeAttentionPlanShape(1024, 1, 8, 64, 4096).ok());
  EXPECT_FALSE(MakeAttentionPlanShape(1025, 1, 8, 64, 4096).ok());  // status block slots
  EXPECT_FALSE(MakeAttentionPlanShape(1, 0, 64, 128, 256).ok());
  EXPECT_FALSE(MakeAttentionPlanShape(1, kMaxPlanQueries + 1, 64, 128, 256).ok());
  EXPECT_FALSE(MakeAttentionPlanShape(1, 1, 0, 128, 256).ok());
  // 256 x 16 x 64 x 128 x 4 = 128 MiB of queries: over kMaxCallQueryBytes.
  EXPECT_EQ(MakeAttentionPlanShape(256, 16, 64, 128, 256).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool::server
