#include "tests/soak/soak_client.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/block_layout.h"
#include "tests/soak/soak_util.h"
#include "tests/support/api_requests.h"

namespace kvpool::soak {

using absl::StatusCode;
using client::KvpoolClient;

namespace {

std::string CodesOf(absl::Span<const StatusCode> codes) {
  std::vector<std::string> names;
  for (StatusCode c : codes) names.push_back(absl::StatusCodeToString(c));
  return absl::StrJoin(names, "|");
}

}  // namespace

v1::ModelSpec SoakModelSpec(const std::string& id, const SoakShape& shape, bool exact,
                            v1::RotationKind kind, uint64_t seed, int bits) {
  v1::ModelSpec spec = testing::DataFreeModelSpec(id, shape, kind, seed);
  v1::QuantConfig* q = spec.mutable_quant();
  q->set_block_tokens(kBlockTokens);
  q->set_sink_tokens(kSinkTokens);
  q->set_recent_tokens(32);
  q->set_demotion_batch(8);
  if (exact) {
    q->set_method(v1::QUANT_METHOD_BYPASS);
  } else {
    q->set_bits(bits);
  }
  return spec;
}

absl::StatusOr<SoakModel> RegisterSoakModel(const KvpoolClient& client, const v1::ModelSpec& spec,
                                            bool exact) {
  KVPOOL_ASSIGN_OR_RETURN(v1::RegisterModelResponse r, client.RegisterModel(spec));
  SoakModel m;
  m.spec = spec;
  m.info = r.model();
  m.shape = SoakShape{spec.shape().num_layers(), spec.shape().q_heads(), spec.shape().kv_heads(),
                      spec.shape().head_dim()};
  m.exact = exact;
  if (m.info.model_id() != spec.model_id() || m.info.quant().block_tokens() != kBlockTokens ||
      m.info.quant().sink_tokens() != kSinkTokens || m.info.codec_version().size() != 64) {
    return absl::InternalError(absl::StrCat("RegisterModel ", spec.model_id(),
                                            ": unexpected model info ", m.info.ShortDebugString()));
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// SoakRun

SoakRun::SoakRun(std::string target, SoakOptions options, v1::ServerLimits limits,
                 std::vector<SoakModel> shared_models)
    : target_(std::move(target)),
      options_(options),
      limits_(std::move(limits)),
      shared_models_(std::move(shared_models)),
      deadline_(absl::Now() + options.duration) {}

void SoakRun::Fail(const std::string& message) {
  absl::MutexLock lock(&mu_);
  if (failure_.empty()) failure_ = message;
  stop_ = true;
}

bool SoakRun::failed() const {
  absl::MutexLock lock(&mu_);
  return !failure_.empty();
}

std::string SoakRun::failure() const {
  absl::MutexLock lock(&mu_);
  return failure_;
}

// ---------------------------------------------------------------------------------------------
// SoakClient: plumbing

SoakClient::SoakClient(int index, SoakRun* run)
    : index_(index), run_(run), rng_(run->options().seed * 7919 + index) {}

SoakClient::~SoakClient() = default;

int SoakClient::Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

bool SoakClient::Chance(double p) { return std::bernoulli_distribution(p)(rng_); }

std::string SoakClient::NewId(absl::string_view kind) {
  return absl::StrCat(run_->options().id_prefix, "-c", index_, "-", kind, next_id_++);
}

std::vector<uint32_t> SoakClient::RandomIds(int n) {
  std::vector<uint32_t> ids(n);
  for (uint32_t& id : ids) id = static_cast<uint32_t>(Uniform(0, 31999));
  return ids;
}

SoakClient::LiveSequence* SoakClient::PickSequence(State state) {
  std::vector<LiveSequence*> matching;
  for (LiveSequence& s : live_) {
    if (s.state == state && s.length() < static_cast<uint32_t>(run_->options().max_tokens)) {
      matching.push_back(&s);
    }
  }
  if (matching.empty()) return nullptr;
  return matching[Uniform(0, static_cast<int>(matching.size()) - 1)];
}

SoakClient::LiveSequence* SoakClient::PickAnySequence() {
  std::vector<LiveSequence*> stored;
  for (LiveSequence& s : live_) {
    if (s.length() > 0) stored.push_back(&s);
  }
  if (stored.empty()) return nullptr;
  return stored[Uniform(0, static_cast<int>(stored.size()) - 1)];
}

std::unique_ptr<grpc::ClientContext> SoakClient::ContextWithDeadline(absl::Duration timeout) const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return context;
}

absl::Status SoakClient::Expect(absl::string_view op, const absl::Status& status,
                                absl::Span<const StatusCode> allowed, absl::string_view what) {
  report_.Record(op, status);
  for (StatusCode c : allowed) {
    if (status.code() == c) return absl::OkStatus();
  }
  std::string hint;
  if (status.code() == StatusCode::kUnavailable) hint = " (is kvpoold still running?)";
  return absl::InternalError(absl::StrCat(op, " (", what, "): expected ", CodesOf(allowed),
                                          ", got ", status.ToString(), hint));
}

absl::Status SoakClient::RetryAborted(absl::string_view op,
                                      const std::function<absl::Status()>& call) {
  absl::Status got = call();
  const absl::Time give_up = absl::Now() + kAbortedRetry;
  while (got.code() == StatusCode::kAborted && absl::Now() < give_up) {
    report_.Record(op, got);
    absl::SleepFor(absl::Milliseconds(5));
    got = call();
  }
  return got;
}

absl::Status SoakClient::Connect() {
  client::ClientOptions options;
  options.deadline = run_->options().deadline;
  KVPOOL_ASSIGN_OR_RETURN(client_, KvpoolClient::Connect(run_->target(), options));
  // A probe sequence that stays empty: hostile appends that must change nothing target it.
  probe_.id = NewId("probe");
  probe_.model = &run_->shared_models()[0];
  absl::Status created = client_->CreateSequence(probe_.model->id(), probe_.id).status();
  KVPOOL_RETURN_IF_ERROR(Expect("CreateSequence", created, {StatusCode::kOk}, probe_.id));
  return client_->FitToServerLimits();
}

void SoakClient::Run() {
  absl::Status status = Connect();
  while (status.ok() && !run_->stopping()) status = Step();
  if (!status.ok()) {
    run_->Fail(absl::StrCat("client ", index_, ": ", status.message()));
    return;  // leave the daemon as it is: the run failed, its state is evidence
  }
  status = ReleaseEverything();
  if (!status.ok()) run_->Fail(absl::StrCat("client ", index_, " at cleanup: ", status.message()));
}

absl::Status SoakClient::ReleaseEverything() {
  while (!live_.empty()) KVPOOL_RETURN_IF_ERROR(Release(live_.size() - 1));
  KVPOOL_RETURN_IF_ERROR(CheckUnchanged(probe_, "the probe sequence at the end"));
  return Expect("ReleaseSequence", client_->ReleaseSequence(probe_.id).status(), {StatusCode::kOk},
                probe_.id);
}

absl::Status SoakClient::Step() {
  const int roll = Uniform(0, 99);
  const bool room = static_cast<int>(live_.size()) < run_->options().max_live_sequences;
  if (live_.empty() || (roll < 14 && room)) return CreateSequence();
  if (roll < 14) return Release(Uniform(0, static_cast<int>(live_.size()) - 1));
  if (roll < 22) {
    if (LiveSequence* s = PickSequence(State::kPrefill)) return ContinuePrefill(*s);
    return room ? CreateSequence() : Release(Uniform(0, static_cast<int>(live_.size()) - 1));
  }
  if (roll < 36) {
    if (LiveSequence* s = PickSequence(State::kDecode)) return AppendDecode(*s);
    return room ? CreateSequence() : Release(Uniform(0, static_cast<int>(live_.size()) - 1));
  }
  if (roll < 44) {
    if (LiveSequence* s = PickAnySequence()) return ReadKvAndCheck(*s);
    return absl::OkStatus();
  }
  if (roll < 49) {
    if (LiveSequence* s = PickAnySequence()) return ReadBlocksAndCheck(*s);
    return absl::OkStatus();
  }
  if (roll < 61) return AttendAndCheck();
  if (roll < 65) return LookupPrefix();
  if (roll < 68) return DescribeAndCheck(live_[Uniform(0, static_cast<int>(live_.size()) - 1)]);
  if (roll < 70) {
    LiveSequence& s = live_[Uniform(0, static_cast<int>(live_.size()) - 1)];
    return s.state == State::kSealed ? DescribeAndCheck(s) : Seal(s);
  }
  if (roll < 76) return Release(Uniform(0, static_cast<int>(live_.size()) - 1));
  if (roll < 78) return ModelLifecycle();
  if (roll < 79) return Chance(0.5) ? StatsConsistency() : DescribeModels();
  return Hostile();
}

// ---------------------------------------------------------------------------------------------
// Honest operations

absl::Status SoakClient::CreateSequence() {
  const std::vector<SoakModel>& models = run_->shared_models();
  const SoakModel& model = models[Uniform(0, static_cast<int>(models.size()) - 1)];
  static constexpr int kPrefixChoices[] = {0, 8, 16, 40, kPromptTokens, kPromptTokens};
  const int prefix = kPrefixChoices[Uniform(0, 5)];
  std::vector<uint32_t> prompt = SharedPrompt(Uniform(0, kSharedPrompts - 1), prefix);
  const std::vector<uint32_t> suffix = RandomIds(Uniform(1, 160));
  prompt.insert(prompt.end(), suffix.begin(), suffix.end());

  LiveSequence s;
  s.id = NewId("s");
  s.model = &model;
  v1::CreateSequenceRequest request;
  request.set_model_id(model.id());
  request.set_sequence_id(s.id);
  if (Chance(0.6)) request.mutable_prefix_token_ids()->Add(prompt.begin(), prompt.end());
  absl::StatusOr<v1::CreateSequenceResponse> created = client_->CreateSequence(request);
  KVPOOL_RETURN_IF_ERROR(ExpectHonest("CreateSequence", created.status(), s.id));
  if (!created.ok()) return absl::OkStatus();

  // Only the shared prompt can be cached (suffixes are random), and only whole units.
  const uint32_t reused = created->reused_tokens();
  uint32_t covered = 0;
  for (const v1::PrefixUnit& u : created->reused_units()) {
    if (u.token_start() != covered) break;
    covered += u.token_count();
  }
  if (reused > static_cast<uint32_t>(prefix) || covered != reused ||
      (reused != 0 && (reused < kSinkTokens || (reused - kSinkTokens) % kBlockTokens != 0)) ||
      created->sequence().total_tokens() != reused ||
      created->sequence().reused_tokens() != reused) {
    return absl::InternalError(absl::StrCat("CreateSequence ", s.id, ": reused ", reused,
                                            " tokens of a ", prefix,
                                            "-token shared prefix: ", created->ShortDebugString()));
  }
  s.reused = reused;
  s.token_ids.assign(prompt.begin(), prompt.begin() + reused);
  live_.push_back(std::move(s));
  LiveSequence& stored = live_.back();

  bool done = false;
  const std::vector<uint32_t> rest(prompt.begin() + reused, prompt.end());
  KVPOOL_RETURN_IF_ERROR(AppendPrefill(stored, rest, /*end_of_prefill=*/Chance(0.7), &done));
  if (!done && stored.length() == 0) return Release(live_.size() - 1);
  // Prefix units another client published must read back as this client's own rows.
  if (reused > 0 && Chance(0.3)) return ReadKvAndCheck(live_.back());
  return absl::OkStatus();
}

absl::Status SoakClient::AppendPrefill(LiveSequence& s, const std::vector<uint32_t>& ids,
                                       bool end_of_prefill, bool* done) {
  *done = false;
  const uint32_t start = s.length();
  const uint32_t n = static_cast<uint32_t>(ids.size());
  const SoakShape& shape = s.model->shape;
  v1::AppendKvHeader header;
  header.set_sequence_id(s.id);
  header.set_token_start(start);
  header.set_num_tokens(n);
  header.set_dtype(v1::DTYPE_BF16);
  header.set_end_of_prefill(end_of_prefill);
  const bool with_ids = Chance(0.9);
  if (with_ids) header.mutable_token_ids()->Add(ids.begin(), ids.end());
  std::vector<LayerRows> rows;
  for (int l = 0; l < shape.num_layers; ++l) rows.push_back(ExpectedRows(shape, l, start, ids));

  const bool layerwise = Chance(0.5);
  const char* op = layerwise ? "AppendKv(layer-wise)" : "AppendKv";
  auto append = [&]() -> absl::StatusOr<v1::AppendKvResponse> {
    if (!layerwise) {
      std::vector<client::LayerKv> layers;
      for (int l = 0; l < shape.num_layers; ++l) {
        layers.push_back({l, rows[l].k_bytes(), rows[l].v_bytes()});
      }
      return client_->AppendKv(header, layers);
    }
    // Layers in any order, each in 1-3 chunks, chunks of different layers interleaved.
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::AppendStream> stream,
                            client_->OpenAppend(header));
    std::vector<std::vector<uint32_t>> cuts(shape.num_layers);
    for (auto& c : cuts) {
      c = {0, n};
      for (int i = Uniform(0, 2); i > 0 && n > 1; --i) c.push_back(Uniform(1, n - 1));
      std::sort(c.begin(), c.end());
      c.erase(std::unique(c.begin(), c.end()), c.end());
    }
    std::vector<size_t> next(shape.num_layers, 0);
    const size_t row_bytes = shape.row_values() * sizeof(Bf16);
    while (true) {
      std::vector<int> open;
      for (int l = 0; l < shape.num_layers; ++l) {
        if (next[l] + 1 < cuts[l].size()) open.push_back(l);
      }
      if (open.empty()) break;
      const int l = open[Uniform(0, static_cast<int>(open.size()) - 1)];
      const uint32_t from = cuts[l][next[l]], to = cuts[l][next[l] + 1];
      ++next[l];
      const absl::Status wrote = stream->WriteLayer(
          l, from, to - from, rows[l].k_bytes().substr(from * row_bytes, (to - from) * row_bytes),
          rows[l].v_bytes().substr(from * row_bytes, (to - from) * row_bytes));
      if (!wrote.ok()) return wrote;
    }
    return stream->Finish();
  };

  absl::StatusOr<v1::AppendKvResponse> r;
  KVPOOL_RETURN_IF_ERROR(ExpectHonest(op,
                                      RetryAborted(op,
                                                   [&] {
                                                     r = append();
                                                     return r.status();
                                                   }),
                                      s.id));
  if (!r.ok()) return absl::OkStatus();
  const uint32_t tiers = r->to_sink() + r->to_history() + r->to_recent();
  if (tiers != n) {
    return absl::InternalError(absl::StrCat(op, " ", s.id, ": ", n, " tokens appended but ", tiers,
                                            " placed: ", r->ShortDebugString()));
  }
  s.token_ids.insert(s.token_ids.end(), ids.begin(), ids.end());
  s.all_ids = s.all_ids && with_ids;
  if (end_of_prefill) s.state = State::kDecode;
  report_.counters.tokens_committed += n;
  *done = true;
  return CheckAppended(s, r->sequence(), n, op);
}

absl::Status SoakClient::CheckAppended(const LiveSequence& s, const v1::SequenceInfo& info,
                                       uint32_t added, absl::string_view what) {
  const v1::SequenceState state = s.state == State::kPrefill  ? v1::SEQUENCE_STATE_PREFILL
                                  : s.state == State::kDecode ? v1::SEQUENCE_STATE_DECODE
                                                              : v1::SEQUENCE_STATE_SEALED;
  if (info.sequence_id() != s.id || info.model_id() != s.model->id() ||
      info.total_tokens() != s.length() || info.state() != state ||
      info.sink_tokens() + info.history_tokens() + info.recent_tokens() != info.total_tokens() ||
      info.reused_tokens() != s.reused || info.has_token_ids() != s.all_ids) {
    return absl::InternalError(absl::StrCat(what, " ", s.id, " (", added, " tokens added, ",
                                            s.length(), " expected in total, token ids ",
                                            s.all_ids ? "complete" : "incomplete",
                                            "): the daemon says ", info.ShortDebugString()));
  }
  return absl::OkStatus();
}

absl::Status SoakClient::ContinuePrefill(LiveSequence& s) {
  const int room = run_->options().max_tokens - static_cast<int>(s.length());
  if (room < 1) return absl::OkStatus();
  bool done = false;
  return AppendPrefill(s, RandomIds(Uniform(1, std::min(64, room))), Chance(0.5), &done);
}

absl::Status SoakClient::AppendDecode(LiveSequence& s) {
  const uint32_t n = Uniform(1, 3);
  const uint32_t start = s.length();
  const SoakShape& shape = s.model->shape;
  const std::vector<uint32_t> ids = RandomIds(n);
  v1::AppendDecodeRequest request;
  request.set_sequence_id(s.id);
  request.set_token_start(start);
  request.set_num_tokens(n);
  // FP32 input holding BF16 values converts exactly: the rows stored are the same.
  const bool fp32 = Chance(0.2);
  request.set_dtype(fp32 ? v1::DTYPE_FP32 : v1::DTYPE_BF16);
  const bool with_ids = Chance(0.9);
  if (with_ids) request.mutable_token_ids()->Add(ids.begin(), ids.end());
  for (int l = 0; l < shape.num_layers; ++l) {
    const LayerRows rows = ExpectedRows(shape, l, start, ids);
    if (fp32) {
      request.mutable_k()->append(Bytes(ToFloats(rows.k)));
      request.mutable_v()->append(Bytes(ToFloats(rows.v)));
    } else {
      request.mutable_k()->append(rows.k_bytes().data(), rows.k_bytes().size());
      request.mutable_v()->append(rows.v_bytes().data(), rows.v_bytes().size());
    }
  }
  absl::StatusOr<v1::AppendDecodeResponse> r;
  KVPOOL_RETURN_IF_ERROR(ExpectHonest("AppendDecode",
                                      RetryAborted("AppendDecode",
                                                   [&] {
                                                     r = client_->AppendDecode(request);
                                                     return r.status();
                                                   }),
                                      s.id));
  if (!r.ok()) return absl::OkStatus();
  if (r->demoted_tokens() % s.model->info.quant().demotion_batch() != 0) {
    return absl::InternalError(absl::StrCat("AppendDecode ", s.id, ": demoted ",
                                            r->demoted_tokens(), " tokens, not a multiple of ",
                                            s.model->info.quant().demotion_batch()));
  }
  s.token_ids.insert(s.token_ids.end(), ids.begin(), ids.end());
  s.all_ids = s.all_ids && with_ids;
  report_.counters.tokens_committed += n;
  return CheckAppended(s, r->sequence(), n, "AppendDecode");
}

absl::Status SoakClient::ReadKvAndCheck(LiveSequence& s) {
  const SoakShape& shape = s.model->shape;
  const uint32_t length = s.length();
  const uint32_t start = Uniform(0, static_cast<int>(length) - 1);
  const uint32_t count = Chance(0.3) ? 0 : Uniform(1, static_cast<int>(length - start));
  const uint32_t n = count == 0 ? length - start : count;
  v1::ReadKvRequest request;
  request.set_sequence_id(s.id);
  request.set_token_start(start);
  request.set_num_tokens(count);
  std::vector<int> layers;
  if (Chance(0.5)) {
    for (int l = shape.num_layers - 1; l >= 0; --l) {
      if (Chance(0.6)) layers.push_back(l);
    }
  }
  request.mutable_layers()->Add(layers.begin(), layers.end());
  if (layers.empty()) {
    for (int l = 0; l < shape.num_layers; ++l) layers.push_back(l);
  }
  const bool fp32 = Chance(s.model->exact ? 0.3 : 0.5);
  request.set_dtype(fp32 ? v1::DTYPE_FP32 : v1::DTYPE_BF16);
  absl::StatusOr<client::KvRead> r = client_->ReadKv(request);
  KVPOOL_RETURN_IF_ERROR(ExpectHonest("ReadKv", r.status(), s.id));
  if (!r.ok()) return absl::OkStatus();

  const std::string what = absl::StrCat("ReadKv ", s.id, " [", start, ", ", start + n, ")");
  if (r->header.token_start() != start || r->header.num_tokens() != n ||
      r->layers.size() != layers.size()) {
    return absl::InternalError(absl::StrCat(what, ": header ", r->header.ShortDebugString()));
  }
  const size_t bytes = n * shape.row_values() * (fp32 ? sizeof(float) : sizeof(Bf16));
  const absl::Span<const uint32_t> ids = absl::MakeConstSpan(s.token_ids).subspan(start, n);
  for (size_t i = 0; i < layers.size(); ++i) {
    const client::LayerRows& got = r->layers[i];
    const std::string where = absl::StrCat(what, " layer ", layers[i]);
    if (got.layer != layers[i] || got.k.size() != bytes || got.v.size() != bytes) {
      return absl::InternalError(absl::StrCat(where, ": layer ", got.layer, " with ", got.k.size(),
                                              "+", got.v.size(), " bytes, expected ", bytes,
                                              " each"));
    }
    if (s.model->exact) {
      const LayerRows want = ExpectedRows(shape, layers[i], start, ids);
      if (fp32) {  // the floats of the pushed BF16 values, exactly
        KVPOOL_RETURN_IF_ERROR(
            CompareBytes(got.k, Bytes(ToFloats(want.k)), absl::StrCat(where, " K (FP32)")));
        KVPOOL_RETURN_IF_ERROR(
            CompareBytes(got.v, Bytes(ToFloats(want.v)), absl::StrCat(where, " V (FP32)")));
        continue;
      }
      KVPOOL_RETURN_IF_ERROR(CompareBytes(got.k, want.k_bytes(), absl::StrCat(where, " K")));
      KVPOOL_RETURN_IF_ERROR(CompareBytes(got.v, want.v_bytes(), absl::StrCat(where, " V")));
      continue;
    }
    // INT2/INT4: lossy, but always finite.
    for (const std::string* t : {&got.k, &got.v}) {
      const std::vector<float> values =
          fp32 ? FloatsFromBytes(*t)
               : ToFloats(absl::MakeConstSpan(reinterpret_cast<const Bf16*>(t->data()),
                                              t->size() / sizeof(Bf16)));
      for (float x : values) {
        if (!std::isfinite(x)) return absl::InternalError(absl::StrCat(where, ": non-finite"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status SoakClient::ReadBlocksAndCheck(LiveSequence& s) {
  const SoakShape& shape = s.model->shape;
  v1::ReadBlocksRequest request;
  request.set_sequence_id(s.id);
  std::vector<int> layers;
  if (Chance(0.5)) layers.push_back(Uniform(0, shape.num_layers - 1));
  request.mutable_layers()->Add(layers.begin(), layers.end());
  if (layers.empty()) {
    for (int l = 0; l < shape.num_layers; ++l) layers.push_back(l);
  }
  absl::StatusOr<client::BlocksRead> r = client_->ReadBlocks(request);
  KVPOOL_RETURN_IF_ERROR(ExpectHonest("ReadBlocks", r.status(), s.id));
  if (!r.ok()) return absl::OkStatus();

  const std::string what = absl::StrCat("ReadBlocks ", s.id);
  const v1::ReadBlocksHeader& h = r->header;
  const BlockLayout layout = [&] {
    BlockLayout l;
    l.tokens = h.block_layout().tokens();
    l.kv_heads = h.block_layout().kv_heads();
    l.head_dim = h.block_layout().head_dim();
    l.group_size = h.block_layout().group_size();
    l.bits = h.block_layout().bits();
    return l;
  }();
  const uint32_t sink = h.sink_tokens(), history = h.history_tokens(), recent = h.recent_tokens();
  if (sink + history + recent != s.length() || h.codec_version() != s.model->info.codec_version() ||
      layout.block_bytes() != h.block_layout().block_bytes() || r->layers.size() != layers.size()) {
    return absl::InternalError(
        absl::StrCat(what, " (", s.length(), " tokens): header ", h.ShortDebugString()));
  }
  const size_t row_bytes = shape.row_values() * sizeof(Bf16);
  const size_t blocks = (history + layout.tokens - 1) / layout.tokens;
  for (size_t i = 0; i < layers.size(); ++i) {
    const client::LayerBlocks& got = r->layers[i];
    const std::string where = absl::StrCat(what, " layer ", layers[i]);
    if (got.layer != layers[i] || got.sink_k.size() != sink * row_bytes ||
        got.sink_v.size() != sink * row_bytes || got.recent_k.size() != recent * row_bytes ||
        got.recent_v.size() != recent * row_bytes || got.blocks.size() != blocks) {
      return absl::InternalError(absl::StrCat(where, ": wrong tier sizes or ", got.blocks.size(),
                                              " blocks for ", history, " history tokens"));
    }
    for (size_t b = 0; b < blocks; ++b) {
      const v1::KvBlock& block = got.blocks[b];
      const uint32_t valid = std::min<uint32_t>(layout.tokens, history - b * layout.tokens);
      if (block.block_index() != b || block.valid_tokens() != valid ||
          block.data().size() != layout.block_bytes()) {
        return absl::InternalError(absl::StrCat(where, " block ", b, ": index ",
                                                block.block_index(), ", ", block.valid_tokens(),
                                                " valid tokens, ", block.data().size(), " bytes"));
      }
    }
    if (!s.model->exact) continue;
    // Identity rotation, bypass blocks: sink, history rows and recent are the pushed rows.
    const LayerRows want = ExpectedRows(shape, layers[i], 0, s.token_ids);
    KVPOOL_RETURN_IF_ERROR(CompareBytes(got.sink_k, want.k_bytes().substr(0, sink * row_bytes),
                                        absl::StrCat(where, " sink K")));
    KVPOOL_RETURN_IF_ERROR(CompareBytes(got.sink_v, want.v_bytes().substr(0, sink * row_bytes),
                                        absl::StrCat(where, " sink V")));
    const size_t recent_at = (sink + history) * row_bytes;
    KVPOOL_RETURN_IF_ERROR(CompareBytes(got.recent_k, want.k_bytes().substr(recent_at),
                                        absl::StrCat(where, " recent K")));
    KVPOOL_RETURN_IF_ERROR(CompareBytes(got.recent_v, want.v_bytes().substr(recent_at),
                                        absl::StrCat(where, " recent V")));
    const size_t head_bytes = shape.head_dim * sizeof(Bf16);
    for (size_t b = 0; b < blocks; ++b) {
      const std::string& data = got.blocks[b].data();
      for (uint32_t t = 0; t < got.blocks[b].valid_tokens(); ++t) {
        const size_t position = sink + b * layout.tokens + t;
        for (int head = 0; head < shape.kv_heads; ++head) {
          const size_t src = position * row_bytes + head * head_bytes;
          const size_t k_at =
              layout.CodesOffset(KvTensor::kKey, head) + t * layout.code_bytes_per_row();
          const size_t v_at =
              layout.CodesOffset(KvTensor::kValue, head) + t * layout.code_bytes_per_row();
          KVPOOL_RETURN_IF_ERROR(
              CompareBytes(absl::string_view(data).substr(k_at, head_bytes),
                           want.k_bytes().substr(src, head_bytes),
                           absl::StrCat(where, " block ", b, " token ", t, " head ", head, " K")));
          KVPOOL_RETURN_IF_ERROR(
              CompareBytes(absl::string_view(data).substr(v_at, head_bytes),
                           want.v_bytes().substr(src, head_bytes),
                           absl::StrCat(where, " block ", b, " token ", t, " head ", head, " V")));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status SoakClient::ReferenceRows(const LiveSequence& s, int layer, std::vector<float>* k,
                                       std::vector<float>* v) {
  if (s.model->exact) {
    const LayerRows rows = ExpectedRows(s.model->shape, layer, 0, s.token_ids);
    *k = ToFloats(rows.k);
    *v = ToFloats(rows.v);
    return absl::OkStatus();
  }
  v1::ReadKvRequest request;
  request.set_sequence_id(s.id);
  request.add_layers(layer);
  request.set_dtype(v1::DTYPE_FP32);
  absl::StatusOr<client::KvRead> r = client_->ReadKv(request);
  KVPOOL_RETURN_IF_ERROR(ExpectHonest("ReadKv", r.status(), s.id));
  if (!r.ok()) return r.status();  // busy: the caller skips its check
  const size_t values = s.length() * s.model->shape.row_values();
  if (r->layers.size() != 1 || r->layers[0].k.size() != values * sizeof(float)) {
    return absl::InternalError(absl::StrCat("ReadKv ", s.id, ": not ", s.length(), " tokens"));
  }
  *k = FloatsFromBytes(r->layers[0].k);
  *v = FloatsFromBytes(r->layers[0].v);
  return absl::OkStatus();
}

absl::Status SoakClient::AttendSequences(const SoakModel& model,
                                         const std::vector<LiveSequence*>& batch) {
  const SoakShape& shape = model.shape;
  const int layer = Uniform(0, shape.num_layers - 1);
  const bool bf16 = Chance(0.3);
  v1::AttendRequest request;
  request.set_model_id(model.id());
  request.set_layer(layer);
  request.set_dtype(bf16 ? v1::DTYPE_BF16 : v1::DTYPE_FP32);
  std::vector<AttentionOutput> want;
  for (LiveSequence* s : batch) {
    const int nq = Uniform(1, 2);
    std::vector<float> q = QueryValues(nq * shape.query_values(), rng_());
    v1::SequenceQuery* sq = request.add_queries();
    sq->set_sequence_id(s->id);
    sq->set_num_queries(nq);
    if (bf16) {
      std::vector<Bf16> rounded(q.size());
      for (size_t i = 0; i < q.size(); ++i) rounded[i] = Bf16::FromFloat(q[i]);
      q = ToFloats(rounded);
      sq->set_q(Bytes(rounded));
    } else {
      sq->set_q(Bytes(q));
    }
    std::vector<float> k, v;
    const absl::Status rows = ReferenceRows(*s, layer, &k, &v);
    if (rows.code() == StatusCode::kResourceExhausted) return absl::OkStatus();
    KVPOOL_RETURN_IF_ERROR(rows);
    want.push_back(ReferenceAttention(shape, q, nq, k, v, s->length()));
  }
  report_.counters.attend_sent++;
  report_.counters.attend_sequences_sent += batch.size();
  absl::StatusOr<v1::AttendResponse> r = client_->Attend(request);
  KVPOOL_RETURN_IF_ERROR(ExpectHonest("Attend", r.status(), model.id()));
  if (!r.ok()) return absl::OkStatus();
  report_.counters.attend_ok++;
  report_.counters.attend_sequences_ok += batch.size();
  if (r->results_size() != static_cast<int>(batch.size())) {
    return absl::InternalError(absl::StrCat("Attend on ", model.id(), ": ", r->results_size(),
                                            " results for ", batch.size(), " sequences"));
  }
  // Exact model: the daemon's fp32 arithmetic against a float64 reference. INT2/INT4: against
  // dense attention over the dequantized rows, which differ only by the rotation's rounding.
  const double tol = model.exact ? 1e-4 : 2e-3;
  for (size_t i = 0; i < batch.size(); ++i) {
    const v1::SequenceAttention& got = r->results(i);
    const std::string what = absl::StrCat("Attend ", batch[i]->id, " layer ", layer);
    if (got.sequence_id() != batch[i]->id || got.attended_tokens() != batch[i]->length()) {
      return absl::InternalError(absl::StrCat(what, ": result for ", got.sequence_id(), " over ",
                                              got.attended_tokens(), " tokens, expected ",
                                              batch[i]->length()));
    }
    const std::vector<float> out = FloatsFromBytes(got.out());
    KVPOOL_RETURN_IF_ERROR(CompareAttention(
        out, std::vector<float>(got.lse().begin(), got.lse().end()), want[i], tol, what));
  }
  return absl::OkStatus();
}

absl::Status SoakClient::AttendAndCheck() {
  const std::vector<SoakModel>& models = run_->shared_models();
  const SoakModel& model = models[Uniform(0, static_cast<int>(models.size()) - 1)];
  std::vector<LiveSequence*> candidates;
  for (LiveSequence& s : live_) {
    if (s.model == &model && s.length() > 0) candidates.push_back(&s);
  }
  if (candidates.empty()) return absl::OkStatus();
  std::shuffle(candidates.begin(), candidates.end(), rng_);
  candidates.resize(Uniform(1, std::min<int>(3, candidates.size())));
  return AttendSequences(model, candidates);
}

absl::Status SoakClient::LookupPrefix() {
  const std::vector<SoakModel>& models = run_->shared_models();
  const SoakModel& model = models[Uniform(0, static_cast<int>(models.size()) - 1)];
  std::vector<uint32_t> ids = SharedPrompt(Uniform(0, kSharedPrompts - 1), kPromptTokens);
  if (Chance(0.5)) {
    const std::vector<uint32_t> more = RandomIds(Uniform(1, 40));
    ids.insert(ids.end(), more.begin(), more.end());
  }
  absl::StatusOr<v1::LookupPrefixResponse> r = client_->LookupPrefix(model.id(), ids);
  KVPOOL_RETURN_IF_ERROR(ExpectHonest("LookupPrefix", r.status(), model.id()));
  if (!r.ok()) return absl::OkStatus();
  const uint32_t matched = r->matched_tokens();
  uint32_t covered = 0;
  for (const v1::PrefixUnit& u : r->units()) {
    if (u.token_start() != covered || u.hash().size() != 64) break;
    covered += u.token_count();
  }
  if (matched > kPromptTokens || covered != matched ||
      (matched != 0 && (matched < kSinkTokens || (matched - kSinkTokens) % kBlockTokens != 0 ||
                        r->codec_version() != model.info.codec_version()))) {
    return absl::InternalError(
        absl::StrCat("LookupPrefix on ", model.id(), ": ", r->ShortDebugString()));
  }
  return absl::OkStatus();
}

absl::Status SoakClient::DescribeAndCheck(const LiveSequence& s) {
  absl::StatusOr<v1::SequenceInfo> info = client_->DescribeSequence(s.id);
  KVPOOL_RETURN_IF_ERROR(Expect("DescribeSequence", info.status(), {StatusCode::kOk}, s.id));
  return CheckAppended(s, *info, 0, "DescribeSequence");
}

absl::Status SoakClient::Seal(LiveSequence& s) {
  // ABORTED while an abandoned append still holds the sequence: retried.
  absl::StatusOr<v1::SequenceInfo> info;
  KVPOOL_RETURN_IF_ERROR(Expect("SealSequence",
                                RetryAborted("SealSequence",
                                             [&] {
                                               info = client_->SealSequence(s.id);
                                               return info.status();
                                             }),
                                {StatusCode::kOk}, s.id));
  s.state = State::kSealed;
  return CheckAppended(s, *info, 0, "SealSequence");
}

absl::Status SoakClient::Release(size_t index) {
  const std::string id = live_[index].id;
  live_.erase(live_.begin() + index);
  KVPOOL_RETURN_IF_ERROR(
      Expect("ReleaseSequence", client_->ReleaseSequence(id).status(), {StatusCode::kOk}, id));
  if (!Chance(0.2)) return absl::OkStatus();
  return Expect("DescribeSequence", client_->DescribeSequence(id).status(), {StatusCode::kNotFound},
                absl::StrCat(id, " after its release"));
}

absl::Status SoakClient::ModelLifecycle() {
  static constexpr int kHeadDims[] = {32, 64, 128};
  SoakShape shape;
  shape.num_layers = Uniform(1, 3);
  shape.kv_heads = Uniform(1, 2);
  shape.q_heads = shape.kv_heads << Uniform(0, 2);
  shape.head_dim = kHeadDims[Uniform(0, 2)];
  const bool exact = Chance(0.5);
  const v1::RotationKind kind =
      exact ? v1::ROTATION_KIND_IDENTITY
            : (Chance(0.5) ? v1::ROTATION_KIND_HADAMARD : v1::ROTATION_KIND_RANDOMIZED_HADAMARD);
  const std::string id = NewId("m");
  const v1::ModelSpec spec = SoakModelSpec(id, shape, exact, kind, rng_(), Chance(0.5) ? 2 : 4);
  absl::StatusOr<SoakModel> registered = RegisterSoakModel(*client_, spec, exact);
  KVPOOL_RETURN_IF_ERROR(ExpectHonest("RegisterModel", registered.status(), id));
  if (!registered.ok()) return absl::OkStatus();
  const SoakModel model = *std::move(registered);

  bool deleted = false;
  absl::Status status = [&]() -> absl::Status {
    if (Chance(0.3)) {  // registering the same model again is idempotent
      absl::StatusOr<v1::RegisterModelResponse> again = client_->RegisterModel(spec);
      KVPOOL_RETURN_IF_ERROR(Expect("RegisterModel", again.status(), {StatusCode::kOk}, id));
      if (!again->already_registered() ||
          again->model().codec_version() != model.info.codec_version()) {
        return absl::InternalError(
            absl::StrCat("RegisterModel ", id, " again: ", again->ShortDebugString()));
      }
    }
    if (Chance(0.3)) {  // the same id with another rotation is a different codec
      v1::ModelSpec other = spec;
      other.mutable_data_free()->set_kind(exact ? v1::ROTATION_KIND_HADAMARD
                                                : v1::ROTATION_KIND_IDENTITY);
      KVPOOL_RETURN_IF_ERROR(Expect("bad:RegisterModel(conflict)",
                                    client_->RegisterModel(other).status(),
                                    {StatusCode::kAlreadyExists}, id));
    }
    std::vector<LiveSequence> sequences(Uniform(0, 2));
    for (LiveSequence& s : sequences) {
      s.id = NewId("e");
      s.model = &model;
      KVPOOL_RETURN_IF_ERROR(Expect("CreateSequence", client_->CreateSequence(id, s.id).status(),
                                    {StatusCode::kOk}, s.id));
      std::vector<uint32_t> ids = SharedPrompt(0, kPromptTokens);
      const std::vector<uint32_t> more = RandomIds(Uniform(1, 40));
      ids.insert(ids.end(), more.begin(), more.end());
      bool done = false;
      KVPOOL_RETURN_IF_ERROR(AppendPrefill(s, ids, /*end_of_prefill=*/true, &done));
      if (!done) return absl::OkStatus();  // busy or full: the model is deleted below
    }
    if (!sequences.empty()) {
      std::vector<LiveSequence*> batch;
      for (LiveSequence& s : sequences) batch.push_back(&s);
      KVPOOL_RETURN_IF_ERROR(AttendSequences(model, batch));
      KVPOOL_RETURN_IF_ERROR(ReadKvAndCheck(sequences[0]));
      KVPOOL_RETURN_IF_ERROR(Expect("bad:DeleteModel(in use)",
                                    client_->DeleteModel(id, /*force=*/false).status(),
                                    {StatusCode::kFailedPrecondition}, id));
    }
    const bool force = Chance(0.5);
    if (!force) {
      for (const LiveSequence& s : sequences) {
        KVPOOL_RETURN_IF_ERROR(Expect("ReleaseSequence", client_->ReleaseSequence(s.id).status(),
                                      {StatusCode::kOk}, s.id));
      }
    }
    // An append in flight across a forced delete: it must fail with NOT_FOUND, and its pages
    // must come back.
    std::unique_ptr<client::AppendStream> racing;
    std::vector<LayerRows> racing_rows;
    uint32_t racing_tokens = 0;
    if (force && Chance(0.5)) {
      const std::string racing_id = NewId("e");
      KVPOOL_RETURN_IF_ERROR(Expect("CreateSequence",
                                    client_->CreateSequence(id, racing_id).status(),
                                    {StatusCode::kOk}, racing_id));
      racing_tokens = Uniform(17, 60);
      const std::vector<uint32_t> ids = RandomIds(racing_tokens);
      for (int l = 0; l < shape.num_layers; ++l)
        racing_rows.push_back(ExpectedRows(shape, l, 0, ids));
      v1::AppendKvHeader header;
      header.set_sequence_id(racing_id);
      header.set_num_tokens(racing_tokens);
      header.set_dtype(v1::DTYPE_BF16);
      header.mutable_token_ids()->Add(ids.begin(), ids.end());
      absl::StatusOr<std::unique_ptr<client::AppendStream>> stream = client_->OpenAppend(header);
      if (!stream.ok()) return Expect("OpenAppend", stream.status(), {}, racing_id);
      racing = *std::move(stream);
      (void)racing->WriteLayer(0, 0, racing_tokens, racing_rows[0].k_bytes(),
                               racing_rows[0].v_bytes());
    }
    absl::StatusOr<v1::DeleteModelResponse> gone = client_->DeleteModel(id, force);
    KVPOOL_RETURN_IF_ERROR(Expect("DeleteModel", gone.status(), {StatusCode::kOk}, id));
    deleted = true;
    if (racing != nullptr) {
      for (int l = 1; l < shape.num_layers; ++l) {
        if (!racing
                 ->WriteLayer(l, 0, racing_tokens, racing_rows[l].k_bytes(),
                              racing_rows[l].v_bytes())
                 .ok()) {
          break;
        }
      }
      KVPOOL_RETURN_IF_ERROR(Expect("bad:AppendKv(model deleted midway)", racing->Finish().status(),
                                    {StatusCode::kNotFound}, id));
    }
    const uint64_t released = force ? sequences.size() + (racing != nullptr ? 1 : 0) : 0;
    if (gone->released_sequences() != released) {
      return absl::InternalError(absl::StrCat("DeleteModel ", id, ": released ",
                                              gone->released_sequences(), " sequences, ", released,
                                              " expected"));
    }
    KVPOOL_RETURN_IF_ERROR(Expect("DescribeModel", client_->DescribeModel(id, false).status(),
                                  {StatusCode::kNotFound}, absl::StrCat(id, " after delete")));
    for (const LiveSequence& s : sequences) {
      KVPOOL_RETURN_IF_ERROR(Expect("DescribeSequence", client_->DescribeSequence(s.id).status(),
                                    {StatusCode::kNotFound},
                                    absl::StrCat(s.id, " after its model's delete")));
    }
    return Expect("LookupPrefix",
                  client_->LookupPrefix(id, SharedPrompt(0, kPromptTokens)).status(),
                  {StatusCode::kNotFound}, absl::StrCat(id, " after delete"));
  }();
  if (!status.ok() || deleted) return status;
  // A path that stopped early (busy, full) still leaves nothing behind.
  return Expect("DeleteModel", client_->DeleteModel(id, /*force=*/true).status(), {StatusCode::kOk},
                id);
}

absl::Status SoakClient::DescribeModels() {
  absl::StatusOr<std::vector<v1::ModelInfo>> list = client_->ListModels();
  KVPOOL_RETURN_IF_ERROR(Expect("ListModels", list.status(), {StatusCode::kOk}, "all"));
  for (const SoakModel& m : run_->shared_models()) {
    if (std::none_of(list->begin(), list->end(),
                     [&](const v1::ModelInfo& i) { return i.model_id() == m.id(); })) {
      return absl::InternalError(absl::StrCat("ListModels: ", m.id(), " missing"));
    }
  }
  const std::vector<SoakModel>& models = run_->shared_models();
  const SoakModel& model = models[Uniform(0, static_cast<int>(models.size()) - 1)];
  absl::StatusOr<client::ModelDescription> d = client_->DescribeModel(model.id(), true);
  KVPOOL_RETURN_IF_ERROR(Expect("DescribeModel", d.status(), {StatusCode::kOk}, model.id()));
  const size_t matrix_bytes = sizeof(float) * model.shape.head_dim * model.shape.head_dim;
  if (d->info.codec_version() != model.info.codec_version() ||
      d->rotation.size() != static_cast<size_t>(model.shape.num_layers)) {
    return absl::InternalError(absl::StrCat("DescribeModel ", model.id(), ": ",
                                            d->info.ShortDebugString(), " with ",
                                            d->rotation.size(), " rotation layers"));
  }
  for (size_t l = 0; l < d->rotation.size(); ++l) {
    const v1::RotationLayer& r = d->rotation[l];
    if (r.layer() != static_cast<int>(l) || r.k_matrix().size() != matrix_bytes ||
        r.v_matrix().size() != matrix_bytes) {
      return absl::InternalError(absl::StrCat("DescribeModel ", model.id(), ": rotation layer ", l,
                                              " is ", r.layer(), " with ", r.k_matrix().size(),
                                              " bytes"));
    }
    if (!model.exact) continue;
    const std::vector<float> k = FloatsFromBytes(r.k_matrix());
    for (int i = 0; i < model.shape.head_dim; ++i) {
      for (int j = 0; j < model.shape.head_dim; ++j) {
        if (k[i * model.shape.head_dim + j] != (i == j ? 1.0f : 0.0f)) {
          return absl::InternalError(absl::StrCat("DescribeModel ", model.id(),
                                                  ": the identity rotation has M[", i, "][", j,
                                                  "] = ", k[i * model.shape.head_dim + j]));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status SoakClient::StatsConsistency() {
  absl::StatusOr<v1::GetStatsResponse> r = client_->GetStats();
  KVPOOL_RETURN_IF_ERROR(Expect("GetStats", r.status(), {StatusCode::kOk}, "consistency"));
  const v1::PoolStats& p = r->pool();
  uint64_t class_bytes = 0;
  for (const v1::PageClassStats& c : p.classes()) {
    if (c.bytes_in_use() != c.page_bytes() * c.pages_in_use()) {
      return absl::InternalError(absl::StrCat("GetStats: class ", c.ShortDebugString()));
    }
    class_bytes += c.bytes_in_use();
  }
  if (class_bytes != p.used_bytes() || p.free_bytes() + p.used_bytes() != p.capacity_bytes() ||
      p.shared_bytes() > p.used_bytes() || p.slabs_in_use() > p.slabs_total() ||
      p.unassigned_bytes() != (p.slabs_total() - p.slabs_in_use()) * p.slab_bytes()) {
    return absl::InternalError(absl::StrCat("GetStats: inconsistent pool ", p.ShortDebugString()));
  }
  return absl::OkStatus();
}

}  // namespace kvpool::soak
