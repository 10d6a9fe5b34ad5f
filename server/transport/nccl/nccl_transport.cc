#include "server/transport/nccl/nccl_transport.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/transport/device/device_push_counters.h"
#include "server/transport/device/push_trace.h"
#include "server/transport/device_push.h"
#include "server/transport/nccl/attention_channel.h"
#include "server/transport/nccl/join_admission.h"
#include "server/transport/nccl/nccl_channel.h"
#include "server/transport/nccl/nccl_offer.h"
#include "server/transport/session_registry.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

// Most bytes of one chunk's K (or V): NcclChannel::kSlots slots of K + V stay allocated per
// channel.
constexpr size_t kMaxNcclChunkBytes = size_t{1} << 30;

// One NCCL session: an ingest channel or an attention channel.
struct NcclSession {
  NcclUse use = NcclUse::kIngest;
  std::shared_ptr<NcclChannel> ingest;
  std::shared_ptr<AttentionChannel> attention;

  // Aborts the communicator (operations in flight on either end fail) and, for an attention
  // channel, stops its loop.
  void Close() {
    if (ingest != nullptr) ingest->Abort();  // its memory goes with the last push using it
    if (attention != nullptr) attention->Close();
  }
};

// One push over an ingest channel: per chunk message the client's ncclSend of K and V is
// received into a free slot of the channel and staged from there.
class NcclPush final : public DevicePush, public std::enable_shared_from_this<NcclPush> {
 public:
  NcclPush(std::shared_ptr<NcclChannel> channel, std::function<bool()> cancelled,
           std::shared_ptr<DevicePushCounters> counters)
      : channel_(std::move(channel)),
        cancelled_(std::move(cancelled)),
        counters_(std::move(counters)) {
    counters_->Opened();
  }

  size_t max_pending_chunks() const override { return NcclChannel::kSlots; }

  absl::StatusOr<bool> Stage(const DeviceChunk& c, IngestAppend& append) override {
    if (c.bytes > kMaxNcclChunkBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a chunk's K of ", c.bytes, " bytes exceeds the NCCL chunk limit ", kMaxNcclChunkBytes));
    }
    const int traced =
        trace_.AddChunk(c.layer, static_cast<int>(c.token_offset), static_cast<int>(c.num_tokens));
    trace_.Mark(traced, PushTrace::kRead);
    KVPOOL_ASSIGN_OR_RETURN(NcclChannel::Slot * slot, channel_->AcquireSlot(c.bytes, cancelled_));
    trace_.Mark(traced, PushTrace::kSlot);
    if (absl::Status posted = channel_->PostRecv(slot, c.bytes); !posted.ok()) {
      channel_->ReleaseSlot(slot);
      return posted;
    }
    trace_.Mark(traced, PushTrace::kPosted);
    counters_->bytes_received += 2 * c.bytes;
    std::shared_ptr<NcclPush> self = shared_from_this();
    return append.StageDevice(
        c.layer, c.token_offset, c.num_tokens, static_cast<const Bf16*>(slot->k),
        static_cast<const Bf16*>(slot->v),
        [self, slot, traced] {
          absl::Status s = self->channel_->WaitRecv(slot, self->cancelled_);
          self->trace_.Mark(traced, PushTrace::kReady);
          return s;
        },
        [self, slot, traced](absl::Status, bool) {
          self->channel_->ReleaseSlot(slot);
          self->trace_.Mark(traced, PushTrace::kStaged);
        });
  }

  void End(const absl::Status& status, const std::string& sequence_id) override {
    // The client may be blocked in ncclSend for a chunk that will not be received: abort the
    // channel so that its NCCL calls fail instead of hanging.
    if (!status.ok()) channel_->Abort();
    trace_.Log(sequence_id, status);
    counters_->Ended(status.ok());
  }

 private:
  const std::shared_ptr<NcclChannel> channel_;
  const std::function<bool()> cancelled_;
  const std::shared_ptr<DevicePushCounters> counters_;
  PushTrace trace_;
};

class NcclTransport final : public Transport {
 public:
  NcclTransport(ServiceContext* ctx, const NcclTransportOptions& options)
      : ctx_(ctx),
        options_(options),
        device_(ctx->backend->device()),
        sessions_(options.max_sessions),
        counters_(std::make_shared<DevicePushCounters>()) {
    DisableNvlinkMulticast();  // shared hosts: before any NCCL use
    reaper_ = std::thread([this] { Reap(); });
  }

  ~NcclTransport() override { Shutdown(); }

  const TransportCapabilities& capabilities() const override {
    static const TransportCapabilities kCaps{.kind = TransportKind::kNccl,
                                             .host_memory = false,
                                             .device_memory = true,
                                             .local_peers = true,
                                             .remote_peers = true,
                                             .zero_copy = false,
                                             .layer_notifications = false,
                                             .remote_attention = true,
                                             .device_pushes = true,
                                             .attention_plans = true};
    return kCaps;
  }

  // Joins on the calling thread (up to the offer's timeout).
  absl::StatusOr<TransportSession> Accept(const TenantId& tenant,
                                          const TransportOffer& offer) override {
    KVPOOL_ASSIGN_OR_RETURN(NcclJoinRequest join, ParseNcclOffer(offer));
    return Join(tenant, join, offer.client_name, [] { return false; });
  }

  void AcceptAsync(const TenantId& tenant, const TransportOffer& offer,
                   std::function<bool()> cancelled,
                   std::function<void(absl::StatusOr<TransportSession>)> done) override {
    absl::StatusOr<NcclJoinRequest> join = ParseNcclOffer(offer);
    if (!join.ok()) return done(join.status());
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return done(absl::UnavailableError("kvpoold is shutting down"));
      if (!joins_.TryAcquire()) {
        return done(absl::ResourceExhaustedError(
            absl::StrCat(kMaxPendingJoins, " NCCL channels are joining; retry later")));
      }
      ++joining_;
    }
    // Joining waits for the client's rank: off the caller's (gRPC) thread.
    std::thread([this, tenant, join = *std::move(join), name = offer.client_name,
                 cancelled = std::move(cancelled), done = std::move(done)] {
      absl::StatusOr<TransportSession> s = Join(tenant, join, name, cancelled);
      joins_.Release();
      done(std::move(s));
      absl::MutexLock lock(&mu_);
      --joining_;
    }).detach();
  }

  absl::StatusOr<int> Close(const TenantId& tenant, uint64_t session_id) override {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<NcclSession> s,
                            sessions_.End(tenant, session_id, absl::OkStatus()));
    s->Close();
    return 0;  // a push in flight on the channel fails and rolls back on its own stream
  }

  TransportStats Stats() const override {
    TransportStats s;
    s.sessions = static_cast<uint32_t>(sessions_.size());
    counters_->Fill(&s);
    s.connections_refused += sessions_.foreign_attempts();  // another tenant's session named
    sessions_.ForEach([&](const NcclSession& session) {
      if (session.attention != nullptr) s.attention_calls += session.attention->calls();
    });
    return s;
  }

  void Shutdown() override {
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return;
      shut_down_ = true;  // joins in flight give up (their cancellation polls it)
      // Bounded: a join polls its cancellation every few hundred microseconds.
      const auto none_joining = [this]()
                                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return joining_ == 0; };
      mu_.AwaitWithTimeout(absl::Condition(&none_joining), absl::Seconds(30));
    }
    if (reaper_.joinable()) reaper_.join();
    for (const std::shared_ptr<NcclSession>& s :
         sessions_.EndAll(absl::UnavailableError("kvpoold is shutting down"))) {
      s->Close();
    }
  }

  absl::StatusOr<std::shared_ptr<DevicePush>> OpenDevicePush(
      const TenantId& tenant, uint64_t session_id, std::function<bool()> cancelled) override {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<NcclSession> s, sessions_.Find(tenant, session_id));
    if (s->ingest == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "NCCL session ", session_id, " is an attention channel: push over an ingest session"));
    }
    return std::make_shared<NcclPush>(s->ingest, std::move(cancelled), counters_);
  }

  absl::StatusOr<AttentionPlanInfo> SetAttentionPlan(const TenantId& tenant, uint64_t session_id,
                                                     const std::string& model_id,
                                                     std::vector<std::string> sequence_ids,
                                                     int num_queries) override {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<AttentionChannel> ch,
                            AttentionChannelOf(tenant, session_id));
    return ch->AddPlan(model_id, std::move(sequence_ids), num_queries);
  }

  absl::Status DropAttentionPlan(const TenantId& tenant, uint64_t session_id,
                                 uint32_t plan_id) override {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<AttentionChannel> ch,
                            AttentionChannelOf(tenant, session_id));
    return ch->DropPlan(plan_id);
  }

  absl::Status WatchSession(const TenantId& tenant, uint64_t session_id,
                            std::function<void(absl::Status)> on_end) override {
    return sessions_.Watch(tenant, session_id, std::move(on_end));
  }

 private:
  // Joins the client's communicator for `join.use` and registers the session.
  absl::StatusOr<TransportSession> Join(const TenantId& tenant, const NcclJoinRequest& join,
                                        const std::string& name,
                                        const std::function<bool()>& cancelled) {
    auto stop = [this, &cancelled] {
      absl::MutexLock lock(&mu_);
      return shut_down_ || cancelled();
    };
    auto session = std::make_shared<NcclSession>();
    session->use = join.use;
    TransportSession ts;
    ts.kind = TransportKind::kNccl;
    ts.device = device_;
    ts.nccl_use = join.use;
    if (join.use == NcclUse::kIngest) {
      KVPOOL_ASSIGN_OR_RETURN(
          std::unique_ptr<NcclChannel> ch,
          NcclChannel::Join(device_, join.unique_id, join.timeout, stop, join.blocking_ops));
      session->ingest = std::move(ch);
      ts.max_chunk_bytes = kMaxNcclChunkBytes;
    } else {
      KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AttentionChannel> ch,
                              AttentionChannel::Join(ctx_, tenant, join.unique_id, join.timeout,
                                                     name, stop, join.blocking_ops));
      session->attention = std::move(ch);
      ts.call_header_bytes = static_cast<uint32_t>(kCallHeaderBytes);
      ts.call_status_bytes = static_cast<uint32_t>(kCallStatusBytes);
      ts.max_query_bytes = kMaxCallQueryBytes;
      ts.watch_timeout_ms =
          static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.watch_timeout));
    }
    absl::StatusOr<uint64_t> id =
        sessions_.Add(tenant, session, /*must_watch=*/join.use == NcclUse::kAttention);
    if (!id.ok()) {
      session->Close();
      return id.status();
    }
    if (session->attention != nullptr) {
      // The loop's end (an NCCL error, an unparseable call header) ends the session; its
      // watchers hear why. (On the loop thread, as its last action.)
      session->attention->Start([this, id = *id](absl::Status why) {
        if (std::shared_ptr<NcclSession> s = sessions_.EndAny(id, why)) s->Close();
      });
    }
    ts.session_id = *id;
    spdlog::info("nccl: {} session {:x} open with {} on cuda:{}",
                 join.use == NcclUse::kIngest ? "ingest" : "attention", *id, Quote(name), device_);
    return ts;
  }

  absl::StatusOr<std::shared_ptr<AttentionChannel>> AttentionChannelOf(const TenantId& tenant,
                                                                       uint64_t session_id) {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<NcclSession> s, sessions_.Find(tenant, session_id));
    if (s->attention == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("NCCL session ", session_id, " is an ingest channel, not an attention one"));
    }
    return s->attention;
  }

  // Closes attention channels nobody watched in time, until shutdown.
  void Reap() {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(&shut_down_), absl::Milliseconds(100));
        if (shut_down_) return;
      }
      const std::string limit =
          absl::StrCat(absl::ToInt64Milliseconds(options_.watch_timeout), " ms");
      for (const std::shared_ptr<NcclSession>& s :
           sessions_.EndUnwatched(absl::Now() - options_.watch_timeout,
                                  absl::DeadlineExceededError(
                                      "the attention channel was not watched within " + limit))) {
        spdlog::warn("nccl: an attention channel was not watched within {}; closed", limit);
        s->Close();
      }
    }
  }

  ServiceContext* const ctx_;
  const NcclTransportOptions options_;
  const int device_;
  PendingJoins joins_;
  SessionRegistry<NcclSession> sessions_;
  const std::shared_ptr<DevicePushCounters> counters_;
  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  int joining_ ABSL_GUARDED_BY(mu_) = 0;  // AcceptAsync threads still running
  std::thread reaper_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> NewNcclTransport(ServiceContext* ctx,
                                                            const NcclTransportOptions& options) {
  if (ctx->backend->device() < 0) {
    return absl::UnavailableError(absl::StrCat(
        "NCCL needs kvpoold --device=cuda:N; this one runs on '", ctx->backend->name(), "'"));
  }
  return std::unique_ptr<Transport>(new NcclTransport(ctx, options));
}

}  // namespace kvpool::server
