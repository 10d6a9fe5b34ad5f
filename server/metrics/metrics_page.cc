#include "server/metrics/metrics_page.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/metrics/prometheus_text.h"
#include "server/transport/transport.h"

namespace kvpool::server {
namespace {

namespace v1 = ::kvpool::v1;

struct ModelTotals {
  uint64_t sequences = 0;
  uint64_t sink_tokens = 0;
  uint64_t history_tokens = 0;
  uint64_t recent_tokens = 0;
  uint64_t pool_bytes = 0;
  uint64_t bf16_equivalent_bytes = 0;
};

void Add(const v1::ModelStats& m, ModelTotals* t) {
  t->sequences += m.sequences();
  t->sink_tokens += m.sink_tokens();
  t->history_tokens += m.history_tokens();
  t->recent_tokens += m.recent_tokens();
  t->pool_bytes += m.pool_bytes();
  t->bf16_equivalent_bytes += m.bf16_equivalent_bytes();
}

// Gauge or counter family with one unlabelled sample.
void One(PrometheusText& out, absl::string_view name, absl::string_view type,
         absl::string_view help, uint64_t value) {
  out.Family(name, type, help);
  out.Sample(name, {}, value);
}

// Scale-out (docs/scale-out.md): how many members this daemon sees and under which epoch.
void RenderMembership(const v1::MembershipStats& m, PrometheusText& out) {
  One(out, "kvpool_scaleout_members", "gauge",
      "Live members of the scale-out membership this daemon sees, itself included.",
      static_cast<uint64_t>(m.members_size()));
  out.Family("kvpool_scaleout_epoch_info", "gauge",
             "The membership epoch this daemon checks ownership under (always 1).");
  out.Sample("kvpool_scaleout_epoch_info", {{"epoch", m.epoch()}}, uint64_t{1});
}

void RenderPool(const v1::GetStatsResponse& r, absl::string_view tier, PrometheusText& out) {
  const v1::PoolStats& p = r.pool();
  out.Family("kvpool_pool_capacity_bytes", "gauge",
             "Size of the block pool arena (tier: gpu for a pool in GPU memory, else host).");
  out.Sample("kvpool_pool_capacity_bytes", {{"tier", tier}}, p.capacity_bytes());
  out.Family("kvpool_pool_bytes", "gauge",
             "Pool bytes by state: used (pages handed out), free, cached (held only by the prefix "
             "index, evictable), shared (referenced more than once), unassigned (slabs of no "
             "page class).");
  const std::pair<absl::string_view, uint64_t> states[] = {{"used", p.used_bytes()},
                                                           {"free", p.free_bytes()},
                                                           {"cached", p.cached_bytes()},
                                                           {"shared", p.shared_bytes()},
                                                           {"unassigned", p.unassigned_bytes()}};
  for (const auto& [state, bytes] : states) {
    out.Sample("kvpool_pool_bytes", {{"tier", tier}, {"state", state}}, bytes);
  }
  out.Family("kvpool_pool_slabs", "gauge",
             "Allocator slabs: in_use (assigned to a page class), total.");
  out.Sample("kvpool_pool_slabs", {{"tier", tier}, {"state", "in_use"}}, p.slabs_in_use());
  out.Sample("kvpool_pool_slabs", {{"tier", tier}, {"state", "total"}}, p.slabs_total());
  out.Family("kvpool_pool_page_class_bytes", "gauge", "Bytes handed out per page size class.");
  for (const v1::PageClassStats& c : p.classes()) {
    const std::string page_bytes = absl::StrCat(c.page_bytes());
    out.Sample("kvpool_pool_page_class_bytes", {{"tier", tier}, {"page_bytes", page_bytes}},
               c.bytes_in_use());
  }
  One(out, "kvpool_prefix_units", "gauge", "Units (sink or INT2 block) in the prefix index.",
      p.prefix_units());
  One(out, "kvpool_prefix_evicted_units_total", "counter",
      "Prefix units evicted (least recently used) to make room.", p.evicted_units());
  One(out, "kvpool_prefix_lookups_total", "counter",
      "Prefix lookups (LookupPrefix, and sequences created from token ids).", p.prefix_lookups());
  One(out, "kvpool_prefix_lookup_tokens_total", "counter",
      "Tokens the complete units of every prefix lookup covered.", p.prefix_lookup_tokens());
  One(out, "kvpool_prefix_hit_tokens_total", "counter", "Tokens prefix lookups found in the index.",
      p.prefix_hit_tokens());
}

void RenderModels(const std::vector<std::pair<TenantId, v1::GetStatsResponse>>& per_tenant,
                  bool tenant_labels, PrometheusText& out) {
  // (tenant or "", model) -> totals; without tenant labels every tenant adds to "".
  std::map<std::pair<std::string, std::string>, ModelTotals> models;
  for (const auto& [tenant, r] : per_tenant) {
    for (const v1::ModelStats& m : r.models()) {
      Add(m, &models[{tenant_labels ? tenant : std::string(), m.model_id()}]);
    }
  }
  auto labels = [&](const std::pair<std::string, std::string>& key) {
    MetricLabels l;
    if (tenant_labels) l.emplace_back("tenant", key.first);
    l.emplace_back("model", key.second);
    return l;
  };
  out.Family("kvpool_model_sequences", "gauge", "Live sequences per model.");
  for (const auto& [key, t] : models)
    out.Sample("kvpool_model_sequences", labels(key), t.sequences);
  out.Family("kvpool_model_tokens", "gauge",
             "Stored tokens per model (per layer) by tier: sink (BF16), history (INT2 blocks), "
             "recent (BF16 window).");
  for (const auto& [key, t] : models) {
    const std::pair<absl::string_view, uint64_t> tiers[] = {
        {"sink", t.sink_tokens}, {"history", t.history_tokens}, {"recent", t.recent_tokens}};
    for (const auto& [tier, tokens] : tiers) {
      MetricLabels l = labels(key);
      l.emplace_back("tier", tier);
      out.Sample("kvpool_model_tokens", l, tokens);
    }
  }
  out.Family("kvpool_model_pool_bytes", "gauge",
             "Pool bytes of a model's sequences and cached units (shared pages counted once).");
  for (const auto& [key, t] : models)
    out.Sample("kvpool_model_pool_bytes", labels(key), t.pool_bytes);
  out.Family("kvpool_model_bf16_equivalent_bytes", "gauge", "Dense BF16 bytes of the same tokens.");
  for (const auto& [key, t] : models) {
    out.Sample("kvpool_model_bf16_equivalent_bytes", labels(key), t.bf16_equivalent_bytes);
  }
  out.Family("kvpool_model_compression_ratio", "gauge",
             "BF16-equivalent bytes over pool bytes, per model holding any.");
  for (const auto& [key, t] : models) {
    if (t.pool_bytes == 0) continue;
    out.Sample("kvpool_model_compression_ratio", labels(key),
               static_cast<double>(t.bf16_equivalent_bytes) / static_cast<double>(t.pool_bytes));
  }
  if (!tenant_labels) return;
  out.Family("kvpool_tenant_quota_bytes", "gauge", "A tenant's pool quota (0 = unlimited).");
  for (const auto& [tenant, r] : per_tenant) {
    out.Sample("kvpool_tenant_quota_bytes", {{"tenant", tenant}}, r.quota_bytes());
  }
}

void RenderService(const v1::GetStatsResponse& r, PrometheusText& out) {
  const v1::ServiceStats& s = r.service();
  const v1::BuildInfo& b = r.build();
  const std::string api = absl::StrCat(b.api_package(), ".", b.api_revision());
  out.Family("kvpool_build_info", "gauge",
             "The daemon's version, build, API version and compute backend.");
  out.Sample("kvpool_build_info",
             {{"version", s.version()},
              {"backend", s.backend()},
              {"git_commit", b.git_commit()},
              {"build_type", b.build_type()},
              {"cuda", b.cuda() ? "true" : "false"},
              {"api", api}},
             uint64_t{1});
  out.Family("kvpool_uptime_seconds", "gauge", "Seconds since the daemon started.");
  out.Sample("kvpool_uptime_seconds", {}, s.uptime_seconds());
  One(out, "kvpool_worker_threads", "gauge", "Worker threads for codec math.", s.worker_threads());
  One(out, "kvpool_worker_queue_depth", "gauge", "Tasks waiting for a worker.",
      s.worker_queue_depth());
  One(out, "kvpool_worker_queue_capacity", "gauge", "Tasks that may wait for a worker.",
      s.worker_queue_capacity());
  One(out, "kvpool_rejected_busy_total", "counter",
      "Requests refused because the worker queue was full.", s.rejected_busy());
  One(out, "kvpool_ingested_bytes_total", "counter",
      "BF16-equivalent K/V bytes appended, over every transport.", s.ingested_bytes());
  One(out, "kvpool_ingested_tokens_total", "counter", "Tokens appended (per layer).",
      s.ingested_tokens());
  One(out, "kvpool_attention_calls_total", "counter",
      "Remote attention calls, over every transport.", s.attention_calls());
  One(out, "kvpool_attention_sequences_total", "counter", "Sequences attended.",
      s.attention_sequences());
  out.Family("kvpool_device_seconds_total", "counter",
             "Device kernel time (CUDA backend; 0 on the CPU) by phase.");
  out.Sample("kvpool_device_seconds_total", {{"phase", "arrival"}}, s.arrival_device_seconds());
  out.Sample("kvpool_device_seconds_total", {{"phase", "attention"}}, s.attention_device_seconds());

  const v1::AdmissionStats& a = r.admission();
  One(out, "kvpool_admission_open_streams", "gauge", "Streams holding an admission ticket.",
      a.open_streams());
  One(out, "kvpool_admission_reserved_bytes", "gauge", "Pool bytes reserved by in-flight appends.",
      a.reserved_bytes());
  One(out, "kvpool_admission_open_reads", "gauge",
      "ReadKv/ReadBlocks/Attend calls holding a read ticket.", a.open_reads());
  One(out, "kvpool_admission_read_bytes", "gauge", "Response bytes those calls hold in flight.",
      a.read_bytes());
  One(out, "kvpool_admission_refused_total", "counter",
      "Streams or reservations refused over a cap (RESOURCE_EXHAUSTED, reason LIMIT).",
      a.refused());
  out.Family("kvpool_admission_expired_total", "counter",
             "Streams ended by their idle or total timeout.");
  out.Sample("kvpool_admission_expired_total", {{"timeout", "idle"}}, a.expired_idle());
  out.Sample("kvpool_admission_expired_total", {{"timeout", "total"}}, a.expired_total());

  const v1::ConnectionStats& c = r.connections();
  One(out, "kvpool_connections_open", "gauge", "Client connections of the gRPC port held.",
      c.open());
  One(out, "kvpool_connections_accepted_total", "counter", "Connections handed to gRPC.",
      c.accepted());
  out.Family("kvpool_connections_refused_total", "counter",
             "Connections refused: at_cap (max_connections open), no_descriptors.");
  out.Sample("kvpool_connections_refused_total", {{"reason", "at_cap"}}, c.refused_at_cap());
  out.Sample("kvpool_connections_refused_total", {{"reason", "no_descriptors"}},
             c.refused_no_descriptors());

  const v1::IntegrityStats& i = r.integrity();
  One(out, "kvpool_corrupt_sequences_total", "counter",
      "Sequences found holding a page that failed its checksum.", i.corrupt_sequences());
  One(out, "kvpool_scrubbed_pages_total", "counter", "Pages the scrubber verified.",
      i.pages_scrubbed());
  One(out, "kvpool_scrubbed_bytes_total", "counter", "Bytes the scrubber read.",
      i.bytes_scrubbed());
  One(out, "kvpool_scrub_sweeps_total", "counter", "Full scrubber sweeps.", i.sweeps_completed());
  One(out, "kvpool_corrupt_prefix_units_total", "counter",
      "Prefix-cache units the scrubber found with a page that failed its checksum.",
      i.corrupt_prefix_units());
  One(out, "kvpool_corrupt_prefix_units_dropped_total", "counter",
      "Prefix-cache units dropped for a failed checksum (with the units chained after them).",
      i.prefix_units_dropped());

  const v1::LifecycleStats& l = r.lifecycle();
  One(out, "kvpool_cancelled_calls_total", "counter",
      "Attend/ReadKv/ReadBlocks calls stopped because the caller went away.", l.calls_cancelled());
  One(out, "kvpool_cancelled_units_total", "counter", "Units of work those calls skipped.",
      l.units_skipped());
  One(out, "kvpool_expired_sequences_total", "counter", "Sequences released by their lease.",
      l.expired_sequences());
  One(out, "kvpool_leased_sequences", "gauge", "Sequences holding a lease.", l.leased_sequences());
}

void RenderTransports(const ServiceContext& ctx, PrometheusText& out) {
  std::vector<std::pair<std::string, TransportStats>> stats;
  for (const Transport* t : ctx.transports) stats.emplace_back(std::string(t->name()), t->Stats());
  auto family = [&](absl::string_view name, absl::string_view type, absl::string_view help,
                    auto value) {
    out.Family(name, type, help);
    for (const auto& [transport, s] : stats) {
      out.Sample(name, {{"transport", transport}}, static_cast<uint64_t>(value(s)));
    }
  };
  family("kvpool_transport_sessions", "gauge", "Open data-plane sessions.",
         [](const TransportStats& s) { return s.sessions; });
  family("kvpool_transport_open_pushes", "gauge", "Layer-wise pushes in flight.",
         [](const TransportStats& s) { return s.open_pushes; });
  family("kvpool_transport_staging_bytes_in_use", "gauge", "Staging memory in use.",
         [](const TransportStats& s) { return s.staging_bytes_in_use; });
  family("kvpool_transport_staging_capacity_bytes", "gauge", "Staging memory.",
         [](const TransportStats& s) { return s.staging_capacity_bytes; });
  family("kvpool_transport_pending_messages", "gauge", "Messages waiting for a staging slot.",
         [](const TransportStats& s) { return s.pending_messages; });
  family("kvpool_transport_pushes_committed_total", "counter", "Pushes committed.",
         [](const TransportStats& s) { return s.pushes_committed; });
  family("kvpool_transport_pushes_aborted_total", "counter", "Pushes rolled back.",
         [](const TransportStats& s) { return s.pushes_aborted; });
  family("kvpool_transport_peer_errors_total", "counter", "Peers that failed.",
         [](const TransportStats& s) { return s.peer_errors; });
  family("kvpool_transport_timeouts_total", "counter", "Pushes that timed out.",
         [](const TransportStats& s) { return s.timeouts; });
  family("kvpool_transport_received_bytes_total", "counter",
         "K+V payload bytes received by the data-plane transport (gRPC inline appends count in "
         "kvpool_ingested_bytes_total only).",
         [](const TransportStats& s) { return s.bytes_received; });
  family("kvpool_transport_attention_calls_total", "counter",
         "Attention calls served over the transport (gRPC Attend calls count in "
         "kvpool_attention_calls_total only).",
         [](const TransportStats& s) { return s.attention_calls; });
  family("kvpool_transport_connections_refused_total", "counter",
         "Data-plane connections refused before joining a session.",
         [](const TransportStats& s) { return s.connections_refused; });
}

// A histogram family whose series are `latency`'s, the first label named `first_label`.
void RenderLatency(const RpcLatency& latency, absl::string_view name, absl::string_view help,
                   absl::string_view first_label, PrometheusText& out) {
  out.Family(name, "histogram", help);
  const std::string bucket = absl::StrCat(name, "_bucket");
  const std::string sum = absl::StrCat(name, "_sum");
  const std::string count = absl::StrCat(name, "_count");
  for (const RpcLatencySeries& s : latency.Snapshot()) {
    uint64_t cumulative = 0;
    for (size_t b = 0; b < kRpcLatencyBuckets.size(); ++b) {
      cumulative += s.buckets[b];
      const std::string le = absl::StrCat(kRpcLatencyBuckets[b]);
      out.Sample(bucket, {{first_label, s.method}, {"code", s.code}, {"le", le}}, cumulative);
    }
    out.Sample(bucket, {{first_label, s.method}, {"code", s.code}, {"le", "+Inf"}}, s.count);
    out.Sample(sum, {{first_label, s.method}, {"code", s.code}}, s.sum_seconds);
    out.Sample(count, {{first_label, s.method}, {"code", s.code}}, s.count);
  }
}

void RenderCodecHealth(const ServiceContext& ctx, CodecHealth* health, bool tenant_labels,
                       const std::vector<TenantId>& tenants, PrometheusText& out) {
  std::set<std::pair<TenantId, std::string>> live;
  for (const TenantId& t : tenants) {
    for (const auto& m : ctx.registry->List(t)) live.emplace(t, m->id);
  }
  // (tenant or "", model, layer, key) -> sums over tenants without tenant labels.
  std::map<std::tuple<std::string, std::string, int, bool>, CodecHealthSeries> series;
  for (const CodecHealthSeries& s : health->Snapshot(live)) {
    CodecHealthSeries& t =
        series[{tenant_labels ? s.tenant : std::string(), s.model_id, s.layer, s.key}];
    t.rows += s.rows;
    t.clip_energy += s.clip_energy;
    t.error_energy += s.error_energy;
    t.signal_energy += s.signal_energy;
  }
  struct Field {
    const char* name;
    const char* help;
    double CodecHealthSeries::*value;
  };
  out.Family("kvpool_codec_health_rows_total", "counter",
             "Arriving head rows re-encoded on the side for codec health (every "
             "--codec_health_sample_every-th chunk).");
  const Field fields[] = {
      {"kvpool_codec_health_clip_energy_total",
       "Energy the clip removed from the sampled rotated rows: sum of (|x| - tau)^2.",
       &CodecHealthSeries::clip_energy},
      {"kvpool_codec_health_error_energy_total",
       "Squared error of the sampled rows after encode and decode: sum of (x - x_hat)^2.",
       &CodecHealthSeries::error_energy},
      {"kvpool_codec_health_signal_energy_total",
       "Energy of the sampled rotated rows: sum of x^2 (divide the two above by it).",
       &CodecHealthSeries::signal_energy}};
  auto labels = [&](const auto& key, MetricLabels* l, std::string* layer) {
    const auto& [tenant, model, layer_index, is_key] = key;
    *layer = absl::StrCat(layer_index);
    if (tenant_labels) l->emplace_back("tenant", tenant);
    l->emplace_back("model", model);
    l->emplace_back("layer", *layer);
    l->emplace_back("tensor", is_key ? "k" : "v");
  };
  for (const auto& [key, s] : series) {
    MetricLabels l;
    std::string layer;
    labels(key, &l, &layer);
    out.Sample("kvpool_codec_health_rows_total", l, s.rows);
  }
  for (const Field& f : fields) {
    out.Family(f.name, "counter", f.help);
    for (const auto& [key, s] : series) {
      MetricLabels l;
      std::string layer;
      labels(key, &l, &layer);
      out.Sample(f.name, l, s.*f.value);
    }
  }
  const CodecHealthCost cost = health->Cost();
  One(out, "kvpool_codec_health_samples_total", "counter", "Chunks sampled for codec health.",
      cost.samples);
  out.Family("kvpool_codec_health_sample_seconds_total", "counter",
             "Worker time spent sampling codec health (its cost).");
  out.Sample("kvpool_codec_health_sample_seconds_total", {}, cost.seconds);
}

}  // namespace

std::string RenderMetricsPage(const MetricsSources& sources, bool tenant_labels) {
  // The default tenant first (it answers the daemon-wide sections), then every other tenant
  // with a registered model.
  std::vector<TenantId> tenants = {kDefaultTenant};
  for (TenantId& t : sources.ctx->registry->Tenants()) {
    if (t != kDefaultTenant) tenants.push_back(std::move(t));
  }
  std::vector<std::pair<TenantId, v1::GetStatsResponse>> per_tenant;
  const v1::GetStatsRequest request;
  for (const TenantId& t : tenants) {
    per_tenant.emplace_back(t, v1::GetStatsResponse());
    sources.stats->Collect(Caller{t, v1::ROLE_TENANT}, &request, &per_tenant.back().second);
  }
  const v1::GetStatsResponse& daemon = per_tenant.front().second;
  const absl::string_view tier =
      absl::StartsWith(daemon.service().backend(), "cuda") ? "gpu" : "host";

  PrometheusText out;
  RenderPool(daemon, tier, out);
  RenderModels(per_tenant, tenant_labels, out);
  RenderService(daemon, out);
  if (!daemon.membership().advertise().empty()) RenderMembership(daemon.membership(), out);
  RenderTransports(*sources.ctx, out);
  // The drain (docs/operations.md): 1 from its start until the daemon exits.
  One(out, "kvpool_draining", "gauge", "1 while the daemon drains (SIGTERM or AdminService.Drain).",
      daemon.serving().state() == v1::ServingState::DRAINING ? 1 : 0);
  One(out, "kvpool_in_flight_calls", "gauge",
      "Calls in flight that a drain waits for (GetStats serving.in_flight_calls).",
      daemon.serving().in_flight_calls());
  if (sources.kv_events != nullptr) {
    One(out, "kvpool_kv_event_subscribers", "gauge", "KvEventService subscribers fed now.",
        sources.kv_events->subscribers());
    One(out, "kvpool_kv_event_subscribers_dropped_total", "counter",
        "KvEventService subscribers dropped for falling --kv_events_buffer events behind.",
        sources.kv_events->dropped());
  }
  if (sources.codec_health != nullptr) {
    RenderCodecHealth(*sources.ctx, sources.codec_health, tenant_labels, tenants, out);
  }
  if (sources.latency != nullptr) {
    RenderLatency(*sources.latency, "kvpool_rpc_duration_seconds",
                  "gRPC calls served, from arrival to the status sent, by method and status code.",
                  "method", out);
  }
  if (sources.attend_latency != nullptr) {
    RenderLatency(*sources.attend_latency, "kvpool_attend_duration_seconds",
                  "Remote attention (gRPC Attend) calls by batch size (sequences) and status code.",
                  "batch", out);
  }
  return out.Take();
}

}  // namespace kvpool::server
