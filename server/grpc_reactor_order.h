// Tells ThreadSanitizer the order gRPC's callback API guarantees for a server reactor: a reaction
// (OnReadDone, OnWriteDone, an alarm's callback, OnDone) runs after the StartRead / StartWrite /
// Finish / Alarm::Set it answers, and OnDone after everything else. gRPC orders them inside
// libgrpc, which Debian does not build with TSan, so without these calls a TSan build reports
// the reactor's own fields as raced between the thread that started an operation and the one
// gRPC runs the reaction on. Outside TSan builds both are empty.
//
//   class MyReactor final : public OrderedReactor<grpc::ServerWriteReactor<v1::Foo>> {
//     // StartRead / StartWrite / Finish now release to gRPC first.
//     void OnWriteDone(bool ok) override {
//       AcquireFromGrpc(this);           // first thing in every reaction
//       ...
//     }
//   };
//   ReleaseToGrpc(this);                 // before anything else gRPC answers later (Alarm::Set)
//
// Use them only in reactors with one operation in flight at a time (one address orders all of
// them); thread-safe.
#pragma once

#include <utility>

#include "grpcpp/grpcpp.h"

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace kvpool::server {

inline void ReleaseToGrpc(const void* reactor) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(const_cast<void*>(reactor));
#else
  (void)reactor;
#endif
}

inline void AcquireFromGrpc(const void* reactor) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(const_cast<void*>(reactor));
#else
  (void)reactor;
#endif
}

// A server reactor (grpc::ServerReadReactor<Req> or grpc::ServerWriteReactor<Resp>) whose
// StartRead, StartWrite and Finish call ReleaseToGrpc(this) first. They hide the base's
// functions of the same names; reactions still call AcquireFromGrpc(this) themselves.
template <typename Reactor>
class OrderedReactor : public Reactor {
 protected:
  template <typename... Args>
  void StartRead(Args&&... args) {
    ReleaseToGrpc(this);
    Reactor::StartRead(std::forward<Args>(args)...);
  }
  template <typename... Args>
  void StartWrite(Args&&... args) {
    ReleaseToGrpc(this);
    Reactor::StartWrite(std::forward<Args>(args)...);
  }
  void Finish(grpc::Status status) {
    ReleaseToGrpc(this);
    Reactor::Finish(std::move(status));
  }
};

}  // namespace kvpool::server
