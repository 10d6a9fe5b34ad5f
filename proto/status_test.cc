#include "proto/status.h"

#include "gtest/gtest.h"

namespace kvpool {
namespace {

TEST(StatusTest, ReasonsCrossTheWireWithCodeAndMessage) {
  for (ErrorReason reason : {ErrorReason::kEvicted, ErrorReason::kExpired, ErrorReason::kQuota,
                             ErrorReason::kLimit, ErrorReason::kCorrupt, ErrorReason::kWrongOwner,
                             ErrorReason::kDraining, ErrorReason::kStaleCursor}) {
    const absl::Status inside =
        WithReason(absl::ResourceExhaustedError("over quota"), reason, {{"quota", "1024"}});
    EXPECT_EQ(ReasonOf(inside), reason);
    const grpc::Status wire = ToGrpcStatus(inside);
    EXPECT_EQ(wire.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_EQ(wire.error_message(), "over quota");
    EXPECT_FALSE(wire.error_details().empty());
    const absl::Status back = FromGrpcStatus(wire, "AppendKv");
    EXPECT_EQ(back.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(back.message(), "AppendKv: over quota");
    EXPECT_EQ(ReasonOf(back), reason) << ErrorReasonName(reason);
    EXPECT_EQ(ReasonMetadata(back).at("quota"), "1024");
    EXPECT_EQ(ParseErrorReason(ErrorReasonName(reason)), reason);
  }
}

TEST(StatusTest, NoReasonNoDetailsAndMalformedDetailsAreIgnored) {
  const grpc::Status plain = ToGrpcStatus(absl::NotFoundError("no sequence 's'"));
  EXPECT_TRUE(plain.error_details().empty());
  EXPECT_EQ(ReasonOf(FromGrpcStatus(plain, "Describe")), std::nullopt);
  const grpc::Status garbage(grpc::StatusCode::NOT_FOUND, "x", std::string("\xff\x01garbage", 9));
  const absl::Status parsed = FromGrpcStatus(garbage, "Describe");
  EXPECT_EQ(parsed.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ReasonOf(parsed), std::nullopt);
  EXPECT_TRUE(WithReason(absl::OkStatus(), ErrorReason::kLimit).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK, "x").ok());
  EXPECT_EQ(ParseErrorReason("NOPE"), std::nullopt);
}

TEST(StatusTest, MessagesAreCutToTheBound) {
  const grpc::Status wire = ToGrpcStatus(absl::InvalidArgumentError(std::string(5000, 'm')));
  EXPECT_EQ(wire.error_message().size(), kMaxStatusMessageBytes + 3);
}

}  // namespace
}  // namespace kvpool
