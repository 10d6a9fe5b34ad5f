// The soak client's hostile requests: wrong shapes, NaN/Inf, unknown and malformed ids, oversize
// payloads, wrong states, tiny deadlines, streams abandoned midway. Each must get its documented
// status and leave the sequence it targeted as it was.
#include <cstring>
#include <functional>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "tests/soak/soak_client.h"
#include "tests/soak/soak_util.h"
#include "tests/support/api_requests.h"

namespace kvpool::soak {

using absl::StatusCode;
using testing::AppendChunkMessage;
using testing::AppendHeaderMessage;

absl::Status SoakClient::CheckUnchanged(const LiveSequence& s, absl::string_view what) {
  absl::StatusOr<v1::SequenceInfo> info = client_->DescribeSequence(s.id);
  KVPOOL_RETURN_IF_ERROR(Expect("DescribeSequence", info.status(), {StatusCode::kOk}, s.id));
  return CheckAppended(s, *info, 0, absl::StrCat("after ", what, ":"));
}

absl::Status SoakClient::Hostile() {
  const int kind = Uniform(0, 13);
  LiveSequence* any = PickAnySequence();
  switch (kind) {
    case 0:
    case 1:
    case 2:
    case 3:
      return HostileAppend(any != nullptr && Chance(0.7) ? *any : probe_, Uniform(0, 15));
    case 4:
      return HostileUnknownIds();
    case 5:
      return HostileLimits();
    case 6:
      return HostileRegister();
    case 7:
    case 8:
      return TinyDeadline();
    case 9:
      return AbandonStream(any != nullptr && Chance(0.5) ? *any : probe_);
    case 10:
      return Expect("bad:CreateSequence(duplicate)",
                    client_->CreateSequence(probe_.model->id(), probe_.id).status(),
                    {StatusCode::kAlreadyExists}, probe_.id);
    case 11:
      return HostileRead(any != nullptr ? *any : probe_);
    default:
      return HostileAttend();
  }
}

absl::Status SoakClient::SendAppend(const std::vector<v1::AppendKvRequest>& messages,
                                    bool half_close) {
  auto context = client_->NewContext();
  v1::AppendKvResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendKvRequest>> writer =
      client_->sequences()->AppendKv(context.get(), &response);
  for (const v1::AppendKvRequest& m : messages) {
    if (!writer->Write(m)) break;
  }
  if (half_close) {
    writer->WritesDone();
  } else {
    context->TryCancel();
  }
  return Answer(writer->Finish(), "AppendKv");
}

absl::Status SoakClient::HostileAppend(LiveSequence& s, int kind) {
  const SoakShape& shape = s.model->shape;
  const uint32_t start = s.length();
  const uint32_t n = Uniform(1, 4);
  const std::vector<uint32_t> ids = RandomIds(n);
  std::vector<LayerRows> rows;
  for (int l = 0; l < shape.num_layers; ++l) rows.push_back(ExpectedRows(shape, l, start, ids));
  std::string what = absl::StrCat(s.id, " (",
                                  s.state == State::kPrefill  ? "prefill"
                                  : s.state == State::kDecode ? "decode"
                                                              : "sealed",
                                  ")");

  // A decode request for this sequence, every layer, valid unless altered.
  auto decode = [&] {
    v1::AppendDecodeRequest d;
    d.set_sequence_id(s.id);
    d.set_token_start(start);
    d.set_num_tokens(n);
    d.set_dtype(v1::DTYPE_BF16);
    for (const LayerRows& r : rows) {
      d.mutable_k()->append(r.k_bytes().data(), r.k_bytes().size());
      d.mutable_v()->append(r.v_bytes().data(), r.v_bytes().size());
    }
    return d;
  };
  // A prefill stream for this sequence, every layer in one chunk, valid unless altered.
  auto prefill = [&] {
    std::vector<v1::AppendKvRequest> m{AppendHeaderMessage(s.id, start, n, v1::DTYPE_BF16, false)};
    for (int l = 0; l < shape.num_layers; ++l) {
      m.push_back(AppendChunkMessage(l, 0, n, std::string(rows[l].k_bytes()),
                                     std::string(rows[l].v_bytes())));
    }
    return m;
  };
  // Retries ABORTED (a previously abandoned append may still hold the sequence).
  auto attempt = [&](absl::string_view op, const std::function<absl::Status()>& call,
                     std::initializer_list<StatusCode> allowed) -> absl::Status {
    KVPOOL_RETURN_IF_ERROR(Expect(op, RetryAborted(op, call), allowed, what));
    return CheckUnchanged(s, op);
  };
  constexpr auto kInvalid = StatusCode::kInvalidArgument;
  constexpr auto kState = StatusCode::kFailedPrecondition;

  // Valid payloads in the wrong state.
  if (s.state == State::kSealed) {
    if (Chance(0.5)) {
      return attempt("bad:AppendDecode(sealed)",
                     [&] { return client_->AppendDecode(decode()).status(); }, {kState});
    }
    return attempt("bad:AppendKv(sealed)", [&] { return SendAppend(prefill(), true); }, {kState});
  }
  if (kind == 0) {
    if (s.state == State::kPrefill) {
      return attempt("bad:AppendDecode(prefill)",
                     [&] { return client_->AppendDecode(decode()).status(); }, {kState});
    }
    return attempt("bad:AppendKv(after prefill)", [&] { return SendAppend(prefill(), true); },
                   {kState});
  }
  if (kind == 1) {  // token_start not the length: a retried or duplicated append
    const uint32_t wrong = start > 0 && Chance(0.5) ? start - 1 : start + 1;
    if (s.state == State::kDecode) {
      return attempt("bad:AppendDecode(token_start)",
                     [&] {
                       v1::AppendDecodeRequest d = decode();
                       d.set_token_start(wrong);
                       return client_->AppendDecode(d).status();
                     },
                     {kState});
    }
    return attempt("bad:AppendKv(token_start)",
                   [&] {
                     std::vector<v1::AppendKvRequest> m = prefill();
                     m[0].mutable_header()->set_token_start(wrong);
                     return SendAppend(m, true);
                   },
                   {kState});
  }

  if (s.state == State::kDecode) {
    // Bad payloads of a decode step.
    v1::AppendDecodeRequest d = decode();
    const char* op = "bad:AppendDecode(shape)";
    switch (kind % 7) {
      case 0:
        d.mutable_k()->resize(d.k().size() - 2);
        break;
      case 1:
        op = "bad:AppendDecode(k/v sizes)";
        d.mutable_v()->append("\0\0", 2);
        break;
      case 2: {
        op = "bad:AppendDecode(NaN)";
        const uint16_t nan = 0x7fc0;
        std::memcpy(&(*d.mutable_k())[2 * Uniform(0, d.k().size() / 2 - 1)], &nan, 2);
        break;
      }
      case 3: {
        op = "bad:AppendDecode(Inf)";
        const uint16_t inf = Chance(0.5) ? 0x7f80 : 0xff80;
        std::memcpy(&(*d.mutable_v())[2 * Uniform(0, d.v().size() / 2 - 1)], &inf, 2);
        break;
      }
      case 4:
        op = "bad:AppendDecode(dtype)";
        d.set_dtype(Chance(0.5) ? v1::DTYPE_UNSPECIFIED : v1::DTYPE_FP32);
        break;
      case 5:
        op = "bad:AppendDecode(token ids)";
        for (uint32_t i = 0; i <= n; ++i) d.add_token_ids(i);
        break;
      default:
        op = "bad:AppendDecode(tokens)";
        d.set_num_tokens(Chance(0.5) ? 0 : n + 1);
        break;
    }
    return attempt(op, [&] { return client_->AppendDecode(d).status(); }, {kInvalid});
  }

  // Bad prefill streams (the sequence is in prefill).
  std::vector<v1::AppendKvRequest> m = prefill();
  const char* op = "bad:AppendKv(shape)";
  const int layer = Uniform(0, shape.num_layers - 1);
  v1::KvChunk* chunk = m[1 + layer].mutable_chunk();
  switch (kind % 10) {
    case 0:
      chunk->mutable_k()->resize(chunk->k().size() - 2);
      break;
    case 1: {
      op = "bad:AppendKv(NaN)";
      const uint16_t nan = Chance(0.5) ? 0x7fc0 : 0xffff;
      std::memcpy(&(*chunk->mutable_k())[2 * Uniform(0, chunk->k().size() / 2 - 1)], &nan, 2);
      break;
    }
    case 2: {
      op = "bad:AppendKv(Inf)";
      const uint16_t inf = 0x7f80;
      std::memcpy(&(*chunk->mutable_v())[2 * Uniform(0, chunk->v().size() / 2 - 1)], &inf, 2);
      break;
    }
    case 3:
      op = "bad:AppendKv(missing layer)";
      m.erase(m.begin() + 1 + layer);
      break;
    case 4:
      op = "bad:AppendKv(layer)";
      chunk->set_layer(Chance(0.5) ? -1 : shape.num_layers);
      break;
    case 5:
      op = "bad:AppendKv(gap)";
      chunk->set_token_offset(1);
      break;
    case 6:
      op = "bad:AppendKv(no header)";
      m.erase(m.begin());
      break;
    case 7:
      op = "bad:AppendKv(second header)";
      m.push_back(m[0]);
      break;
    case 8:
      op = "bad:AppendKv(token ids)";
      // One id too few, or (for a single token) one too many.
      for (uint32_t i = 0; i < (n == 1 ? 2 : n - 1); ++i) m[0].mutable_header()->add_token_ids(i);
      break;
    default:
      op = "bad:AppendKv(tokens)";
      m[0].mutable_header()->set_num_tokens(Chance(0.5) ? 0 : n + 1);
      break;
  }
  return attempt(op, [&] { return SendAppend(m, true); }, {kInvalid});
}

absl::Status SoakClient::HostileUnknownIds() {
  const std::string unknown = NewId("nx");
  const std::string& model = run_->shared_models()[0].id();
  constexpr auto kNotFound = StatusCode::kNotFound;
  switch (Uniform(0, 10)) {
    case 0:
      return Expect("bad:DescribeSequence(unknown)", client_->DescribeSequence(unknown).status(),
                    {kNotFound}, unknown);
    case 1:
      return Expect("bad:ReleaseSequence(unknown)", client_->ReleaseSequence(unknown).status(),
                    {kNotFound}, unknown);
    case 2:
      return Expect("bad:SealSequence(unknown)", client_->SealSequence(unknown).status(),
                    {kNotFound}, unknown);
    case 3: {
      v1::ReadKvRequest r;
      r.set_sequence_id(unknown);
      return Expect("bad:ReadKv(unknown)", client_->ReadKv(r).status(), {kNotFound}, unknown);
    }
    case 4: {
      v1::ReadBlocksRequest r;
      r.set_sequence_id(unknown);
      return Expect("bad:ReadBlocks(unknown)", client_->ReadBlocks(r).status(), {kNotFound},
                    unknown);
    }
    case 5: {
      v1::AttendRequest r;
      r.set_model_id(model);
      v1::SequenceQuery* q = r.add_queries();
      q->set_sequence_id(unknown);
      q->set_q(Bytes(QueryValues(run_->shared_models()[0].shape.query_values(), 1)));
      report_.counters.attend_sent++;
      report_.counters.attend_sequences_sent++;
      return Expect("bad:Attend(unknown sequence)", client_->Attend(r).status(), {kNotFound},
                    unknown);
    }
    case 6:
      return Expect("bad:CreateSequence(unknown model)",
                    client_->CreateSequence(unknown, NewId("x")).status(), {kNotFound}, unknown);
    case 7:
      return Expect("bad:LookupPrefix(unknown model)",
                    client_->LookupPrefix(unknown, SharedPrompt(0, 32)).status(), {kNotFound},
                    unknown);
    case 8:
      return Expect("bad:DeleteModel(unknown)", client_->DeleteModel(unknown, true).status(),
                    {kNotFound}, unknown);
    case 9: {
      v1::AppendDecodeRequest d;
      d.set_sequence_id(unknown);
      d.set_num_tokens(1);
      d.set_dtype(v1::DTYPE_BF16);
      const SoakShape& shape = run_->shared_models()[0].shape;
      const LayerRows rows = ExpectedRows(shape, 0, 0, {7});
      for (int l = 0; l < shape.num_layers; ++l) {
        d.mutable_k()->append(rows.k_bytes().data(), rows.k_bytes().size());
        d.mutable_v()->append(rows.v_bytes().data(), rows.v_bytes().size());
      }
      return Expect("bad:AppendDecode(unknown)", client_->AppendDecode(d).status(), {kNotFound},
                    unknown);
    }
    default: {
      // Ids that are not ids: bad characters, too long, empty where one is required.
      static const char* const kBad[] = {"has space", "new\nline", "semi;colon", "\xc3\xbcml"};
      std::string bad = Chance(0.3) ? std::string(Uniform(129, 4096), 'a') : kBad[Uniform(0, 3)];
      KVPOOL_RETURN_IF_ERROR(Expect("bad:CreateSequence(id)",
                                    client_->CreateSequence(model, bad).status(),
                                    {StatusCode::kInvalidArgument}, "a malformed id"));
      return Expect("bad:DescribeSequence(id)", client_->DescribeSequence(bad).status(),
                    {StatusCode::kInvalidArgument, kNotFound}, "a malformed id");
    }
  }
}

absl::Status SoakClient::HostileLimits() {
  const v1::ServerLimits& limits = run_->limits();
  const SoakModel& model = *probe_.model;
  const SoakShape& shape = model.shape;
  const size_t row_bytes = shape.row_values() * sizeof(Bf16);
  constexpr auto kInvalid = StatusCode::kInvalidArgument;
  // Oversize payloads are only sent where the limits are small enough to make them cheap.
  constexpr uint64_t kCheapBytes = 4 << 20;
  switch (Uniform(0, 6)) {
    case 0: {  // more tokens than one append may carry
      std::vector<v1::AppendKvRequest> m{
          AppendHeaderMessage(probe_.id, 0, limits.max_append_tokens() + 1, v1::DTYPE_BF16, false)};
      KVPOOL_RETURN_IF_ERROR(
          Expect("bad:AppendKv(too many tokens)", SendAppend(m, true), {kInvalid}, probe_.id));
      return CheckUnchanged(probe_, "an oversize append");
    }
    case 1: {  // a chunk over max_chunk_bytes
      if (limits.max_chunk_bytes() > kCheapBytes ||
          2 * limits.max_chunk_bytes() + 4096 > limits.max_message_bytes()) {
        return absl::OkStatus();
      }
      const uint32_t n = limits.max_chunk_bytes() / row_bytes + 1;
      if (n > limits.max_append_tokens()) return absl::OkStatus();
      std::vector<v1::AppendKvRequest> m{
          AppendHeaderMessage(probe_.id, 0, n, v1::DTYPE_BF16, false),
          AppendChunkMessage(0, 0, n, std::string(n * row_bytes, '\0'),
                             std::string(n * row_bytes, '\0'))};
      KVPOOL_RETURN_IF_ERROR(
          Expect("bad:AppendKv(chunk size)", SendAppend(m, true), {kInvalid}, probe_.id));
      return CheckUnchanged(probe_, "an oversize chunk");
    }
    case 2: {  // a message over max_message_bytes: gRPC refuses it before kvpoold parses it
      if (limits.max_message_bytes() > kCheapBytes) return absl::OkStatus();
      v1::AppendDecodeRequest d;
      d.set_sequence_id(probe_.id);
      d.set_num_tokens(1);
      d.set_dtype(v1::DTYPE_BF16);
      d.set_k(std::string(limits.max_message_bytes() + 1, '\0'));
      KVPOOL_RETURN_IF_ERROR(Expect("bad:AppendDecode(message size)",
                                    client_->AppendDecode(d).status(),
                                    {StatusCode::kResourceExhausted}, probe_.id));
      return CheckUnchanged(probe_, "an oversize message");
    }
    case 3: {  // a batch over max_attention_batch
      if (limits.max_attention_batch() > 64) return absl::OkStatus();
      v1::AttendRequest r;
      r.set_model_id(model.id());
      const std::string q = Bytes(QueryValues(shape.query_values(), 3));
      for (uint32_t i = 0; i <= limits.max_attention_batch(); ++i) {
        v1::SequenceQuery* sq = r.add_queries();
        sq->set_sequence_id(probe_.id);
        sq->set_q(q);
      }
      report_.counters.attend_sent++;
      report_.counters.attend_sequences_sent += r.queries_size();
      return Expect("bad:Attend(batch size)", client_->Attend(r).status(), {kInvalid}, model.id());
    }
    case 4: {  // more queries per sequence than allowed
      v1::AttendRequest r;
      r.set_model_id(model.id());
      v1::SequenceQuery* sq = r.add_queries();
      sq->set_sequence_id(probe_.id);
      sq->set_num_queries(Chance(0.5) ? 1025 : 0xffffffffu);
      report_.counters.attend_sent++;
      report_.counters.attend_sequences_sent++;
      return Expect("bad:Attend(num_queries)", client_->Attend(r).status(), {kInvalid}, model.id());
    }
    case 5: {  // token counts whose byte sizes overflow 32 bits
      LiveSequence* s = PickSequence(State::kDecode);
      if (s == nullptr) return absl::OkStatus();
      v1::AppendDecodeRequest d;
      d.set_sequence_id(s->id);
      d.set_token_start(s->length());
      d.set_num_tokens(Chance(0.5) ? 0x80000000u : 0xffffffffu);
      d.set_dtype(v1::DTYPE_BF16);
      d.set_k(std::string(row_bytes, '\0'));
      d.set_v(std::string(row_bytes, '\0'));
      KVPOOL_RETURN_IF_ERROR(Expect("bad:AppendDecode(huge num_tokens)",
                                    client_->AppendDecode(d).status(), {kInvalid}, s->id));
      return CheckUnchanged(*s, "a huge num_tokens");
    }
    default: {  // a read range past the end, with an overflowing end
      LiveSequence* s = PickAnySequence();
      if (s == nullptr) return absl::OkStatus();
      v1::ReadKvRequest r;
      r.set_sequence_id(s->id);
      r.set_token_start(Chance(0.5) ? s->length() + 1 : 1);
      r.set_num_tokens(Chance(0.5) ? 0xffffffffu : s->length());
      return Expect("bad:ReadKv(range)", client_->ReadKv(r).status(), {StatusCode::kOutOfRange},
                    s->id);
    }
  }
}

absl::Status SoakClient::HostileRegister() {
  const std::string id = NewId("bad");
  SoakShape shape;
  v1::ModelSpec spec =
      SoakModelSpec(id, shape, /*exact=*/false, v1::ROTATION_KIND_HADAMARD, 1, /*bits=*/2);
  std::vector<StatusCode> expected = {StatusCode::kInvalidArgument};
  std::string op = "bad:RegisterModel(spec)";
  switch (Uniform(0, 14)) {
    case 0:
      spec.mutable_shape()->set_head_dim(48);
      break;
    case 1:
      spec.mutable_shape()->set_head_dim(Chance(0.5) ? 512 : 16);
      break;
    case 2:
      spec.mutable_shape()->set_q_heads(3);
      break;
    case 3:
      spec.mutable_shape()->set_kv_heads(0);
      break;
    case 4:
      spec.mutable_shape()->set_num_layers(Chance(0.5) ? 0 : -3);
      break;
    case 5:
      spec.mutable_quant()->set_block_tokens(12);
      break;
    case 6:
      spec.mutable_quant()->set_sink_tokens(7);
      break;
    case 7:
      spec.mutable_quant()->set_demotion_batch(5);
      break;
    case 8:
      spec.mutable_quant()->set_bits(3);
      break;
    case 9:
      spec.mutable_quant()->set_group_size(7);
      break;
    case 10:
      spec.mutable_data_free()->set_kind(Chance(0.5) ? v1::ROTATION_KIND_DENSE
                                                     : v1::ROTATION_KIND_UNSPECIFIED);
      break;
    case 11:
      spec.set_model_id(Chance(0.5) ? "" : "bad id");
      break;
    case 12: {  // a server path outside any model directory
      op = "bad:RegisterModel(server path)";
      spec.set_server_path(Chance(0.5) ? "../../../etc/passwd" : "/etc/passwd");
      spec.clear_quant();
      expected = {StatusCode::kFailedPrecondition, StatusCode::kPermissionDenied,
                  StatusCode::kNotFound};
      break;
    }
    default: {  // an uploaded "rotation file" of garbage, or shorter than announced
      op = "bad:RegisterModel(upload)";
      spec.clear_quant();
      std::string garbage(Uniform(8, 512), '\0');
      for (char& c : garbage) c = static_cast<char>(Uniform(0, 255));
      const bool short_upload = Chance(0.3);
      spec.set_upload_size(garbage.size() + (short_upload ? 100 : 0));
      auto context = client_->NewContext();
      v1::RegisterModelResponse response;
      auto writer = client_->models()->RegisterModel(context.get(), &response);
      v1::RegisterModelRequest first;
      *first.mutable_spec() = spec;
      if (writer->Write(first)) {
        v1::RegisterModelRequest chunk;
        chunk.set_rotation_file_chunk(garbage);
        writer->Write(chunk);
      }
      writer->WritesDone();
      KVPOOL_RETURN_IF_ERROR(Expect(op, Answer(writer->Finish(), "RegisterModel"), expected, id));
      return Expect("DescribeModel", client_->DescribeModel(id, false).status(),
                    {StatusCode::kNotFound}, absl::StrCat(id, " after a failed register"));
    }
  }
  KVPOOL_RETURN_IF_ERROR(Expect(op, client_->RegisterModel(spec).status(), expected, id));
  if (spec.model_id() != id) return absl::OkStatus();
  return Expect("DescribeModel", client_->DescribeModel(id, false).status(),
                {StatusCode::kNotFound}, absl::StrCat(id, " after a failed register"));
}

absl::Status SoakClient::HostileRead(LiveSequence& s) {
  const int layers = s.model->shape.num_layers;
  constexpr auto kInvalid = StatusCode::kInvalidArgument;
  switch (Uniform(0, 3)) {
    case 0: {
      v1::ReadKvRequest r;
      r.set_sequence_id(s.id);
      r.add_layers(Chance(0.5) ? layers : -1);
      return Expect("bad:ReadKv(layer)", client_->ReadKv(r).status(), {kInvalid}, s.id);
    }
    case 1: {
      v1::ReadKvRequest r;
      r.set_sequence_id(s.id);
      r.set_dtype(v1::DTYPE_FP16);
      return Expect("bad:ReadKv(dtype)", client_->ReadKv(r).status(), {kInvalid}, s.id);
    }
    case 2: {
      v1::ReadBlocksRequest r;
      r.set_sequence_id(s.id);
      r.add_layers(Chance(0.5) ? layers : std::numeric_limits<int32_t>::min());
      return Expect("bad:ReadBlocks(layer)", client_->ReadBlocks(r).status(), {kInvalid}, s.id);
    }
    default: {
      v1::ReadKvRequest r;
      r.set_sequence_id(s.id);
      r.set_token_start(s.length() + Uniform(1, 1000));
      return Expect("bad:ReadKv(past end)", client_->ReadKv(r).status(), {StatusCode::kOutOfRange},
                    s.id);
    }
  }
}

absl::Status SoakClient::HostileAttend() {
  LiveSequence* s = PickAnySequence();
  if (s == nullptr) return absl::OkStatus();
  const SoakShape& shape = s->model->shape;
  v1::AttendRequest r;
  r.set_model_id(s->model->id());
  r.set_dtype(v1::DTYPE_FP32);
  v1::SequenceQuery* q = r.add_queries();
  q->set_sequence_id(s->id);
  std::vector<float> values = QueryValues(shape.query_values(), 5);
  const char* op = "bad:Attend(q size)";
  switch (Uniform(0, 5)) {
    case 0:
      values.pop_back();
      break;
    case 1:
      op = "bad:Attend(NaN)";
      values[Uniform(0, static_cast<int>(values.size()) - 1)] =
          Chance(0.5) ? std::numeric_limits<float>::quiet_NaN()
                      : -std::numeric_limits<float>::infinity();
      break;
    case 2:
      op = "bad:Attend(layer)";
      r.set_layer(Chance(0.5) ? shape.num_layers : -1);
      break;
    case 3:
      op = "bad:Attend(dtype)";
      r.set_dtype(v1::DTYPE_FP16);  // FP32-sized q
      break;
    case 4: {
      op = "bad:Attend(model mismatch)";
      const std::vector<SoakModel>& models = run_->shared_models();
      for (const SoakModel& m : models) {
        if (&m != s->model && m.shape.query_values() == shape.query_values()) {
          r.set_model_id(m.id());
        }
      }
      if (r.model_id() == s->model->id()) return absl::OkStatus();
      break;
    }
    default:
      op = "bad:Attend(empty batch)";
      r.clear_queries();
      break;
  }
  if (r.queries_size() > 0) r.mutable_queries(0)->set_q(Bytes(values));
  report_.counters.attend_sent++;
  report_.counters.attend_sequences_sent += r.queries_size();
  return Expect(op, client_->Attend(r).status(), {StatusCode::kInvalidArgument}, s->id);
}

absl::Status SoakClient::TinyDeadline() {
  // 0 to 3 ms: some calls never start, some are cut midway, some finish.
  const absl::Duration timeout = absl::Microseconds(Uniform(0, 3000));
  std::initializer_list<StatusCode> allowed = {StatusCode::kOk, StatusCode::kDeadlineExceeded,
                                               StatusCode::kResourceExhausted};
  LiveSequence* s = PickAnySequence();
  if (s == nullptr) return absl::OkStatus();
  const SoakShape& shape = s->model->shape;
  const int kind = Uniform(0, 4);
  if (kind == 0) {
    v1::AttendRequest r;
    r.set_model_id(s->model->id());
    v1::SequenceQuery* q = r.add_queries();
    q->set_sequence_id(s->id);
    q->set_q(Bytes(QueryValues(shape.query_values(), 9)));
    v1::AttendResponse response;
    auto context = ContextWithDeadline(timeout);
    report_.counters.attend_sent++;
    report_.counters.attend_sequences_sent++;
    const absl::Status got =
        Answer(client_->attention()->Attend(context.get(), r, &response), "Attend");
    if (got.ok()) {
      report_.counters.attend_ok++;
      report_.counters.attend_sequences_ok++;
    }
    return Expect("hasty:Attend", got, allowed, s->id);
  }
  if (kind == 1) {
    v1::ReadKvRequest r;
    r.set_sequence_id(s->id);
    auto context = ContextWithDeadline(timeout);
    auto reader = client_->reads()->ReadKv(context.get(), r);
    v1::ReadKvResponse message;
    while (reader->Read(&message)) {
    }
    return Expect("hasty:ReadKv", Answer(reader->Finish(), "ReadKv"), allowed, s->id);
  }
  if (kind == 2) {
    v1::ReadBlocksRequest r;
    r.set_sequence_id(s->id);
    auto context = ContextWithDeadline(timeout);
    auto reader = client_->reads()->ReadBlocks(context.get(), r);
    v1::ReadBlocksResponse message;
    while (reader->Read(&message)) {
    }
    return Expect("hasty:ReadBlocks", Answer(reader->Finish(), "ReadBlocks"), allowed, s->id);
  }
  // An append cut by its deadline may or may not have been committed: the sequence is released
  // (its state is no longer known) and its tokens count as uncertain.
  const uint32_t start = s->length();
  const uint32_t n = Uniform(1, 3);
  const std::vector<uint32_t> ids = RandomIds(n);
  absl::Status got;
  const char* op = nullptr;
  if (s->state == State::kDecode) {
    op = "hasty:AppendDecode";
    v1::AppendDecodeRequest d;
    d.set_sequence_id(s->id);
    d.set_token_start(start);
    d.set_num_tokens(n);
    d.set_dtype(v1::DTYPE_BF16);
    d.mutable_token_ids()->Add(ids.begin(), ids.end());
    for (int l = 0; l < shape.num_layers; ++l) {
      const LayerRows rows = ExpectedRows(shape, l, start, ids);
      d.mutable_k()->append(rows.k_bytes().data(), rows.k_bytes().size());
      d.mutable_v()->append(rows.v_bytes().data(), rows.v_bytes().size());
    }
    v1::AppendDecodeResponse response;
    auto context = ContextWithDeadline(timeout);
    got = Answer(client_->sequences()->AppendDecode(context.get(), d, &response), "AppendDecode");
  } else if (s->state == State::kPrefill) {
    op = "hasty:AppendKv";
    auto context = ContextWithDeadline(timeout);
    v1::AppendKvResponse response;
    auto writer = client_->sequences()->AppendKv(context.get(), &response);
    v1::AppendKvRequest header = AppendHeaderMessage(s->id, start, n, v1::DTYPE_BF16, false);
    header.mutable_header()->mutable_token_ids()->Add(ids.begin(), ids.end());
    bool open = writer->Write(header);
    for (int l = 0; open && l < shape.num_layers; ++l) {
      const LayerRows rows = ExpectedRows(shape, l, start, ids);
      open = writer->Write(
          AppendChunkMessage(l, 0, n, std::string(rows.k_bytes()), std::string(rows.v_bytes())));
    }
    writer->WritesDone();
    got = Answer(writer->Finish(), "AppendKv");
  } else {
    return absl::OkStatus();
  }
  KVPOOL_RETURN_IF_ERROR(Expect(op, got,
                                {StatusCode::kOk, StatusCode::kDeadlineExceeded,
                                 StatusCode::kResourceExhausted, StatusCode::kAborted},
                                s->id));
  if (got.ok()) {
    s->token_ids.insert(s->token_ids.end(), ids.begin(), ids.end());
    report_.counters.tokens_committed += n;
    return DescribeAndCheck(*s);
  }
  if (got.code() == StatusCode::kDeadlineExceeded) {
    report_.counters.tokens_uncertain += n;
    for (size_t i = 0; i < live_.size(); ++i) {
      if (&live_[i] == s) return Release(i);
    }
  }
  return CheckUnchanged(*s, op);  // refused outright: nothing changed
}

absl::Status SoakClient::AbandonStream(LiveSequence& s) {
  const SoakShape& shape = s.model->shape;
  const int kind = Uniform(0, 5);
  if (kind >= 4 && s.state == State::kPrefill && &s != &probe_)
    return InterruptAppend(s, kind == 4);
  switch (kind % 4) {
    case 0: {  // an append stream dropped midway: the daemon rolls it back
      if (s.state != State::kPrefill) return absl::OkStatus();
      const uint32_t start = s.length();
      const uint32_t n = Uniform(1, 40);
      const std::vector<uint32_t> ids = RandomIds(n);
      v1::AppendKvHeader header;
      header.set_sequence_id(s.id);
      header.set_token_start(start);
      header.set_num_tokens(n);
      header.set_dtype(v1::DTYPE_BF16);
      absl::StatusOr<std::unique_ptr<client::AppendStream>> stream = client_->OpenAppend(header);
      if (!stream.ok()) {  // only the stream's creation; the server answers later
        return Expect("abandoned:AppendKv", stream.status(), {}, s.id);
      }
      const int layers = Uniform(0, shape.num_layers - 1);
      for (int l = 0; l < layers; ++l) {
        const LayerRows rows = ExpectedRows(shape, l, start, ids);
        if (!(*stream)->WriteLayer(l, 0, n, rows.k_bytes(), rows.v_bytes()).ok()) break;
      }
      if (Chance(0.5)) {
        (*stream)->Cancel();
        KVPOOL_RETURN_IF_ERROR(Expect("abandoned:AppendKv", (*stream)->Finish().status(),
                                      {StatusCode::kCancelled, StatusCode::kAborted}, s.id));
      } else {
        stream->reset();  // destroying an open stream cancels it
        report_.Record("abandoned:AppendKv", absl::CancelledError());
      }
      return CheckUnchanged(s, "an abandoned append");
    }
    case 1: {  // a read stream cancelled after its first message
      if (s.length() == 0) return absl::OkStatus();
      v1::ReadKvRequest r;
      r.set_sequence_id(s.id);
      auto context = client_->NewContext();
      auto reader = client_->reads()->ReadKv(context.get(), r);
      v1::ReadKvResponse message;
      reader->Read(&message);
      context->TryCancel();
      while (reader->Read(&message)) {
      }
      return Expect("abandoned:ReadKv", Answer(reader->Finish(), "ReadKv"),
                    {StatusCode::kOk, StatusCode::kCancelled}, s.id);
    }
    case 2: {
      if (s.length() == 0) return absl::OkStatus();
      v1::ReadBlocksRequest r;
      r.set_sequence_id(s.id);
      auto context = client_->NewContext();
      auto reader = client_->reads()->ReadBlocks(context.get(), r);
      v1::ReadBlocksResponse message;
      reader->Read(&message);
      context->TryCancel();
      while (reader->Read(&message)) {
      }
      return Expect("abandoned:ReadBlocks", Answer(reader->Finish(), "ReadBlocks"),
                    {StatusCode::kOk, StatusCode::kCancelled}, s.id);
    }
    default: {  // a rotation upload cancelled midway registers nothing
      const std::string id = NewId("up");
      v1::RegisterModelRequest first;
      first.mutable_spec()->set_model_id(id);
      first.mutable_spec()->mutable_shape()->set_q_heads(4);
      first.mutable_spec()->mutable_shape()->set_kv_heads(2);
      first.mutable_spec()->set_upload_size(4096);
      auto context = client_->NewContext();
      v1::RegisterModelResponse response;
      auto writer = client_->models()->RegisterModel(context.get(), &response);
      if (writer->Write(first)) {
        v1::RegisterModelRequest chunk;
        chunk.set_rotation_file_chunk(std::string(100, 'x'));
        writer->Write(chunk);
      }
      context->TryCancel();
      KVPOOL_RETURN_IF_ERROR(Expect("abandoned:RegisterModel",
                                    Answer(writer->Finish(), "RegisterModel"),
                                    {StatusCode::kCancelled, StatusCode::kResourceExhausted}, id));
      return Expect("DescribeModel", client_->DescribeModel(id, false).status(),
                    {StatusCode::kNotFound}, absl::StrCat(id, " after a cancelled upload"));
    }
  }
}

absl::Status SoakClient::WaitAppendIdle(const LiveSequence& s) {
  const std::vector<v1::AppendKvRequest> m{
      AppendHeaderMessage(s.id, s.length() + 1, 1, v1::DTYPE_BF16, false)};
  return Expect("bad:AppendKv(idle probe)",
                RetryAborted("bad:AppendKv(idle probe)", [&] { return SendAppend(m, true); }),
                {StatusCode::kFailedPrecondition}, s.id);
}

absl::Status SoakClient::InterruptAppend(LiveSequence& s, bool release) {
  KVPOOL_RETURN_IF_ERROR(WaitAppendIdle(s));
  const SoakShape& shape = s.model->shape;
  const uint32_t start = s.length();
  const uint32_t n = Uniform(1, 40);
  const std::vector<uint32_t> ids = RandomIds(n);
  std::vector<LayerRows> rows;
  for (int l = 0; l < shape.num_layers; ++l) rows.push_back(ExpectedRows(shape, l, start, ids));
  v1::AppendKvHeader header;
  header.set_sequence_id(s.id);
  header.set_token_start(start);
  header.set_num_tokens(n);
  header.set_dtype(v1::DTYPE_BF16);
  header.mutable_token_ids()->Add(ids.begin(), ids.end());
  absl::StatusOr<std::unique_ptr<client::AppendStream>> stream = client_->OpenAppend(header);
  if (!stream.ok()) return Expect("OpenAppend", stream.status(), {}, s.id);
  const int first = Uniform(0, shape.num_layers - 1);
  for (int l = 0; l < first; ++l) {
    if (!(*stream)->WriteLayer(l, 0, n, rows[l].k_bytes(), rows[l].v_bytes()).ok()) break;
  }
  auto write_rest = [&] {
    for (int l = first; l < shape.num_layers; ++l) {
      if (!(*stream)->WriteLayer(l, 0, n, rows[l].k_bytes(), rows[l].v_bytes()).ok()) break;
    }
  };
  if (release) {
    // Released while its append streams: the append fails with NOT_FOUND and frees its pages.
    const std::string id = s.id;
    for (size_t i = 0; i < live_.size(); ++i) {
      if (&live_[i] == &s) {
        KVPOOL_RETURN_IF_ERROR(Release(i));
        break;
      }
    }
    write_rest();
    return Expect("bad:AppendKv(released midway)", (*stream)->Finish().status(),
                  {StatusCode::kNotFound}, id);
  }
  // Sealed while its append streams: whichever the daemon saw first wins. Seal first: the
  // append is refused (FAILED_PRECONDITION); append first: the seal is (ABORTED) and the
  // append commits.
  absl::StatusOr<v1::SequenceInfo> sealed = client_->SealSequence(s.id);
  KVPOOL_RETURN_IF_ERROR(Expect("SealSequence(during append)", sealed.status(),
                                {StatusCode::kOk, StatusCode::kAborted}, s.id));
  write_rest();
  absl::StatusOr<v1::AppendKvResponse> done = (*stream)->Finish();
  if (sealed.ok()) {
    s.state = State::kSealed;
    KVPOOL_RETURN_IF_ERROR(Expect("AppendKv(sealed during it)", done.status(),
                                  {StatusCode::kFailedPrecondition}, s.id));
    return CheckUnchanged(s, "an append refused by a seal");
  }
  KVPOOL_RETURN_IF_ERROR(Expect("AppendKv(seal refused)", done.status(), {StatusCode::kOk}, s.id));
  s.token_ids.insert(s.token_ids.end(), ids.begin(), ids.end());
  report_.counters.tokens_committed += n;
  return CheckAppended(s, done->sequence(), n, "AppendKv(seal refused)");
}

}  // namespace kvpool::soak
