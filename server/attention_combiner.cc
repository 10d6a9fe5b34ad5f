#include "server/attention_combiner.h"

#include <utility>

#include "kernels/paged_kv.h"

namespace kvpool::server {

struct AttentionCombiner::Call {
  AttentionPlan* plan;
  int layer;
  AttentionRows host_io;
  AttentionRows kernel_io;
  bool on_device;
  absl::StatusOr<absl::Span<const int32_t>> result = absl::UnknownError("not run");
  bool done = false;
};

size_t AttentionCombiner::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_.size();
}

absl::StatusOr<absl::Span<const int32_t>> AttentionCombiner::Attend(AttentionPlan* plan, int layer,
                                                                    const AttentionRows& host_io,
                                                                    const AttentionRows& kernel_io,
                                                                    bool on_device) {
  Call me{plan, layer, host_io, kernel_io, on_device};
  std::vector<Call*> round;
  {
    absl::MutexLock lock(&mu_);
    waiting_.push_back(&me);
    if (running_) {
      // Until a round ran this call, or the running one ended and this caller may lead.
      std::pair<Call*, bool*> state(&me, &running_);
      mu_.Await(absl::Condition(
          +[](std::pair<Call*, bool*>* a) { return a->first->done || !*a->second; }, &state));
      if (me.done) return std::move(me.result);
    }
    round.swap(waiting_);  // this call and every one waiting with it
    running_ = true;
  }
  RunRound(round);
  {
    absl::MutexLock lock(&mu_);
    for (Call* c : round) c->done = true;
    running_ = false;  // a waiting caller leads the next round
  }
  return std::move(me.result);
}

void AttentionCombiner::RunRound(const std::vector<Call*>& round) {
  std::vector<bool> taken(round.size(), false);
  for (size_t i = 0; i < round.size(); ++i) {
    if (taken[i]) continue;
    std::vector<Call*> group;
    for (size_t j = i; j < round.size(); ++j) {
      if (!taken[j] && &round[j]->plan->model() == &round[i]->plan->model() &&
          round[j]->layer == round[i]->layer) {
        group.push_back(round[j]);
        taken[j] = true;
      }
    }
    if (group.size() == 1) {
      Call& c = *group.front();
      c.result = c.plan->Attend(c.layer, c.kernel_io, c.on_device);
    } else {
      RunFused(group);
    }
  }
}

void AttentionCombiner::RunFused(const std::vector<Call*>& group) {
  std::vector<PagedKvTables::Sequence> sequences;
  std::vector<AttentionRows> io;
  std::vector<Call*> members;
  PagedKvView history, bf16;
  for (Call* c : group) {
    const size_t before = sequences.size();
    c->result = c->plan->AppendTo(c->layer, c->host_io, &sequences, &history, &bf16);
    if (!c->result.ok()) {
      sequences.resize(before);  // its own error; the others go on
      continue;
    }
    io.push_back(c->host_io);
    members.push_back(c);
  }
  if (members.empty()) return;
  const PagedKvTables kv(history, bf16, sequences);
  AttentionCall call;
  call.layer = members.front()->layer;
  call.kv = kv.batch();
  call.kv_words = kv.words();
  call.io = io;
  const absl::Status s = backend_->Attend(members.front()->plan->model(), call);
  if (members.size() > 1) {
    fused_calls_.fetch_add(1, std::memory_order_relaxed);
    fused_members_.fetch_add(members.size(), std::memory_order_relaxed);
  }
  if (!s.ok()) {
    for (Call* c : members) c->result = s;
  }
}

}  // namespace kvpool::server
