// RenderMetricsPage: the daemon's Prometheus page. Every number GetStats reports comes from
// StatsServiceImpl::Collect, the function GetStats answers with, so a counter here equals the
// GetStats field it names; per-transport series read the same Transport::Stats() that GetStats
// sums. RPC latency histograms come from RpcLatency (the server interceptor).
//
//   std::string page = RenderMetricsPage(sources, /*tenant_labels=*/false);
//
// Without tenant labels the per-model series add up every tenant's models of that id; with
// them (--metrics_tenant_labels) each tenant's models are a series of their own with a
// `tenant` label, and each tenant's quota appears. docs/observability.md lists the series.
#pragma once

#include <string>

#include "server/codec_health.h"
#include "server/events/kv_event_hub.h"
#include "server/metrics/rpc_latency.h"
#include "server/service_context.h"
#include "server/stats_service.h"

namespace kvpool::server {

struct MetricsSources {
  const ServiceContext* ctx = nullptr;
  const StatsServiceImpl* stats = nullptr;
  const RpcLatency* latency = nullptr;
  const RpcLatency* attend_latency = nullptr;  // by batch bucket
  const KvEventHub* kv_events = nullptr;
  CodecHealth* codec_health = nullptr;
};

std::string RenderMetricsPage(const MetricsSources& sources, bool tenant_labels);

}  // namespace kvpool::server
