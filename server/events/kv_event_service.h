// KvEventServiceImpl: the kvpool.v1.KvEventService gRPC service (proto/kvpool/v1/
// kv_event_service.proto): one server-streaming call per subscriber, fed by the KvEventHub
// through a queue of at most `buffer` live events; a subscriber that falls that far behind ends
// with RESOURCE_EXHAUSTED, reason LIMIT.
//
//   KvEventServiceImpl events(&ctx, &hub, config.kv_events_buffer);
//   builder.RegisterService(&events);
//
// Thread-safe.
#pragma once

#include <cstdint>

#include "kvpool/v1/kv_event_service.grpc.pb.h"
#include "server/events/kv_event_hub.h"
#include "server/service_context.h"

namespace kvpool::server {

class KvEventServiceImpl final : public ::kvpool::v1::KvEventService::CallbackService {
 public:
  KvEventServiceImpl(const ServiceContext* ctx, KvEventHub* hub, uint32_t buffer)
      : ctx_(ctx), hub_(hub), buffer_(buffer) {}

  grpc::ServerWriteReactor<::kvpool::v1::KvEvent>* SubscribeKvEvents(
      grpc::CallbackServerContext* context,
      const ::kvpool::v1::SubscribeKvEventsRequest* request) override;

 private:
  const ServiceContext* const ctx_;
  KvEventHub* const hub_;
  const uint32_t buffer_;
};

}  // namespace kvpool::server
