#include "server/transport/device_fetch.h"

#include <algorithm>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/backend.h"
#include "server/proto_convert.h"
#include "server/read_snapshot.h"
#include "server/sequence_snapshot.h"
#include "server/transport/cuda_ipc/ipc_range_check.h"
#include "server/transport/session_routing.h"

namespace kvpool::server {
namespace {

constexpr char kNoDeviceFetches[] =
    "FetchToDevice needs a CUDA IPC session with a kvpoold whose pool is on a GPU";

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Hands out the request's free slots in order, each checked against its region.
class SlotSource {
 public:
  SlotSource(const google::protobuf::RepeatedField<int32_t>& free, uint32_t count, const char* what)
      : free_(free), count_(count), what_(what) {}
  absl::StatusOr<int32_t> Next() {
    if (next_ >= free_.size()) {
      return absl::ResourceExhaustedError(absl::StrCat("FetchToDevice: more new ", what_,
                                                       " slots are needed than the ", free_.size(),
                                                       " free ones given"));
    }
    return Checked(free_[next_++]);
  }
  absl::StatusOr<int32_t> Checked(int32_t slot) const {
    if (slot < 0 || static_cast<uint32_t>(slot) >= count_) {
      return absl::InvalidArgumentError(
          absl::StrCat("FetchToDevice: ", what_, " slot ", slot, " outside [0, ", count_, ")"));
    }
    return slot;
  }

 private:
  const google::protobuf::RepeatedField<int32_t>& free_;
  const uint32_t count_;
  const char* const what_;
  int next_ = 0;
};

// Slots for chunks [first, end) of a tier: the first from `tail` (the caller's page, checked)
// when `extend`, the others new.
absl::Status TakeChunks(int64_t first, int64_t end, bool extend, int32_t tail, SlotSource* source,
                        std::vector<int32_t>* out, const char* what) {
  for (int64_t c = first; c < end; ++c) {
    if (c == first && extend) {
      if (tail < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("FetchToDevice: the answer extends the caller's last ", what,
                         " in place; held.", what, "_tail_slot is missing"));
      }
      KVPOOL_ASSIGN_OR_RETURN(int32_t slot, source->Checked(tail));
      out->push_back(slot);
    } else {
      KVPOOL_ASSIGN_OR_RETURN(int32_t slot, source->Next());
      out->push_back(slot);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<LayerFetchSlots>> AssignFetchSlots(
    const v1::FetchToDeviceRequest& request, const SequenceTiers& now, const ReadStarts& starts,
    int block_tokens, int layers) {
  const bool since = request.read().has_since();
  if (since ? request.held_size() != layers : request.held_size() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("FetchToDevice: held has ", request.held_size(), " entries; ",
                     since ? layers : 0, " expected (one per layer read, with a cursor)"));
  }
  const v1::ReadBlocksCursor& c = request.read().since();  // zeros without one
  const int64_t bt = block_tokens;
  const int64_t total = now.total();
  const int64_t held_end = int64_t{c.sink_tokens()} + c.history_tokens() + c.recent_tokens();
  // Where the answer continues a page or block the caller holds partly.
  const bool sink_extends = starts.sink_token < now.sink && starts.sink_token % bt != 0;
  const bool history_extends =
      starts.history_block < CeilDiv(now.history, bt) && c.history_tokens() % bt != 0;
  const bool recent_extends = starts.recent_token < total && starts.recent_token % bt != 0 &&
                              c.recent_tokens() > 0 && starts.recent_token == held_end;
  SlotSource history(request.free_history_slots(), request.history_slots(), "history");
  SlotSource bf16(request.free_bf16_slots(), request.bf16_slots(), "bf16");
  std::vector<LayerFetchSlots> out(layers);
  for (int i = 0; i < layers; ++i) {
    const v1::DeviceLayerSlots held = since ? request.held(i) : v1::DeviceLayerSlots{};
    const int64_t sink_from = starts.sink_token / bt;
    KVPOOL_RETURN_IF_ERROR(
        TakeChunks(sink_from, starts.sink_token < now.sink ? CeilDiv(now.sink, bt) : sink_from,
                   sink_extends, held.sink_tail_slot(), &bf16, &out[i].sink, "sink"));
    KVPOOL_RETURN_IF_ERROR(TakeChunks(starts.history_block, CeilDiv(now.history, bt),
                                      history_extends, held.history_tail_slot(), &history,
                                      &out[i].history, "history"));
    KVPOOL_RETURN_IF_ERROR(
        TakeChunks(starts.recent_token / bt,
                   starts.recent_token < total ? CeilDiv(total, bt) : starts.recent_token / bt,
                   recent_extends, held.recent_tail_slot(), &bf16, &out[i].recent, "recent"));
  }
  return out;
}

namespace {

// Copies of BF16 rows at positions [first, end) of one layer: from the pool's pages (position p
// at page (base + p - tier_begin) / T, slot of the same) into the arena's (p at slot p % T of
// the page of chunk p / T, pages from chunk first / T). K and V of every head per run: two
// strided copies (one row per head).
void AddRowCopies(const Model& m, const std::vector<int32_t>& pool_pages, const PagedKvView& pool,
                  int tier_begin, int base, int first, int end, uint8_t* arena_bf16,
                  const std::vector<int32_t>& arena_pages, std::vector<DeviceCopy>* copies) {
  const BlockLayout& l = m.bf16_layout;
  const int bt = l.tokens;
  const size_t row = l.code_bytes_per_row();
  for (int p = first; p < end;) {
    const int src_pos = base + p - tier_begin;
    const int src_slot = src_pos % bt;
    const int dst_slot = p % bt;
    const int take = std::min({bt - src_slot, bt - dst_slot, end - p});
    const uint8_t* src = pool.Block(pool_pages[src_pos / bt]);
    uint8_t* dst =
        arena_bf16 + static_cast<size_t>(arena_pages[p / bt - first / bt]) * l.block_bytes();
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      copies->push_back({dst + l.CodesOffset(t, 0) + dst_slot * row,
                         src + l.CodesOffset(t, 0) + src_slot * row, take * row,
                         static_cast<size_t>(l.kv_heads), l.head_segment_bytes(),
                         l.head_segment_bytes()});
    }
    p += take;
  }
}

}  // namespace

absl::StatusOr<std::vector<DeviceCopy>> PlanDeviceCopies(
    ComputeBackend* backend, const SequenceSnapshot& s, const ReadStarts& starts,
    absl::Span<const LayerFetchSlots> slots, uint8_t* arena_history, uint8_t* arena_bf16) {
  const Model& m = s.model();
  const int bt = m.block_tokens();
  const int layers = static_cast<int>(s.layers().size());
  // What leaves is verified in the pool first (as ReadBlocks verifies its copies).
  const int window = s.sink() + s.history();
  const int total = window + s.recent();
  std::vector<DeviceCopy> copies;
  for (int i = 0; i < layers; ++i) {
    const SequenceSnapshot::Layer& l = s.layers()[i];
    const LayerFetchSlots& to = slots[i];
    if (starts.sink_token < s.sink()) {
      KVPOOL_RETURN_IF_ERROR(
          s.VerifyTokens(backend, i, starts.sink_token, s.sink() - starts.sink_token));
      AddRowCopies(m, l.sink, s.bf16_pool(), 0, 0, starts.sink_token, s.sink(), arena_bf16, to.sink,
                   &copies);
    }
    const int history_from = starts.history_block * bt;
    if (history_from < s.history()) {
      KVPOOL_RETURN_IF_ERROR(
          s.VerifyTokens(backend, i, s.sink() + history_from, s.history() - history_from));
      for (size_t j = 0; j < to.history.size(); ++j) {
        copies.push_back({arena_history + static_cast<size_t>(to.history[j]) * m.block_bytes,
                          s.HistoryBlock(i, starts.history_block + j), m.block_bytes});
      }
    }
    if (starts.recent_token < total) {
      KVPOOL_RETURN_IF_ERROR(
          s.VerifyTokens(backend, i, starts.recent_token, total - starts.recent_token));
      AddRowCopies(m, l.recent, s.bf16_pool(), window, s.recent_head(), starts.recent_token, total,
                   arena_bf16, to.recent, &copies);
    }
  }
  return copies;
}

absl::Status FetchToDevice(ServiceContext* ctx, const TenantId& tenant,
                           const v1::FetchToDeviceRequest& request,
                           v1::FetchToDeviceResponse* response) {
  if (ctx->backend->device() < 0) return absl::UnavailableError(kNoDeviceFetches);
  const v1::ReadBlocksRequest& read = request.read();
  const std::vector<int> layer_ids(read.layers().begin(), read.layers().end());
  KVPOOL_ASSIGN_OR_RETURN(ReadSnapshot r,
                          SnapshotForRead(*ctx->store, tenant, read.sequence_id(), layer_ids,
                                          read.has_since() ? &read.since() : nullptr));
  const SequenceSnapshot& s = *r.snap;
  const Model& m = s.model();
  const int bt = m.block_tokens();
  const SequenceTiers now = TiersOf(s);
  const ReadStarts starts = r.starts;
  const int layers = static_cast<int>(s.layers().size());
  KVPOOL_ASSIGN_OR_RETURN(const std::vector<LayerFetchSlots> slots,
                          AssignFetchSlots(request, now, starts, bt, layers));

  // The arena, mapped for this call, must hold both regions inside its allocation.
  const size_t history_bytes = static_cast<size_t>(request.history_slots()) * m.block_bytes;
  const size_t arena_bytes =
      history_bytes + static_cast<size_t>(request.bf16_slots()) * m.bf16_page_bytes;
  const uint64_t session = request.session_id();
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<MappedClientBuffer> mapped,
                          ForSession<absl::StatusOr<std::unique_ptr<MappedClientBuffer>>>(
                              ctx->transports, &TransportCapabilities::device_fetches,
                              kNoDeviceFetches, session, [&](Transport* t) {
                                return t->MapClientBuffer(tenant, session,
                                                          request.arena().handle());
                              }));
  KVPOOL_RETURN_IF_ERROR(
      CheckIpcRange(request.arena().offset(), arena_bytes, mapped->size(), "arena"));
  uint8_t* const arena_history = mapped->data() + request.arena().offset();
  uint8_t* const arena_bf16 = arena_history + history_bytes;

  KVPOOL_ASSIGN_OR_RETURN(
      const std::vector<DeviceCopy> copies,
      PlanDeviceCopies(ctx->backend, s, starts, slots, arena_history, arena_bf16));
  uint64_t bytes = 0;
  for (const DeviceCopy& c : copies) bytes += c.bytes * c.rows;
  KVPOOL_RETURN_IF_ERROR(ctx->backend->CopyPoolToDevice(copies));

  v1::ReadBlocksHeader* h = response->mutable_header();
  h->set_sequence_id(s.sequence_id());
  h->set_model_id(m.id);
  h->set_codec_version(m.version_hex);
  FillBlockLayout(m, h->mutable_block_layout());
  h->set_sink_tokens(s.sink());
  h->set_history_tokens(s.history());
  h->set_recent_tokens(s.recent());
  h->set_sequence_incarnation(s.incarnation());
  h->set_sink_token_start(starts.sink_token);
  h->set_history_block_start(starts.history_block);
  h->set_recent_token_start(starts.recent_token);
  for (int i = 0; i < layers; ++i) {
    h->add_layers(s.layers()[i].layer);
    v1::DeviceLayerWrites* w = response->add_layers();
    w->set_layer(s.layers()[i].layer);
    w->mutable_history_slots()->Add(slots[i].history.begin(), slots[i].history.end());
    w->mutable_sink_slots()->Add(slots[i].sink.begin(), slots[i].sink.end());
    w->mutable_recent_slots()->Add(slots[i].recent.begin(), slots[i].recent.end());
  }
  response->set_bytes_copied(bytes);
  return absl::OkStatus();
}

}  // namespace kvpool::server
