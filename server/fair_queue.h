// FairQueue: the worker pool's queue, shared across tenants by weighted fair queueing, so that
// one tenant's flood of large work does not starve another's small work.
//
// Each tenant is a flow with a weight (its compute_weight; 0 or absent counts as 1). An item
// pushed with a cost (its work units) gets a virtual finish tag
//   finish = max(V, flow's last finish) + cost / weight
// where V is the finish tag of the item popped last (self-clocked fair queueing); Pop takes the
// smallest tag, ties by arrival. Over any busy period a backlogged flow is served work units in
// proportion to its weight, and an item of a flow that had nothing queued gets the tag
// V + cost / weight: it waits behind about cost * (other weight / own weight) units of each other
// flow's work, however much that flow has queued. The queue is work-conserving: a lone flow is
// served in arrival order with no delay. In FIFO mode (fairness off) tags are ignored and
// items leave in arrival order, as a plain queue.
//
//   FairQueue<Task> q;
//   q.SetWeights({{"big", 1}, {"small", 1}});
//   q.Push("big", /*cost=*/100, t1);
//   q.Push("small", /*cost=*/1, t2);
//   Task next = q.Pop();   // t2
//
// Not thread-safe: the worker pool holds its lock around every call. Deterministic: the order
// depends only on the calls.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <utility>

#include "server/tenant.h"

namespace kvpool::server {

// One flow's counters.
struct FairFlowStats {
  size_t queued = 0;          // items waiting now
  uint64_t queued_units = 0;  // their cost
  uint64_t served = 0;        // items popped since start
  uint64_t served_units = 0;  // their cost
};

template <typename T>
class FairQueue {
 public:
  // Weights by tenant; 0 and tenants absent from the map count as 1. Applies to items pushed
  // from now on.
  void SetWeights(std::map<TenantId, uint32_t> weights) { weights_ = std::move(weights); }
  // false: arrival order across every flow (FIFO), for comparison.
  void SetWeighted(bool weighted) { weighted_ = weighted; }
  bool weighted() const { return weighted_; }

  // Queues `item` of `flow` costing `cost` work units (0 counts as 1).
  void Push(const TenantId& flow, uint64_t cost, T item) {
    cost = std::max<uint64_t>(cost, 1);
    Flow& f = flows_[flow];
    const double start = std::max(virtual_time_, f.last_finish);
    f.last_finish = start + static_cast<double>(cost) / WeightOf(flow);
    f.items.push_back(Item{next_arrival_++, f.last_finish, cost, std::move(item)});
    f.stats.queued += 1;
    f.stats.queued_units += cost;
    ++size_;
  }

  // The next item (requires !empty()); its flow in `*flow` when given.
  T Pop(TenantId* flow = nullptr) {
    Flow* best = nullptr;
    const TenantId* best_name = nullptr;
    for (auto& [name, f] : flows_) {
      if (f.items.empty()) continue;
      if (best == nullptr || Before(f.items.front(), best->items.front())) {
        best = &f;
        best_name = &name;
      }
    }
    Item item = std::move(best->items.front());
    best->items.pop_front();
    virtual_time_ = std::max(virtual_time_, item.finish);
    best->stats.queued -= 1;
    best->stats.queued_units -= item.cost;
    best->stats.served += 1;
    best->stats.served_units += item.cost;
    --size_;
    if (flow != nullptr) *flow = *best_name;
    return std::move(item.value);
  }

  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  // Items `flow` has queued.
  size_t size(const TenantId& flow) const {
    auto it = flows_.find(flow);
    return it == flows_.end() ? 0 : it->second.items.size();
  }
  // Flows with at least one item queued.
  size_t active_flows() const {
    size_t n = 0;
    for (const auto& [name, f] : flows_) n += f.items.empty() ? 0 : 1;
    return n;
  }
  FairFlowStats Stats(const TenantId& flow) const {
    auto it = flows_.find(flow);
    return it == flows_.end() ? FairFlowStats{} : it->second.stats;
  }

 private:
  struct Item {
    uint64_t arrival = 0;
    double finish = 0;
    uint64_t cost = 1;
    T value;
  };
  struct Flow {
    std::deque<Item> items;
    double last_finish = 0;
    FairFlowStats stats;
  };

  double WeightOf(const TenantId& flow) const {
    auto it = weights_.find(flow);
    return it == weights_.end() || it->second == 0 ? 1.0 : static_cast<double>(it->second);
  }
  bool Before(const Item& a, const Item& b) const {
    if (weighted_ && a.finish != b.finish) return a.finish < b.finish;
    return a.arrival < b.arrival;
  }

  std::map<TenantId, Flow> flows_;
  std::map<TenantId, uint32_t> weights_;
  bool weighted_ = true;
  double virtual_time_ = 0;
  uint64_t next_arrival_ = 0;
  size_t size_ = 0;
};

}  // namespace kvpool::server
