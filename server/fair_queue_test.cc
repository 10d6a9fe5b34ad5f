#include "server/fair_queue.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

// Pops everything, as "flow:item" strings.
std::vector<std::string> Drain(FairQueue<int>* q) {
  std::vector<std::string> order;
  while (!q->empty()) {
    TenantId flow;
    const int item = q->Pop(&flow);
    order.push_back(flow + ":" + std::to_string(item));
  }
  return order;
}

TEST(FairQueueTest, ALoneFlowIsServedInArrivalOrder) {
  FairQueue<int> q;
  q.Push("a", 100, 1);
  q.Push("a", 1, 2);
  q.Push("a", 50, 3);
  EXPECT_EQ(Drain(&q), (std::vector<std::string>{"a:1", "a:2", "a:3"}));
}

TEST(FairQueueTest, ASmallItemDoesNotWaitBehindAFlood) {
  FairQueue<int> q;
  for (int i = 0; i < 100; ++i) q.Push("big", 100, i);
  q.Push("small", 1, 0);
  // One big item is in service (popped) when the small one arrives; it goes next.
  FairQueue<int> busy;
  for (int i = 0; i < 100; ++i) busy.Push("big", 100, i);
  TenantId flow;
  EXPECT_EQ(busy.Pop(&flow), 0);
  busy.Push("small", 1, 0);
  EXPECT_EQ(busy.Pop(&flow), 0);
  EXPECT_EQ(flow, "small");
  // Queued at the same time, the small item's tag (1) is below the big head's (100).
  EXPECT_EQ(Drain(&q)[0], "small:0");
}

TEST(FairQueueTest, FifoModeKeepsArrivalOrderAcrossFlows) {
  FairQueue<int> q;
  q.SetWeighted(false);
  for (int i = 0; i < 3; ++i) q.Push("big", 100, i);
  q.Push("small", 1, 0);
  EXPECT_EQ(Drain(&q), (std::vector<std::string>{"big:0", "big:1", "big:2", "small:0"}));
}

TEST(FairQueueTest, BackloggedFlowsShareWorkUnitsByWeight) {
  FairQueue<int> q;
  q.SetWeights({{"heavy", 3}, {"light", 1}});
  for (int i = 0; i < 8; ++i) {
    q.Push("heavy", 30, i);
    q.Push("light", 30, i);
  }
  // Tags: heavy 10, 20, 30, ...; light 30, 60, ...; ties go to the earlier arrival.
  const std::vector<std::string> order = Drain(&q);
  const std::vector<std::string> first8(order.begin(), order.begin() + 8);
  EXPECT_EQ(first8, (std::vector<std::string>{"heavy:0", "heavy:1", "light:0", "heavy:2", "heavy:3",
                                              "heavy:4", "light:1", "heavy:5"}));
  EXPECT_EQ(q.Stats("heavy").served_units, 240u);
  EXPECT_EQ(q.Stats("light").served, 8u);
}

TEST(FairQueueTest, CostsNotCountsDecideTheShare) {
  FairQueue<int> q;
  // Equal weights: one 30-unit item is worth three 10-unit items.
  q.Push("a", 30, 0);
  q.Push("a", 30, 1);
  for (int i = 0; i < 6; ++i) q.Push("b", 10, i);
  EXPECT_EQ(Drain(&q),
            (std::vector<std::string>{"b:0", "b:1", "a:0", "b:2", "b:3", "b:4", "a:1", "b:5"}));
}

TEST(FairQueueTest, AnIdleFlowBanksNoCredit) {
  FairQueue<int> q;
  // "a" is served alone for a while; "b" then arrives and competes from the current virtual
  // time, not from zero, so "a" is not starved in turn.
  for (int i = 0; i < 5; ++i) q.Push("a", 10, i);
  TenantId flow;
  for (int i = 0; i < 5; ++i) q.Pop(&flow);
  q.Push("b", 10, 0);
  q.Push("b", 10, 1);
  q.Push("a", 10, 5);
  EXPECT_EQ(Drain(&q), (std::vector<std::string>{"b:0", "a:5", "b:1"}));
}

TEST(FairQueueTest, CountsQueuedAndServedPerFlow) {
  FairQueue<int> q;
  q.Push("a", 0, 1);  // 0 counts as 1
  q.Push("a", 5, 2);
  q.Push("b", 2, 3);
  EXPECT_EQ(q.size(), 3u);
  EXPECT_EQ(q.size("a"), 2u);
  EXPECT_EQ(q.active_flows(), 2u);
  EXPECT_EQ(q.Stats("a").queued_units, 6u);
  Drain(&q);
  EXPECT_EQ(q.active_flows(), 0u);
  EXPECT_EQ(q.Stats("a").served_units, 6u);
  EXPECT_EQ(q.Stats("b").served, 1u);
  EXPECT_EQ(q.Stats("nobody").served, 0u);
}

}  // namespace
}  // namespace kvpool::server
