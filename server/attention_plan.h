// AttentionPlan: remote decode attention for a fixed batch, a decode worker's steady state: the
// same sequences of one model (num_queries query rows each) attended layer after layer, step
// after step. Each layer's paged KV tables (kernels/paged_kv.h) stay where the backend computes
// (ComputeBackend::AllocateTables), and a call only checks that its sequences did not change (one
// atomic load each, LayerWatch); a sequence that changed is refreshed alone, and only the table
// words that differ are written (PatchTables). A call thus costs the kernels plus what changed,
// never a rebuild of the batch, and nothing is copied through the host per call.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AttentionPlan> plan,
//       AttentionPlan::Create(&store, backend, tenant, model, {"s1", "s2"}, /*num_queries=*/1));
//   KVPOOL_ASSIGN_OR_RETURN(absl::Span<const int32_t> tokens,
//                           plan->Attend(/*layer=*/3, {q, out, lse, plan->rows()}, false));
//
// The sequences are looked up by a layer's first call, and again after a call failed: a call
// naming a sequence that does not exist (or was released, or is corrupt) fails as a snapshot
// would, and one created anew under the same id is found by the next call. Each layer's watches
// hold references on the pages they show (as snapshots do) until the plan is destroyed or the
// layer's call fails.
//
// Not thread-safe: one caller at a time (a channel's loop thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/backend.h"
#include "server/layer_watch.h"
#include "server/model_registry.h"
#include "server/sequence_store.h"
#include "server/tenant.h"

namespace kvpool::server {

class AttentionPlan {
 public:
  // InvalidArgument (empty batch or id, num_queries < 1). Layers are prepared by their first
  // call.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<AttentionPlan>> Create(
      SequenceStore* store, ComputeBackend* backend, TenantId tenant,
      std::shared_ptr<const Model> model, std::vector<std::string> sequence_ids, int num_queries);
  ~AttentionPlan();

  // Decode attention of every query row over `layer`: io.queries [rows][Hq][D] (original basis)
  // into io.out and io.lse (as AttentionRows). With `on_device` the io pointers are addresses the
  // backend's kernels use (its device memory, or HostRegistration::KernelAddress); else host
  // memory. Returns the attended tokens per sequence (valid until the next call).
  // InvalidArgument (layer, io rows, a sequence of another model), NotFound / DataLoss (a
  // sequence missing, released or corrupt), and the backend's errors.
  // With `mailbox` (on_device, io inside it) the call is ordered on the device after the
  // mailbox's `ready` and returns once queued (AttentionCall::mailbox).
  [[nodiscard]] absl::StatusOr<absl::Span<const int32_t>> Attend(
      int layer, const AttentionRows& io, bool on_device, const DeviceMailbox* mailbox = nullptr);

  // For a call fused with other plans' (attention_combiner.h): brings `layer` up to date as
  // Attend does and appends its sequences (num_queries rows each, in order) to `sequences`, and
  // the pools they are in; returns the attended tokens per sequence. The block ids stay valid
  // until the plan's next call. Errors as Attend's.
  [[nodiscard]] absl::StatusOr<absl::Span<const int32_t>> AppendTo(
      int layer, const AttentionRows& io, std::vector<PagedKvTables::Sequence>* sequences,
      PagedKvView* history_pool, PagedKvView* bf16_pool);

  const Model& model() const { return *model_; }
  const std::vector<std::string>& sequence_ids() const { return ids_; }
  int batch() const { return static_cast<int>(ids_.size()); }
  int num_queries() const { return num_queries_; }
  int rows() const { return batch() * num_queries_; }
  // Table words written since creation (patches; a measure of the incremental updates).
  uint64_t words_written() const { return words_written_; }

 private:
  struct Layer;
  AttentionPlan(SequenceStore* store, ComputeBackend* backend, TenantId tenant,
                std::shared_ptr<const Model> model, std::vector<std::string> ids, int num_queries);
  absl::StatusOr<Layer*> Prepare(int layer);
  // Checks the call, prepares and refreshes `layer` (dropped again on error).
  absl::StatusOr<Layer*> Ready(int layer, const AttentionRows& io);
  // The attended tokens of each sequence of `l`, in attended_.
  absl::Span<const int32_t> Attended(const Layer& l);
  // Refreshes the layer's watches and brings its tables up to date.
  absl::Status Refresh(Layer* l);
  // (Re)lays the layer's tables out for its watches' current sizes, with room to grow.
  absl::Status Relayout(Layer* l);
  // Every tier's words of query row `row` of `l` (from `w`) into its host image, recording
  // the words that change in patch_.
  void WriteRow(Layer* l, int row, const LayerWatch& w);

  SequenceStore* const store_;
  ComputeBackend* const backend_;
  const TenantId tenant_;
  const std::shared_ptr<const Model> model_;
  const std::vector<std::string> ids_;
  const int num_queries_;
  std::vector<std::unique_ptr<Layer>> layers_;  // by layer; null until first called
  std::vector<int32_t> attended_;
  std::vector<TableWord> patch_;
  uint64_t words_written_ = 0;
};

}  // namespace kvpool::server
