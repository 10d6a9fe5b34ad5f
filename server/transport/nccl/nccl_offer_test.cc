// NCCL offers are checked before the daemon starts joining anything: the id's size, the join
// timeout's ceiling, the channel's use.
#include "server/transport/nccl/nccl_offer.h"

#include <string>

#include "gtest/gtest.h"
#include "server/transport/nccl/join_admission.h"

namespace kvpool::server {
namespace {

TransportOffer Offer(std::string id, uint32_t timeout_ms, int use) {
  TransportOffer o;
  o.kind = TransportKind::kNccl;
  o.nccl.unique_id = std::move(id);
  o.nccl.timeout_ms = timeout_ms;
  o.nccl.blocking_ops = true;
  o.nccl.use = use;
  return o;
}

TEST(NcclOfferTest, AcceptsAWellFormedOffer) {
  auto join = ParseNcclOffer(Offer(std::string(128, '\x01'), 0, 2));
  ASSERT_TRUE(join.ok()) << join.status();
  EXPECT_EQ(join->unique_id.size(), kNcclUniqueIdBytes);
  EXPECT_EQ(join->timeout, absl::Milliseconds(kDefaultJoinTimeoutMs));
  EXPECT_TRUE(join->blocking_ops);
  EXPECT_EQ(join->use, NcclUse::kAttention);
  join = ParseNcclOffer(Offer(std::string(128, '\x01'), 1500, 1));
  ASSERT_TRUE(join.ok()) << join.status();
  EXPECT_EQ(join->timeout, absl::Milliseconds(1500));
  EXPECT_EQ(join->use, NcclUse::kIngest);
}

TEST(NcclOfferTest, RefusesWhatCouldNeverJoin) {
  for (const TransportOffer& bad :
       {Offer("short", 0, 1), Offer(std::string(129, 'x'), 0, 1), Offer("", 0, 1),
        Offer(std::string(128, 'x'), kMaxJoinTimeoutMs + 1, 1), Offer(std::string(128, 'x'), 0, 0),
        Offer(std::string(128, 'x'), 0, 3)}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ParseNcclOffer(bad).status()));
  }
  TransportOffer ucx = Offer(std::string(128, 'x'), 0, 1);
  ucx.kind = TransportKind::kUcx;
  EXPECT_TRUE(absl::IsInvalidArgument(ParseNcclOffer(ucx).status()));
}

}  // namespace
}  // namespace kvpool::server
