// IngestStreamReactor: the gRPC side of a client-streaming ingest (SequenceService.AppendKv,
// TransportService.PushKv). The first message begins an append in the ingest engine
// (server/ingest/), every later one is handed to it, the half-close commits it, and the stream's
// answer is the append's end (the AppendKvResponse, or the error once the append is rolled back).
//
// The stream holds an admission ticket from its start (IngestEngine::Admit, on the caller's
// connection): a stream over a cap is refused before it reads anything (RESOURCE_EXHAUSTED,
// reason LIMIT), and one that makes no progress for the idle timeout, header or not, ends with
// DEADLINE_EXCEEDED (reason LIMIT) once its append is rolled back.
//
// The reactor only reads; the engine stages, bounds and rolls back. Reading overlaps staging: the
// next read starts as soon as a message is handed over, unless the engine's queue is full; then
// no read is pending, so gRPC flow control pushes back on a fast client, until the engine
// resumes the producer. The read is restarted from a gRPC thread (an alarm due now), never from
// the worker that drained the queue: starting a read runs gRPC's receive path (socket reads, the
// next message's parse) on the calling thread, and that would stall the codec.
//
//   class AppendKvReactor final : public IngestStreamReactor<v1::AppendKvRequest> {
//     ... Begin (the header), Stage (a chunk) ...
//   };
//   return new AppendKvReactor(...);   // its constructor ends with StartReading(engine, tenant)
//
// Thread-safe. Deletes itself when the call is done.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpc/support/time.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/sequence_service.pb.h"
#include "proto/status.h"
#include "server/grpc_reactor_order.h"
#include "server/ingest/append_response.h"
#include "server/ingest/ingest_append.h"
#include "server/ingest/ingest_engine.h"
#include "server/tenant.h"

namespace kvpool::server {

template <typename Request>
class IngestStreamReactor : public OrderedReactor<grpc::ServerReadReactor<Request>> {
 public:
  void OnReadDone(bool ok) override {
    AcquireFromGrpc(this);
    absl::Status error;
    bool commit = false;
    std::shared_ptr<IngestAppend> append;
    {
      absl::MutexLock lock(&mu_);
      // Answered, or an error was handed to the engine, whose end answers: read nothing more.
      if (finished_ || failing_) return;
      if (!ok) {
        if (call_->IsCancelled()) {
          error = absl::CancelledError(absl::StrCat(rpc_, " cancelled"));
        } else if (append_ == nullptr) {
          error =
              absl::InvalidArgumentError(absl::StrCat(rpc_, ": the stream ended before a header"));
        } else {
          commit = true;  // half-closed: the engine commits once every chunk is staged
        }
      } else if (append_ == nullptr) {
        absl::StatusOr<std::shared_ptr<IngestAppend>> begun = Begin(request_, Options());
        if (begun.ok()) {
          append_ = *std::move(begun);
          this->StartRead(&request_);
        } else {
          error = begun.status();
        }
      } else {
        absl::StatusOr<bool> more = Stage(request_, *append_);
        if (!more.ok()) {
          error = more.status();
        } else if (*more) {
          this->StartRead(&request_);
        } else {
          read_blocked_ = true;  // resumed by the engine, or answered by its end
        }
      }
      append = append_;
      if (!error.ok()) {
        if (append != nullptr) {
          failing_ = true;  // the engine rolls back, then its end answers
        } else {
          finished_ = true;
        }
      }
    }
    if (commit) {
      append->Commit();
    } else if (!error.ok() && append != nullptr) {
      append->Abort(error);
    } else if (!error.ok()) {
      Ended(error);
      this->Finish(ToGrpcStatus(error));
    }
  }

  void OnCancel() override {
    std::shared_ptr<IngestAppend> append;
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      append = append_;
      if (append != nullptr) failing_ = true;
    }
    // Without an append the pending read ends and answers.
    if (append != nullptr) append->Abort(absl::CancelledError(absl::StrCat(rpc_, " cancelled")));
  }

  void OnDone() override {
    AcquireFromGrpc(this);
    bool last;
    {
      absl::MutexLock lock(&link_->mu);
      link_->done = true;
      last = link_->busy == 0;  // else the engine's callback inside the reactor deletes it
    }
    if (last) delete this;
  }

 protected:
  IngestStreamReactor(grpc::CallbackServerContext* call, ::kvpool::v1::AppendKvResponse* response,
                      std::string rpc)
      : call_(call), response_(response), rpc_(std::move(rpc)), link_(std::make_shared<Link>()) {
    link_->reactor = this;
  }
  virtual ~IngestStreamReactor() = default;

  // The last step of the derived constructor: admits the stream of `tenant` on the caller's
  // connection and reads the first message, or answers the refusal.
  void StartReading(IngestEngine* engine, const TenantId& tenant) {
    std::shared_ptr<Link> link = link_;
    absl::StatusOr<std::shared_ptr<Admission::Ticket>> ticket =
        engine->Admit(tenant, call_->peer(), rpc_, [link](absl::Status why) {
          With(link, [&](IngestStreamReactor* r) { r->OnExpired(std::move(why)); });
        });
    if (!ticket.ok()) {
      {
        absl::MutexLock lock(&mu_);
        finished_ = true;
      }
      Ended(ticket.status());
      this->Finish(ToGrpcStatus(ticket.status()));
      return;
    }
    absl::MutexLock lock(&mu_);
    ticket_ = *std::move(ticket);
    this->StartRead(&request_);
  }

  // Begins the append the stream's first message describes, with `options` (the reactor's
  // callbacks; a derived class may set the queue's bounds).
  virtual absl::StatusOr<std::shared_ptr<IngestAppend>> Begin(Request& first,
                                                              IngestOptions options) = 0;
  // Hands a later message to `append`: whether reading may go on now (IngestAppend::Stage's
  // answer), or the message's error (which fails the append).
  virtual absl::StatusOr<bool> Stage(Request& message, IngestAppend& append) = 0;
  // The call ends with `status` (before it is answered).
  virtual void Ended(const absl::Status& /*status*/) {}

  grpc::CallbackServerContext* call() const { return call_; }

 private:
  // What the engine's callbacks reach the reactor through: they may come from worker threads
  // while gRPC ends the call, so the reactor is deleted by whoever leaves it last.
  struct Link {
    absl::Mutex mu;
    IngestStreamReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;
    int busy ABSL_GUARDED_BY(mu) = 0;       // callbacks running inside the reactor
    bool done ABSL_GUARDED_BY(mu) = false;  // OnDone ran: nothing more may enter
  };

  // Runs fn(reactor) unless the call is done; deletes the reactor when OnDone ran meanwhile.
  template <typename Fn>
  static void With(const std::shared_ptr<Link>& link, Fn fn) {
    IngestStreamReactor* r = nullptr;
    {
      absl::MutexLock lock(&link->mu);
      if (link->done) return;
      r = link->reactor;
      ++link->busy;
    }
    fn(r);
    bool last;
    {
      absl::MutexLock lock(&link->mu);
      last = --link->busy == 0 && link->done;
    }
    if (last) delete r;
  }

  IngestOptions Options() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    IngestOptions o;
    o.ticket = ticket_;
    std::shared_ptr<Link> link = link_;
    o.on_end = [link](absl::StatusOr<AppendResult> result) {
      With(link, [&](IngestStreamReactor* r) { r->OnEnd(std::move(result)); });
    };
    o.resume = [link] { With(link, [](IngestStreamReactor* r) { r->Resume(); }); };
    o.cancelled = [link] {
      bool cancelled = false;
      With(link, [&](IngestStreamReactor* r) { cancelled = r->call_->IsCancelled(); });
      return cancelled;
    };
    return o;
  }

  // The admission ticket expired (on its reaper thread): the append is rolled back and its end
  // answers; without an append yet, the stream answers now.
  void OnExpired(absl::Status why) {
    std::shared_ptr<IngestAppend> append;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || failing_) return;
      append = append_;
      if (append != nullptr) {
        failing_ = true;
      } else {
        finished_ = true;  // the pending read ends with the call
      }
    }
    if (append != nullptr) {
      append->Abort(std::move(why));
      return;
    }
    Ended(why);
    this->Finish(ToGrpcStatus(why));
  }

  // The engine's end of the append: the answer.
  void OnEnd(absl::StatusOr<AppendResult> result) {
    if (result.ok()) FillAppendKvResponse(*result, response_);
    Ended(result.status());
    grpc::Status answer = ToGrpcStatus(result.status());
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
      if (resume_pending_) {
        // OnDone must not run (and delete this) before the alarm's callback has: it answers.
        deferred_answer_ = std::move(answer);
        return;
      }
    }
    this->Finish(answer);
  }

  // The engine's queue drained: the read restarts on a gRPC thread.
  void Resume() {
    grpc::Alarm* alarm = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || !read_blocked_) return;
      read_blocked_ = false;
      resume_pending_ = true;
      resume_alarm_ = std::make_unique<grpc::Alarm>();
      alarm = resume_alarm_.get();
    }
    // Set once mu_ is released: gRPC may run the callback inline when it has no executor thread.
    ReleaseToGrpc(this);
    alarm->Set(gpr_now(GPR_CLOCK_MONOTONIC), [this](bool) { OnResumeRead(); });
  }

  void OnResumeRead() {
    AcquireFromGrpc(this);
    grpc::Status answer;
    {
      absl::MutexLock lock(&mu_);
      resume_pending_ = false;
      if (!finished_) {
        if (!failing_) this->StartRead(&request_);
        return;
      }
      answer = std::move(deferred_answer_);  // the end came meanwhile and left the answer here
    }
    this->Finish(answer);
  }

  grpc::CallbackServerContext* const call_;
  ::kvpool::v1::AppendKvResponse* const response_;
  const std::string rpc_;
  const std::shared_ptr<Link> link_;
  Request request_;  // written by gRPC while a read is pending
  absl::Mutex mu_;
  std::shared_ptr<IngestAppend> append_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Admission::Ticket> ticket_ ABSL_GUARDED_BY(mu_);  // the stream's, from its start
  bool read_blocked_ ABSL_GUARDED_BY(mu_) = false;  // the queue was full: no read pending
  // A read resume is scheduled on resume_alarm_ and has not run yet.
  bool resume_pending_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<grpc::Alarm> resume_alarm_ ABSL_GUARDED_BY(mu_);
  grpc::Status deferred_answer_ ABSL_GUARDED_BY(mu_);  // for OnResumeRead after finished_
  bool failing_ ABSL_GUARDED_BY(mu_) = false;   // an error went to the engine; its end answers
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // answered (or the answer is deferred)
};

}  // namespace kvpool::server
