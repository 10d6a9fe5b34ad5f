#include "client/kv_mirror.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/transport_service.grpc.pb.h"
#include "proto/status.h"

namespace kvpool::client {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

absl::Status Mismatch(const std::string& what) {
  return absl::DataLossError(
      absl::StrCat("ReadBlocks: the answer does not continue the mirror's copy: ", what));
}

}  // namespace

void KvMirror::AlignedDelete::operator()(uint8_t* p) const {
  ::operator delete[](p, std::align_val_t{64});
}

size_t KvMirror::ArenaBytes(const BlockLayout& history, const BlockLayout& bf16,
                            const KvMirrorOptions& options) {
  return static_cast<size_t>(std::max(options.history_slots, 0)) * history.block_bytes() +
         static_cast<size_t>(std::max(options.bf16_slots, 0)) * bf16.block_bytes();
}

absl::StatusOr<std::unique_ptr<KvMirror>> KvMirror::Create(const KvpoolClient* client,
                                                           const std::string& model_id,
                                                           const KvMirrorOptions& options,
                                                           MirrorArena arena) {
  if (options.history_slots <= 0 || options.bf16_slots <= 0) {
    return absl::InvalidArgumentError("a mirror needs history and BF16 slots");
  }
  KVPOOL_ASSIGN_OR_RETURN(ModelDescription model, client->DescribeModel(model_id, false));
  const v1::BlockLayoutDescriptor& d = model.info.block_layout();
  auto mirror = std::unique_ptr<KvMirror>(new KvMirror());
  mirror->client_ = client;
  mirror->model_id_ = model_id;
  mirror->num_layers_ = static_cast<int>(model.info.shape().num_layers());
  BlockLayout& h = mirror->history_layout_;
  h.tokens = d.tokens();
  h.kv_heads = d.kv_heads();
  h.head_dim = d.head_dim();
  h.group_size = d.group_size();
  h.bits = d.bits();
  BlockLayout& b = mirror->bf16_layout_;
  b = h;
  b.group_size = h.head_dim;
  b.bits = 16;
  if (h.tokens <= 0 || h.block_bytes() != d.block_bytes() ||
      b.block_bytes() != model.info.bf16_page_bytes()) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model_id, ": a block layout this client does not know"));
  }
  const size_t need = ArenaBytes(h, b, options);
  if (arena.base == nullptr) {
    mirror->owned_.reset(static_cast<uint8_t*>(::operator new[](need, std::align_val_t{64})));
    arena.base = mirror->owned_.get();
    arena.bytes = need;
    arena.write = nullptr;
  } else if (arena.bytes < need || reinterpret_cast<uintptr_t>(arena.base) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the mirror's arena needs ", need, " bytes, 16-byte aligned; it has ", arena.bytes));
  }
  mirror->arena_ = std::move(arena);
  mirror->slots_ = options;
  const ScaleDtype scale =
      d.scale_dtype() == v1::SCALE_DTYPE_BF16 ? ScaleDtype::kBf16 : ScaleDtype::kFp16;
  mirror->history_pool_ = {mirror->arena_.base, h, scale, options.history_slots, 0};
  mirror->bf16_pool_ = {mirror->arena_.base + options.history_slots * h.block_bytes(), b, scale,
                        options.bf16_slots, 0};
  for (int32_t i = options.history_slots; i-- > 0;) mirror->free_history_.push_back(i);
  for (int32_t i = options.bf16_slots; i-- > 0;) mirror->free_bf16_.push_back(i);
  return mirror;
}

const v1::ReadBlocksCursor* KvMirror::Held(const std::string& sequence_id) const {
  auto it = held_.find(sequence_id);
  return it == held_.end() ? nullptr : &it->second.cursor;
}

absl::StatusOr<FetchStats> KvMirror::Fetch(const std::string& sequence_id) {
  v1::ReadBlocksRequest request;
  request.set_sequence_id(sequence_id);
  auto it = held_.find(sequence_id);
  if (it != held_.end()) *request.mutable_since() = it->second.cursor;
  absl::StatusOr<BlocksRead> read = client_->ReadBlocks(request);
  if (!read.ok() && it != held_.end() && ReasonOf(read.status()) == ErrorReason::kStaleCursor) {
    // Another sequence under the same id: the copy is of no use.
    Free(&it->second);
    held_.erase(it);
    it = held_.end();
    request.clear_since();
    read = client_->ReadBlocks(request);
  }
  if (!read.ok()) return read.status();
  if (it != held_.end() && it->second.cursor.sink_tokens() > 0 &&
      read->header.sink_token_start() == 0) {
    // A daemon that predates cursors answered in full: start over from that answer.
    Free(&it->second);
    held_.erase(it);
    it = held_.end();
  }
  FetchStats stats;
  stats.full = it == held_.end();
  if (stats.full) {
    HeldSequence fresh;
    KVPOOL_RETURN_IF_ERROR(Apply(*read, &fresh, &stats));
    held_.emplace(sequence_id, std::move(fresh));
  } else if (absl::Status applied = Apply(*read, &it->second, &stats); !applied.ok()) {
    if (it->second.layers.empty()) held_.erase(it);  // torn by a failed write: forgotten
    return applied;
  }
  return stats;
}

absl::StatusOr<KvMirror::Continuation> KvMirror::Continues(const v1::ReadBlocksHeader& h,
                                                           const HeldSequence& held) const {
  const v1::BlockLayoutDescriptor& d = h.block_layout();
  const int64_t bt = history_layout_.tokens;
  if (h.model_id() != model_id_ || d.tokens() != history_layout_.tokens ||
      d.kv_heads() != history_layout_.kv_heads || d.head_dim() != history_layout_.head_dim ||
      d.bits() != history_layout_.bits || d.block_bytes() != history_layout_.block_bytes()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", h.sequence_id(), " is not of the mirror's model ", model_id_));
  }
  if (h.layers_size() != num_layers_) return Mismatch("not every layer");
  for (int i = 0; i < num_layers_; ++i) {
    if (h.layers(i) != i) return Mismatch("layers out of order");
  }
  const bool fresh = held.layers.empty();
  const v1::ReadBlocksCursor& c = held.cursor;  // zeros when fresh
  const int64_t sink = h.sink_tokens(), history = h.history_tokens();
  const int64_t window = sink + history;
  const int64_t total = window + h.recent_tokens();
  const int64_t held_total = int64_t{c.sink_tokens()} + c.history_tokens() + c.recent_tokens();
  if (!fresh && (h.sequence_incarnation() != c.sequence_incarnation() || sink < c.sink_tokens() ||
                 history < c.history_tokens() || total < held_total)) {
    return Mismatch("the sequence shrank");
  }
  // The starts the daemon must have used for this cursor (read_service.proto, ReadBlocks).
  Continuation k;
  const int64_t blocks = CeilDiv(history, bt);
  k.block_start = c.history_tokens() < history ? c.history_tokens() / bt : blocks;
  k.recent_start = std::max(held_total, window);
  if (h.sink_token_start() != c.sink_tokens() || h.history_block_start() != k.block_start ||
      std::max<int64_t>(h.recent_token_start(), window) != k.recent_start) {
    return Mismatch("the answer's starts are not the cursor's");
  }
  k.chunk_begin = window / bt;
  k.chunk_end = total > window ? CeilDiv(total, bt) : k.chunk_begin;
  return k;
}

void KvMirror::SetCursor(const v1::ReadBlocksHeader& h, HeldSequence* held) {
  held->cursor.set_sequence_incarnation(h.sequence_incarnation());
  held->cursor.set_sink_tokens(h.sink_tokens());
  held->cursor.set_history_tokens(h.history_tokens());
  held->cursor.set_recent_tokens(h.recent_tokens());
}

absl::Status KvMirror::Apply(const BlocksRead& read, HeldSequence* held, FetchStats* stats) {
  const v1::ReadBlocksHeader& h = read.header;
  const int64_t bt = history_layout_.tokens;
  KVPOOL_ASSIGN_OR_RETURN(const Continuation k, Continues(h, *held));
  const bool fresh = held->layers.empty();
  const v1::ReadBlocksCursor& c = held->cursor;
  const int64_t sink = h.sink_tokens(), history = h.history_tokens();
  const int64_t total = sink + history + h.recent_tokens();
  const int64_t blocks = CeilDiv(history, bt);
  const int64_t block_start = k.block_start, recent_start = k.recent_start;
  const int64_t chunk_begin = k.chunk_begin, chunk_end = k.chunk_end;

  // The slots this needs, checked before anything changes. Recent pages: the window's chunks
  // [chunk_begin, chunk_end); those held outside it are freed.
  const Layer* any = fresh ? nullptr : &held->layers[0];
  const int64_t held_sink = any ? static_cast<int64_t>(any->sink.size()) : 0;
  const int64_t held_blocks = any ? static_cast<int64_t>(any->history.size()) : 0;
  const int64_t held_recent = any ? static_cast<int64_t>(any->recent.size()) : 0;
  const int64_t kept_from = std::max(held->recent_chunk0, chunk_begin);
  const int64_t kept_to = std::min(held->recent_chunk0 + held_recent, chunk_end);
  const int64_t kept = std::max<int64_t>(0, kept_to - kept_from);
  const int64_t layers = num_layers_;
  const int64_t new_bf16 =
      layers * (CeilDiv(sink, bt) - held_sink + (chunk_end - chunk_begin) - kept);
  const int64_t new_history = layers * (blocks - held_blocks);
  if (new_history > static_cast<int64_t>(free_history_.size()) ||
      new_bf16 > static_cast<int64_t>(free_bf16_.size()) + layers * (held_recent - kept)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the mirror has ", free_history_.size(), " free history and ", free_bf16_.size(),
        " free BF16 slots; sequence ", h.sequence_id(), " needs ", new_history, " and ", new_bf16));
  }

  if (fresh) held->layers.resize(num_layers_);
  absl::Status written;
  for (int i = 0; i < num_layers_ && written.ok(); ++i) {
    const LayerBlocks& in = read.layers[i];
    Layer& l = held->layers[i];
    while (static_cast<int64_t>(l.sink.size()) < CeilDiv(sink, bt)) {
      l.sink.push_back(free_bf16_.back());
      free_bf16_.pop_back();
    }
    written = WriteRows(in.sink_k, in.sink_v, c.sink_tokens(), sink - c.sink_tokens(), l.sink, 0);
    for (size_t j = 0; j < in.blocks.size() && written.ok(); ++j) {
      const size_t index = static_cast<size_t>(block_start) + j;
      if (index == l.history.size()) {
        l.history.push_back(free_history_.back());
        free_history_.pop_back();
      }
      const std::string& data = in.blocks[j].data();
      written = Write(history_pool_.Block(l.history[index]),
                      reinterpret_cast<const uint8_t*>(data.data()), data.size());
      stats->bytes += data.size();
      ++stats->history_blocks;
    }
    // Rows demoted since the last fetch: their pages go back to the allocator.
    for (int64_t chunk = held->recent_chunk0; !l.recent.empty() && chunk < chunk_begin; ++chunk) {
      free_bf16_.push_back(l.recent.front());
      l.recent.pop_front();
    }
    while (static_cast<int64_t>(l.recent.size()) > chunk_end - chunk_begin) {
      free_bf16_.push_back(l.recent.back());
      l.recent.pop_back();
    }
    while (static_cast<int64_t>(l.recent.size()) < chunk_end - chunk_begin) {
      l.recent.push_back(free_bf16_.back());
      free_bf16_.pop_back();
    }
    if (written.ok()) {
      written = WriteRows(in.recent_k, in.recent_v, recent_start, total - recent_start, l.recent,
                          chunk_begin);
    }
    const size_t row_bytes = bf16_layout_.code_bytes_per_row() * bf16_layout_.kv_heads;
    stats->bytes += in.sink_k.size() + in.sink_v.size() + in.recent_k.size() + in.recent_v.size();
    stats->rows += (in.sink_k.size() + in.recent_k.size()) / row_bytes;
  }
  held->recent_chunk0 = chunk_begin;
  if (!written.ok()) {
    // The caller's arena refused a copy: the copy is torn, so the sequence is forgotten (the
    // next fetch reads it in full).
    Free(held);
    held->cursor.Clear();
    held->layers.clear();
    return written;
  }
  SetCursor(h, held);
  return absl::OkStatus();
}

absl::StatusOr<FetchStats> KvMirror::FetchToDevice(const std::string& sequence_id,
                                                   const DeviceFetchTarget& target) {
  const int64_t bt = history_layout_.tokens;
  auto stub = v1::TransportService::NewStub(client_->channel());
  // A request carries at most `limit` free slots of each kind, from the lists' backs.
  auto call = [&](const HeldSequence* held,
                  size_t limit) -> absl::StatusOr<v1::FetchToDeviceResponse> {
    v1::FetchToDeviceRequest request;
    request.set_session_id(target.session_id);
    request.mutable_read()->set_sequence_id(sequence_id);
    request.mutable_arena()->set_handle(target.handle);
    request.mutable_arena()->set_offset(target.offset);
    request.set_history_slots(static_cast<uint32_t>(slots_.history_slots));
    request.set_bf16_slots(static_cast<uint32_t>(slots_.bf16_slots));
    // The free lists hand out their backs first; the daemon takes from the front.
    request.mutable_free_history_slots()->Add(
        free_history_.rbegin(), free_history_.rbegin() + std::min(limit, free_history_.size()));
    request.mutable_free_bf16_slots()->Add(
        free_bf16_.rbegin(), free_bf16_.rbegin() + std::min(limit, free_bf16_.size()));
    if (held != nullptr) {
      const v1::ReadBlocksCursor& c = held->cursor;
      *request.mutable_read()->mutable_since() = c;
      const int64_t end = int64_t{c.sink_tokens()} + c.history_tokens() + c.recent_tokens();
      for (const Layer& l : held->layers) {
        v1::DeviceLayerSlots* tail = request.add_held();
        tail->set_sink_tail_slot(c.sink_tokens() % bt != 0 && !l.sink.empty() ? l.sink.back() : -1);
        tail->set_history_tail_slot(
            c.history_tokens() % bt != 0 && !l.history.empty() ? l.history.back() : -1);
        tail->set_recent_tail_slot(
            c.recent_tokens() > 0 && end % bt != 0 && !l.recent.empty() ? l.recent.back() : -1);
      }
    }
    v1::FetchToDeviceResponse response;
    std::unique_ptr<grpc::ClientContext> context = client_->NewContext();
    const grpc::Status s = stub->FetchToDevice(context.get(), request, &response);
    if (!s.ok()) return FromGrpcStatus(s, "FetchToDevice");
    return response;
  };
  // A held sequence usually gained a few pages per layer since its last fetch: its request
  // offers that many free slots, not the whole arena's (a request and a search per slot that
  // grew with the arena), and asks again with every free slot when the daemon needs more. A
  // sequence fetched for the first time is offered every free slot.
  const size_t all = std::max(free_history_.size(), free_bf16_.size());
  const size_t few = static_cast<size_t>(kHeldFetchSlotsPerLayer) * num_layers_;
  auto it = held_.find(sequence_id);
  absl::StatusOr<v1::FetchToDeviceResponse> r =
      it == held_.end() ? call(nullptr, all) : call(&it->second, few);
  if (!r.ok() && it != held_.end() && absl::IsResourceExhausted(r.status()) && few < all) {
    r = call(&it->second, all);
  }
  if (!r.ok() && it != held_.end() && ReasonOf(r.status()) == ErrorReason::kStaleCursor) {
    Free(&it->second);
    held_.erase(it);
    it = held_.end();
    r = call(nullptr, all);
  }
  if (!r.ok()) return r.status();
  FetchStats stats;
  stats.full = it == held_.end();
  if (stats.full) it = held_.emplace(sequence_id, HeldSequence{}).first;
  if (absl::Status applied = ApplyDeviceWrites(*r, &it->second, &stats); !applied.ok()) {
    // The daemon's answer does not fit: what the arena holds for it is unknown now.
    Free(&it->second);
    held_.erase(it);
    return applied;
  }
  return stats;
}

bool KvMirror::TakeFree(std::vector<int32_t>* free, int32_t slot) {
  // Slots are handed out from the list's back (a request offers it reversed): found there first.
  auto at = std::find(free->rbegin(), free->rend(), slot);
  if (at == free->rend()) return false;
  free->erase(std::next(at).base());
  return true;
}

absl::Status KvMirror::ApplyDeviceWrites(const v1::FetchToDeviceResponse& r, HeldSequence* held,
                                         FetchStats* stats) {
  const v1::ReadBlocksHeader& h = r.header();
  const int64_t bt = history_layout_.tokens;
  KVPOOL_ASSIGN_OR_RETURN(const Continuation k, Continues(h, *held));
  if (r.layers_size() != num_layers_) return Mismatch("not every layer written");
  if (held->layers.empty()) held->layers.resize(num_layers_);
  const int64_t sink_chunk0 = h.sink_token_start() / bt;
  const int64_t recent_chunk0 = k.recent_start / bt;
  const int64_t sink = h.sink_tokens();
  const int64_t total = sink + h.history_tokens() + h.recent_tokens();
  // Extends an existing entry in place (the same slot) or appends a slot taken from `free`.
  auto place = [](std::vector<int32_t>* free, int32_t slot, int32_t* existing) {
    if (existing != nullptr) {
      if (*existing == slot) return true;
      const int32_t old = *existing;
      if (!TakeFree(free, slot)) return false;
      free->push_back(old);
      *existing = slot;
      return true;
    }
    return TakeFree(free, slot);
  };
  for (int i = 0; i < num_layers_; ++i) {
    const v1::DeviceLayerWrites& w = r.layers(i);
    Layer& l = held->layers[i];
    for (int j = 0; j < w.sink_slots_size(); ++j) {
      const size_t chunk = static_cast<size_t>(sink_chunk0 + j);
      if (chunk > l.sink.size()) return Mismatch("a sink page past the held ones");
      const bool have = chunk < l.sink.size();
      if (!place(&free_bf16_, w.sink_slots(j), have ? &l.sink[chunk] : nullptr)) {
        return Mismatch("a sink slot that is not free");
      }
      if (!have) l.sink.push_back(w.sink_slots(j));
    }
    for (int j = 0; j < w.history_slots_size(); ++j) {
      const size_t index = static_cast<size_t>(k.block_start + j);
      if (index > l.history.size()) return Mismatch("a history block past the held ones");
      const bool have = index < l.history.size();
      if (!place(&free_history_, w.history_slots(j), have ? &l.history[index] : nullptr)) {
        return Mismatch("a history slot that is not free");
      }
      if (!have) l.history.push_back(w.history_slots(j));
      ++stats->history_blocks;
    }
    for (int64_t chunk = held->recent_chunk0; !l.recent.empty() && chunk < k.chunk_begin; ++chunk) {
      free_bf16_.push_back(l.recent.front());
      l.recent.pop_front();
    }
    while (static_cast<int64_t>(l.recent.size()) > k.chunk_end - k.chunk_begin) {
      free_bf16_.push_back(l.recent.back());
      l.recent.pop_back();
    }
    for (int j = 0; j < w.recent_slots_size(); ++j) {
      const int64_t index = recent_chunk0 + j - k.chunk_begin;
      if (index < 0 || index > static_cast<int64_t>(l.recent.size())) {
        return Mismatch("a recent page outside the window");
      }
      const bool have = index < static_cast<int64_t>(l.recent.size());
      if (!place(&free_bf16_, w.recent_slots(j), have ? &l.recent[index] : nullptr)) {
        return Mismatch("a recent slot that is not free");
      }
      if (!have) l.recent.push_back(w.recent_slots(j));
    }
    if (static_cast<int64_t>(l.sink.size()) != CeilDiv(sink, bt) ||
        static_cast<int64_t>(l.history.size()) != CeilDiv(h.history_tokens(), bt) ||
        static_cast<int64_t>(l.recent.size()) != k.chunk_end - k.chunk_begin) {
      return Mismatch("the written slots do not cover the tiers");
    }
    stats->rows += (sink - h.sink_token_start()) + (total - k.recent_start);
  }
  held->recent_chunk0 = k.chunk_begin;
  stats->bytes = r.bytes_copied();
  SetCursor(h, held);
  return absl::OkStatus();
}

absl::Status KvMirror::WriteRows(const std::string& k, const std::string& v, int64_t first,
                                 int64_t count, const std::deque<int32_t>& pages, int64_t chunk0) {
  const BlockLayout& l = bf16_layout_;
  const size_t head_row = l.code_bytes_per_row();
  const size_t row = head_row * l.kv_heads;
  if (k.size() != static_cast<size_t>(count) * row || v.size() != k.size()) {
    return absl::InternalError("rows of an unexpected size");
  }
  std::vector<uint8_t> scratch(static_cast<size_t>(l.tokens) * head_row);
  for (int64_t p = first; p < first + count;) {
    const int64_t page = p / l.tokens - chunk0;
    const int slot = static_cast<int>(p % l.tokens);
    const int take = static_cast<int>(std::min<int64_t>(l.tokens - slot, first + count - p));
    if (page < 0 || page >= static_cast<int64_t>(pages.size())) {
      return absl::InternalError("a row outside the mirror's pages");
    }
    uint8_t* dst = bf16_pool_.Block(pages[page]);
    for (int head = 0; head < l.kv_heads; ++head) {
      for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
        const std::string& src = t == KvTensor::kKey ? k : v;
        for (int r = 0; r < take; ++r) {
          std::memcpy(scratch.data() + r * head_row,
                      src.data() + static_cast<size_t>(p - first + r) * row + head * head_row,
                      head_row);
        }
        KVPOOL_RETURN_IF_ERROR(
            Write(dst + l.CodesOffset(t, head) + slot * head_row, scratch.data(), take * head_row));
      }
    }
    p += take;
  }
  return absl::OkStatus();
}

absl::Status KvMirror::Write(uint8_t* dst, const uint8_t* src, size_t n) {
  if (!arena_.write) {
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }
  return arena_.write(dst, src, n);
}

void KvMirror::Free(HeldSequence* held) {
  for (Layer& l : held->layers) {
    free_bf16_.insert(free_bf16_.end(), l.sink.begin(), l.sink.end());
    free_bf16_.insert(free_bf16_.end(), l.recent.begin(), l.recent.end());
    free_history_.insert(free_history_.end(), l.history.begin(), l.history.end());
  }
  held->layers.clear();
}

absl::Status KvMirror::Drop(const std::string& sequence_id) {
  auto it = held_.find(sequence_id);
  if (it == held_.end()) {
    return absl::NotFoundError(absl::StrCat("the mirror holds no sequence ", sequence_id));
  }
  Free(&it->second);
  held_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PagedKvTables>> KvMirror::Tables(
    int layer, absl::Span<const std::string> sequence_ids, int rows) const {
  if (layer < 0 || layer >= num_layers_) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  const int bt = history_layout_.tokens;
  std::vector<std::vector<int32_t>> ids;  // the deques' contents, alive while tables are built
  ids.reserve(3 * sequence_ids.size());
  std::vector<PagedKvTables::Sequence> seqs;
  for (const std::string& id : sequence_ids) {
    auto it = held_.find(id);
    if (it == held_.end()) {
      return absl::NotFoundError(absl::StrCat("the mirror holds no sequence ", id));
    }
    const v1::ReadBlocksCursor& c = it->second.cursor;
    const Layer& l = it->second.layers[layer];
    ids.emplace_back(l.sink.begin(), l.sink.end());
    const auto& sink = ids.back();
    const auto& history = l.history;
    ids.emplace_back(l.recent.begin(), l.recent.end());
    const auto& recent = ids.back();
    PagedKvTables::Sequence s;
    s.sink = {sink, 0, static_cast<int32_t>(c.sink_tokens())};
    s.history = {history, 0, static_cast<int32_t>(c.history_tokens())};
    s.recent = {recent, static_cast<int32_t>((c.sink_tokens() + c.history_tokens()) % bt),
                static_cast<int32_t>(c.recent_tokens())};
    s.rows = rows;
    seqs.push_back(s);
  }
  return std::make_unique<PagedKvTables>(history_pool_, bf16_pool_, seqs);
}

absl::StatusOr<LayerBlocks> KvMirror::Gather(const std::string& sequence_id, int layer) const {
  if (arena_.write && !arena_.read) {
    return absl::FailedPreconditionError("the mirror's arena cannot be read back");
  }
  auto it = held_.find(sequence_id);
  if (it == held_.end()) {
    return absl::NotFoundError(absl::StrCat("the mirror holds no sequence ", sequence_id));
  }
  if (layer < 0 || layer >= num_layers_) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  // The arena as host memory: itself, or a copy read back from the caller's.
  PagedKvView history_pool = history_pool_, bf16_pool = bf16_pool_;
  std::vector<uint8_t> copy;
  if (arena_.write) {
    copy.resize(arena_.bytes);
    KVPOOL_RETURN_IF_ERROR(arena_.read(copy.data(), arena_.base, arena_.bytes));
    history_pool.pool = copy.data();
    bf16_pool.pool = copy.data() + (bf16_pool_.pool - arena_.base);
  }
  const v1::ReadBlocksCursor& c = it->second.cursor;
  const Layer& l = it->second.layers[layer];
  const BlockLayout& bl = bf16_layout_;
  const int64_t bt = bl.tokens;
  const size_t head_row = bl.code_bytes_per_row();
  LayerBlocks out;
  out.layer = layer;
  // Rows [first, first + count) from pages whose entry i is chunk chunk0 + i.
  auto rows = [&](int64_t first, int64_t count, const std::deque<int32_t>& pages, int64_t chunk0,
                  std::string* k, std::string* v) {
    k->resize(static_cast<size_t>(count) * bl.kv_heads * head_row);
    v->resize(k->size());
    for (int64_t p = first; p < first + count; ++p) {
      const uint8_t* page = bf16_pool.Block(pages[p / bt - chunk0]);
      for (int head = 0; head < bl.kv_heads; ++head) {
        const size_t at = (static_cast<size_t>(p - first) * bl.kv_heads + head) * head_row;
        const size_t in = (p % bt) * head_row;
        std::memcpy(k->data() + at, page + bl.CodesOffset(KvTensor::kKey, head) + in, head_row);
        std::memcpy(v->data() + at, page + bl.CodesOffset(KvTensor::kValue, head) + in, head_row);
      }
    }
  };
  rows(0, c.sink_tokens(), l.sink, 0, &out.sink_k, &out.sink_v);
  const int64_t window = int64_t{c.sink_tokens()} + c.history_tokens();
  rows(window, c.recent_tokens(), l.recent, it->second.recent_chunk0, &out.recent_k, &out.recent_v);
  const size_t block_bytes = history_layout_.block_bytes();
  for (size_t b = 0; b < l.history.size(); ++b) {
    v1::KvBlock block;
    block.set_layer(layer);
    block.set_block_index(static_cast<uint32_t>(b));
    block.set_valid_tokens(static_cast<uint32_t>(
        std::min<int64_t>(bt, int64_t{c.history_tokens()} - static_cast<int64_t>(b) * bt)));
    block.set_data(reinterpret_cast<const char*>(history_pool.Block(l.history[b])), block_bytes);
    out.blocks.push_back(std::move(block));
  }
  return out;
}

}  // namespace kvpool::client
