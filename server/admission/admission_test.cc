#include "server/admission/admission.h"

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "proto/status.h"

namespace kvpool::server {
namespace {

AdmissionLimits SmallLimits() {
  AdmissionLimits l;
  l.max_streams_per_connection = 2;
  l.max_streams_per_tenant = 3;
  l.max_reserved_bytes_per_connection = 1000;
  l.max_reserved_bytes_per_tenant = 1500;
  l.idle_timeout = absl::Hours(1);
  l.total_timeout = absl::Hours(1);
  l.reap_period = absl::Milliseconds(5);
  return l;
}

void ExpectLimit(const absl::Status& s) {
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(ReasonOf(s), ErrorReason::kLimit) << s;
}

TEST(AdmissionTest, StreamCapsPerConnectionAndPerTenantRefuseWithReasonLimit) {
  Admission a(SmallLimits());
  auto t1 = a.Open("t", "peer-1", "AppendKv", nullptr);
  auto t2 = a.Open("t", "peer-1", "AppendKv", nullptr);
  ASSERT_TRUE(t1.ok() && t2.ok());
  ExpectLimit(a.Open("t", "peer-1", "AppendKv", nullptr).status());  // connection cap
  auto t3 = a.Open("t", "peer-2", "AppendKv", nullptr);
  ASSERT_TRUE(t3.ok());
  ExpectLimit(a.Open("t", "peer-3", "AppendKv", nullptr).status());  // tenant cap
  EXPECT_TRUE(a.Open("other", "peer-3", "AppendKv", nullptr).ok());  // another tenant
  EXPECT_EQ(a.Counters().refused, 2u);
  t1->reset();
  EXPECT_TRUE(a.Open("t", "peer-1", "AppendKv", nullptr).ok());  // room again
}

TEST(AdmissionTest, ByteCapsAreExactAndARefusedReserveCountsNothing) {
  Admission a(SmallLimits());
  auto x = *a.Open("t", "p1", "AppendKv", nullptr);
  auto y = *a.Open("t", "p2", "AppendKv", nullptr);
  EXPECT_TRUE(x->Reserve(900).ok());
  ExpectLimit(x->Reserve(101));  // 1001 > 1000 per connection
  EXPECT_EQ(x->reserved(), 900u);
  EXPECT_TRUE(y->Reserve(600).ok());
  ExpectLimit(y->Reserve(1));  // 1501 > 1500 per tenant
  x->Unreserve(400);
  EXPECT_TRUE(y->Reserve(400).ok());
  EXPECT_EQ(a.TenantCounters("t").reserved_bytes, 1500u);
  x.reset();
  EXPECT_EQ(a.TenantCounters("t").reserved_bytes, 1000u);
  y.reset();
  const AdmissionCounters c = a.Counters();
  EXPECT_EQ(c.open_streams, 0u);
  EXPECT_EQ(c.reserved_bytes, 0u);
  EXPECT_EQ(a.TenantCounters("t").open_streams, 0u);
}

// Reads have caps of their own: a flood of reads neither takes the streams appends need nor the
// reverse, and each kind's bytes count against its own caps only.
TEST(AdmissionTest, ReadTicketsHaveCapsOfTheirOwn) {
  AdmissionLimits l = SmallLimits();
  l.max_reads_per_connection = 1;
  l.max_reads_per_tenant = 2;
  l.max_read_bytes_per_connection = 100;
  l.max_read_bytes_per_tenant = 150;
  Admission a(l);
  auto r1 = a.Open("t", "p1", "ReadKv", nullptr, TicketKind::kRead);
  ASSERT_TRUE(r1.ok());
  const absl::Status second = a.Open("t", "p1", "Attend", nullptr, TicketKind::kRead).status();
  ExpectLimit(second);
  EXPECT_TRUE(absl::StrContains(second.message(), "reads per connection")) << second;
  // Appends on the same connection are untouched by the reads.
  auto s1 = a.Open("t", "p1", "AppendKv", nullptr);
  auto s2 = a.Open("t", "p1", "AppendKv", nullptr);
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_TRUE((*s1)->Reserve(1000).ok());
  EXPECT_TRUE((*r1)->Reserve(100).ok());
  const absl::Status over = (*r1)->Reserve(1);
  ExpectLimit(over);
  EXPECT_TRUE(absl::StrContains(over.message(), "read bytes in flight per connection")) << over;
  auto r2 = a.Open("t", "p2", "ReadBlocks", nullptr, TicketKind::kRead);
  ASSERT_TRUE(r2.ok());
  ExpectLimit((*r2)->Reserve(51));  // 151 > 150 per tenant
  EXPECT_TRUE((*r2)->Reserve(50).ok());
  ExpectLimit(a.Open("t", "p3", "ReadKv", nullptr, TicketKind::kRead).status());  // tenant cap
  EXPECT_TRUE(a.Open("u", "p3", "ReadKv", nullptr, TicketKind::kRead).ok());

  AdmissionCounters c = a.Counters();
  EXPECT_EQ(c.open_reads, 2u);
  EXPECT_EQ(c.read_bytes, 150u);
  EXPECT_EQ(c.open_streams, 2u);
  EXPECT_EQ(c.reserved_bytes, 1000u);
  EXPECT_EQ(c.refused, 4u);
  EXPECT_EQ(a.TenantCounters("t").open_reads, 2u);
  EXPECT_EQ(a.TenantCounters("t").read_bytes, 150u);
  r1->reset();
  r2->reset();
  c = a.Counters();
  EXPECT_EQ(c.open_reads, 0u);
  EXPECT_EQ(c.read_bytes, 0u);
  EXPECT_EQ(c.reserved_bytes, 1000u);
  EXPECT_TRUE(a.Open("t", "p1", "ReadKv", nullptr, TicketKind::kRead).ok());
}

TEST(AdmissionTest, IdleStreamsExpireOnceAndTouchedOnesDoNot) {
  AdmissionLimits l = SmallLimits();
  l.idle_timeout = absl::Milliseconds(50);
  Admission a(l);
  std::atomic<int> idle_expired{0}, busy_expired{0};
  absl::Notification fired;
  absl::Status why;
  auto idle = *a.Open("t", "p1", "AppendKv", [&](absl::Status s) {
    ++idle_expired;
    why = std::move(s);
    fired.Notify();
  });
  auto busy = *a.Open("t", "p2", "AppendKv", [&](absl::Status) { ++busy_expired; });
  const absl::Time end = absl::Now() + absl::Milliseconds(400);
  while (absl::Now() < end) {
    busy->Touch();
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(fired.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(idle_expired.load(), 1);
  EXPECT_EQ(why.code(), absl::StatusCode::kDeadlineExceeded) << why;
  EXPECT_EQ(ReasonOf(why), ErrorReason::kLimit) << why;
  EXPECT_TRUE(absl::StrContains(why.message(), "idle timeout of 50 ms")) << why;
  EXPECT_TRUE(idle->expired());
  EXPECT_FALSE(busy->expired());
  EXPECT_EQ(busy_expired.load(), 0);
  // An expired ticket still counts until its owner drops it.
  EXPECT_EQ(a.Counters().open_streams, 2u);
  EXPECT_EQ(a.Counters().expired_idle, 1u);
  idle.reset();
  EXPECT_EQ(a.Counters().open_streams, 1u);
}

TEST(AdmissionTest, TotalTimeoutExpiresAStreamAndItsOwnerMayDropTheTicketFromTheCallback) {
  AdmissionLimits l = SmallLimits();
  l.total_timeout = absl::Milliseconds(50);
  Admission a(l);
  std::unique_ptr<Admission::Ticket> t;
  absl::Notification dropped;
  t = *a.Open("t", "p", "ReadKv", [&](absl::Status) {
    t.reset();  // the owner rolls back and drops its ticket from inside the callback
    dropped.Notify();
  });
  ASSERT_TRUE(dropped.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(a.Counters().open_streams, 0u);
  EXPECT_EQ(a.Counters().expired_total, 1u);
}

TEST(AdmissionTest, RandomInterleavingsFromManyThreadsKeepExactAccounting) {
  AdmissionLimits l = SmallLimits();
  l.max_streams_per_connection = 4;
  l.max_streams_per_tenant = 12;
  l.max_reserved_bytes_per_connection = 4096;
  l.max_reserved_bytes_per_tenant = 16384;
  l.idle_timeout = absl::Milliseconds(20);
  Admission a(l);
  std::vector<std::thread> threads;
  for (int w = 0; w < 8; ++w) {
    threads.emplace_back([&a, w] {
      std::mt19937 rng(w);
      std::vector<std::unique_ptr<Admission::Ticket>> mine;
      for (int i = 0; i < 3000; ++i) {
        const int op = rng() % 5;
        if (op == 0 || mine.empty()) {
          auto t = a.Open(rng() % 2 ? "a" : "b", "p" + std::to_string(rng() % 4), "op", nullptr);
          if (t.ok()) mine.push_back(*std::move(t));
        } else if (op == 1) {
          (void)mine[rng() % mine.size()]->Reserve(rng() % 2000);
        } else if (op == 2) {
          mine[rng() % mine.size()]->Unreserve(rng() % 2000);
        } else if (op == 3) {
          mine[rng() % mine.size()]->Touch();
        } else {
          mine.erase(mine.begin() + rng() % mine.size());
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  const AdmissionCounters c = a.Counters();
  EXPECT_EQ(c.open_streams, 0u);
  EXPECT_EQ(c.reserved_bytes, 0u);
  EXPECT_EQ(a.TenantCounters("a").open_streams, 0u);
  EXPECT_EQ(a.TenantCounters("b").reserved_bytes, 0u);
}

}  // namespace
}  // namespace kvpool::server
