// SessionRegistry: sessions are bound to their tenant, end once with a reason every watcher
// hears, and a session that had to be watched and was not ends by itself.
#include "server/transport/session_registry.h"

#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

struct Channel {
  std::string name;
};

TEST(SessionRegistryTest, SessionsBelongToTheirTenant) {
  SessionRegistry<Channel> r(8);
  auto id = r.Add(kDefaultTenant, std::make_shared<Channel>(Channel{"a"}), false);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_NE(*id, 0u);
  auto found = r.Find(kDefaultTenant, *id);
  ASSERT_TRUE(found.ok());
  EXPECT_EQ((*found)->name, "a");
  const TenantId other = "other";
  EXPECT_TRUE(absl::IsNotFound(r.Find(other, *id).status()));
  EXPECT_TRUE(absl::IsNotFound(r.End(other, *id, absl::OkStatus()).status()));
  EXPECT_TRUE(absl::IsNotFound(r.Watch(other, *id, [](absl::Status) {})));
  EXPECT_TRUE(absl::IsNotFound(r.Find(kDefaultTenant, *id + 1).status()));
  EXPECT_EQ(r.size(), 1u);
  // The three attempts on another tenant's live session are counted; a missing id is not.
  EXPECT_EQ(r.foreign_attempts(), 3u);
}

// The transport's own lookups (a message on a connection bound to the session, its sweeps) see
// every tenant's sessions and count nothing as foreign.
TEST(SessionRegistryTest, TransportLookupsSeeEveryTenant) {
  SessionRegistry<Channel> r(8);
  auto a = r.Add("team-a", std::make_shared<Channel>(Channel{"a"}), false);
  auto b = r.Add("team-b", std::make_shared<Channel>(Channel{"b"}), false);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_NE(r.FindAny(*a), nullptr);
  EXPECT_EQ(r.FindAny(*a)->name, "a");
  EXPECT_EQ(r.FindAny(*b)->name, "b");
  EXPECT_EQ(r.FindAny(*a ^ *b), nullptr);
  std::set<std::string> names;
  for (const std::shared_ptr<Channel>& c : r.All()) names.insert(c->name);
  EXPECT_EQ(names, (std::set<std::string>{"a", "b"}));
  EXPECT_EQ(r.foreign_attempts(), 0u);
  ASSERT_NE(r.EndAny(*a, absl::OkStatus()), nullptr);
  EXPECT_EQ(r.FindAny(*a), nullptr);
  EXPECT_EQ(r.All().size(), 1u);
}

TEST(SessionRegistryTest, IdsDoNotFollowEachOther) {
  SessionRegistry<Channel> r(64);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 32; ++i) {
    auto id = r.Add(kDefaultTenant, std::make_shared<Channel>(), false);
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  int small_steps = 0;  // consecutive ids within 2^32 of each other: 1 in 2^31 by chance
  for (size_t i = 1; i < ids.size(); ++i) {
    const uint64_t d = ids[i] > ids[i - 1] ? ids[i] - ids[i - 1] : ids[i - 1] - ids[i];
    if (d < (uint64_t{1} << 32)) ++small_steps;
  }
  EXPECT_EQ(small_steps, 0);
}

TEST(SessionRegistryTest, EndsOnceAndEveryWatcherHearsWhy) {
  SessionRegistry<Channel> r(8);
  auto id = r.Add(kDefaultTenant, std::make_shared<Channel>(Channel{"a"}), true);
  ASSERT_TRUE(id.ok());
  std::vector<absl::Status> heard;
  ASSERT_TRUE(r.Watch(kDefaultTenant, *id, [&](absl::Status s) { heard.push_back(s); }).ok());
  ASSERT_TRUE(r.Watch(kDefaultTenant, *id, [&](absl::Status s) { heard.push_back(s); }).ok());
  std::shared_ptr<Channel> ended = r.EndAny(*id, absl::UnavailableError("peer failed"));
  ASSERT_NE(ended, nullptr);
  EXPECT_EQ(ended->name, "a");
  ASSERT_EQ(heard.size(), 2u);
  for (const absl::Status& s : heard) EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  // Gone: a second end finds nothing, and nobody hears anything again.
  EXPECT_EQ(r.EndAny(*id, absl::CancelledError("again")), nullptr);
  EXPECT_TRUE(absl::IsNotFound(r.End(kDefaultTenant, *id, absl::OkStatus()).status()));
  EXPECT_EQ(heard.size(), 2u);
  EXPECT_EQ(r.size(), 0u);
}

TEST(SessionRegistryTest, UnwatchedSessionsThatMustBeWatchedEnd) {
  SessionRegistry<Channel> r(8);
  const absl::Time t0 = absl::Now();
  auto leased = r.Add(kDefaultTenant, std::make_shared<Channel>(Channel{"leased"}), true, t0);
  auto watched = r.Add(kDefaultTenant, std::make_shared<Channel>(Channel{"watched"}), true, t0);
  auto free = r.Add(kDefaultTenant, std::make_shared<Channel>(Channel{"free"}), false, t0);
  auto young = r.Add(kDefaultTenant, std::make_shared<Channel>(Channel{"young"}), true,
                     t0 + absl::Seconds(20));
  ASSERT_TRUE(leased.ok() && watched.ok() && free.ok() && young.ok());
  ASSERT_TRUE(r.Watch(kDefaultTenant, *watched, [](absl::Status) {}).ok());
  std::vector<std::shared_ptr<Channel>> ended =
      r.EndUnwatched(t0 + absl::Seconds(10), absl::DeadlineExceededError("not watched"));
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0]->name, "leased");
  EXPECT_TRUE(r.Find(kDefaultTenant, *watched).ok());
  EXPECT_TRUE(r.Find(kDefaultTenant, *free).ok());
  EXPECT_TRUE(r.Find(kDefaultTenant, *young).ok());
  EXPECT_EQ(r.EndAll(absl::UnavailableError("shutdown")).size(), 3u);
  EXPECT_EQ(r.size(), 0u);
}

TEST(SessionRegistryTest, BoundedAndIdsAreUnique) {
  SessionRegistry<Channel> r(64);
  std::set<uint64_t> ids;
  for (int i = 0; i < 64; ++i) {
    auto id = r.Add(kDefaultTenant, std::make_shared<Channel>(), false);
    ASSERT_TRUE(id.ok());
    ids.insert(*id);
  }
  EXPECT_EQ(ids.size(), 64u);
  EXPECT_TRUE(absl::IsResourceExhausted(
      r.Add(kDefaultTenant, std::make_shared<Channel>(), false).status()));
  ASSERT_TRUE(r.End(kDefaultTenant, *ids.begin(), absl::OkStatus()).ok());
  EXPECT_TRUE(r.Add(kDefaultTenant, std::make_shared<Channel>(), false).ok());
}

}  // namespace
}  // namespace kvpool::server
