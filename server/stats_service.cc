#include "server/stats_service.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/build_info.h"
#include "proto/api_version.h"
#include "server/connection_listener.h"
#include "server/ingest/ingest_engine.h"
#include "server/scaleout/ownership_guard.h"
#include "server/transport/transport.h"

namespace kvpool::server {

const char* KvpoolVersion() {
  static const std::string kVersion = absl::StrCat("kvpoold ", ThisBuild().version);
  return kVersion.c_str();
}

void FillBuildInfo(v1::BuildInfo* out) {
  const BuildInfo& b = ThisBuild();
  out->set_version(std::string(b.version));
  out->set_git_commit(std::string(b.git_commit));
  out->set_build_type(std::string(b.build_type));
  out->set_cuda(b.cuda);
  out->set_api_package(kApiPackage);
  out->set_api_revision(kApiRevision);
}

namespace {

// An admin or a router sees every tenant; a tenant sees only its own role and the counters.
void FillSecurityStats(const ServiceContext& ctx, const Caller& caller, v1::SecurityStats* out) {
  out->set_role(caller.role);
  out->set_unauthenticated_calls(ctx.auth.unauthenticated.load());
  out->set_permission_denied_calls(ctx.auth.permission_denied.load());
  uint64_t foreign = 0;
  for (const Transport* t : ctx.transports) foreign += t->Stats().connections_refused;
  out->set_foreign_session_attempts(foreign);
  if (ctx.tenants == nullptr) return;
  out->set_tenants_file(true);
  out->set_tenants_reloads(ctx.tenants->reloads());
  out->set_tenants_reload_failures(ctx.tenants->reload_failures());
  if (caller.role != v1::ROLE_ADMIN && caller.role != v1::ROLE_ROUTER) return;
  for (const TenantIdentity& t : ctx.tenants->current()->tenants()) {
    v1::TenantStats* ts = out->add_tenants();
    ts->set_name(t.name);
    ts->set_role(t.role);
  }
}

void FillMembershipStats(const OwnershipGuard& guard, v1::MembershipStats* out) {
  const std::shared_ptr<const Membership> members = guard.membership();
  out->set_advertise(guard.advertise());
  out->set_epoch(members->epoch_hex());
  for (const Member& m : members->members()) {
    if (m.endpoint == guard.advertise()) out->set_weight(m.weight);
    v1::MemberStats* row = out->add_members();
    row->set_endpoint(m.endpoint);
    row->set_weight(m.weight);
  }
}

}  // namespace

std::vector<TenantId> TenantRowsVisibleTo(const Caller& caller,
                                          const std::vector<TenantId>& known) {
  if (caller.role != v1::ROLE_ADMIN && caller.role != v1::ROLE_ROUTER) return {caller.tenant};
  std::vector<TenantId> all = known;
  all.push_back(caller.tenant);
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  return all;
}

v1::TenantUsage TenantUsageOf(const ServiceContext& ctx, const TenantId& tenant) {
  v1::TenantUsage row;
  row.set_tenant(tenant);
  const AccountUsage usage = ctx.pool->UsageOf(tenant);
  row.set_pool_bytes(usage.bytes());
  row.set_bf16_bytes(usage.tier_bytes[static_cast<int>(PageTier::kBf16)]);
  row.set_int2_bytes(usage.tier_bytes[static_cast<int>(PageTier::kInt2)]);
  row.set_sequences(ctx.store->SequencesOf(tenant));
  row.set_models(ctx.registry->CountOf(tenant));
  if (ctx.quotas != nullptr) {
    const TenantQuota q = ctx.quotas->Get(tenant);
    v1::TenantQuota* out = row.mutable_quota();
    out->set_pool_bytes(q.pool_bytes);
    out->set_sequences(q.sequences);
    out->set_models(q.models);
    out->set_guaranteed_pool_bytes(q.guaranteed_pool_bytes);
    out->set_compute_weight(q.compute_weight);
    const QuotaRejections r = ctx.quotas->Rejections(tenant);
    row.set_rejected_pool_bytes(r.pool_bytes);
    row.set_rejected_sequences(r.sequences);
    row.set_rejected_models(r.models);
  }
  const FairFlowStats work = ctx.workers->TenantStats(tenant);
  row.set_queued_tasks(work.queued);
  row.set_queued_units(work.queued_units);
  row.set_served_tasks(work.served);
  row.set_served_units(work.served_units);
  return row;
}

grpc::ServerUnaryReactor* StatsServiceImpl::GetStats(grpc::CallbackServerContext* context,
                                                     const v1::GetStatsRequest* request,
                                                     v1::GetStatsResponse* response) {
  Collect(CallerOf(*ctx_, context), request, response);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

void StatsServiceImpl::Collect(const Caller& caller, const v1::GetStatsRequest* request,
                               v1::GetStatsResponse* response) const {
  const TenantId& tenant = caller.tenant;
  response->set_tenant(tenant);
  FillSecurityStats(*ctx_, caller, response->mutable_security());
  const BlockPoolStats pool = ctx_->pool->Stats();
  const PrefixIndexStats index = ctx_->index->Stats();
  v1::PoolStats* p = response->mutable_pool();
  p->set_capacity_bytes(pool.capacity_bytes);
  p->set_used_bytes(pool.used_bytes);
  p->set_free_bytes(pool.capacity_bytes - pool.used_bytes);
  p->set_cached_bytes(index.cached_bytes);
  p->set_shared_bytes(pool.shared_bytes);
  p->set_slab_bytes(pool.slab_bytes);
  p->set_slabs_in_use(pool.slabs_in_use);
  p->set_slabs_total(pool.slabs_total);
  p->set_unassigned_bytes((pool.slabs_total - pool.slabs_in_use) * pool.slab_bytes);
  for (const PageClassStats& c : pool.classes) {
    v1::PageClassStats* out = p->add_classes();
    out->set_page_bytes(c.page_bytes);
    out->set_pages_in_use(c.pages_in_use);
    out->set_bytes_in_use(c.page_bytes * c.pages_in_use);
  }
  p->set_evicted_units(index.evicted_units);
  p->set_prefix_units(index.units);
  p->set_prefix_lookups(index.lookups);
  p->set_prefix_lookup_tokens(index.lookup_tokens);
  p->set_prefix_hit_tokens(index.hit_tokens);

  const auto totals = ctx_->store->TotalsByModel(tenant);
  for (const auto& m : ctx_->registry->List(tenant)) {
    v1::ModelStats* out = response->add_models();
    out->set_model_id(m->id);
    out->set_codec_version(m->version_hex);
    auto it = totals.find(m->id);
    if (it == totals.end()) continue;
    out->set_sequences(it->second.sequences);
    out->set_sink_tokens(it->second.sink_tokens);
    out->set_history_tokens(it->second.history_tokens);
    out->set_recent_tokens(it->second.recent_tokens);
    out->set_pool_bytes(it->second.pool_bytes);
    out->set_bf16_equivalent_bytes(it->second.bf16_equivalent_bytes);
  }

  if (ctx_->drain != nullptr) FillServingState(*ctx_->drain, response->mutable_serving());

  v1::ServiceStats* s = response->mutable_service();
  s->set_uptime_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - ctx_->started).count());
  s->set_backend(std::string(ctx_->backend->name()));
  s->set_worker_threads(ctx_->workers->threads());
  s->set_worker_queue_depth(ctx_->workers->queue_depth());
  s->set_worker_queue_capacity(ctx_->workers->queue_capacity());
  s->set_rejected_busy(ctx_->workers->rejected());
  s->set_ingested_bytes(ctx_->ingest->counters().ingested_bytes.load());
  s->set_ingested_tokens(ctx_->ingest->counters().ingested_tokens.load());
  s->set_attention_calls(ctx_->counters.attention_calls.load());
  s->set_attention_sequences(ctx_->counters.attention_sequences.load());
  s->set_version(KvpoolVersion());
  FillBuildInfo(response->mutable_build());
  const BackendTimes times = ctx_->backend->times();
  s->set_arrival_device_seconds(times.arrival_seconds);
  s->set_attention_device_seconds(times.attention_seconds);

  v1::LifecycleStats* life = response->mutable_lifecycle();
  life->set_calls_cancelled(ctx_->counters.cancellation.calls_cancelled.load());
  life->set_units_skipped(ctx_->counters.cancellation.units_skipped.load());
  life->set_expired_sequences(ctx_->store->expired_sequences());
  life->set_leased_sequences(ctx_->store->leased_sequences());
  life->set_sequence_ttl_seconds(absl::ToDoubleSeconds(ctx_->store->default_ttl()));

  const ServerConfig& cfg = *ctx_->config;
  const IntegrityCounters& ic = ctx_->store->integrity();
  v1::IntegrityStats* integrity = response->mutable_integrity();
  integrity->set_corrupt_sequences(ic.corrupt_sequences.load());
  integrity->set_pages_scrubbed(ic.pages_scrubbed.load());
  integrity->set_bytes_scrubbed(ic.bytes_scrubbed.load());
  integrity->set_sweeps_completed(ic.sweeps_completed.load());
  integrity->set_corrupt_prefix_units(ic.corrupt_prefix_units.load());
  integrity->set_prefix_units_dropped(ic.prefix_units_dropped.load());
  integrity->set_scrub_period_seconds(absl::ToDoubleSeconds(cfg.scrub_period));
  integrity->set_scrub_max_bytes_per_second(cfg.scrub_max_bytes_per_second);

  v1::DeviceStats* device = response->mutable_device();
  const absl::Status health = ctx_->backend->DeviceHealth();
  device->set_healthy(health.ok());
  device->set_error(std::string(health.message()));
  device->set_calls_refused(ctx_->backend->calls_refused());

  if (ctx_->ownership != nullptr && ctx_->ownership->enabled()) {
    FillMembershipStats(*ctx_->ownership, response->mutable_membership());
  }

  v1::ServerLimits* l = response->mutable_limits();
  l->set_max_message_bytes(cfg.max_message_bytes);
  l->set_max_chunk_bytes(cfg.max_chunk_bytes);
  l->set_max_rotation_file_bytes(cfg.max_rotation_file_bytes);
  l->set_max_attention_batch(cfg.max_attention_batch);
  l->set_max_append_tokens(cfg.max_append_tokens);
  l->set_max_connections(static_cast<uint32_t>(ctx_->max_connections));
  l->set_max_streams_per_connection(static_cast<uint32_t>(cfg.max_streams_per_connection));
  l->set_max_streams_per_tenant(static_cast<uint32_t>(cfg.max_streams_per_tenant));
  l->set_max_reserved_bytes_per_connection(cfg.max_reserved_bytes_per_connection);
  l->set_max_reserved_bytes_per_tenant(cfg.max_reserved_bytes_per_tenant);
  l->set_stream_idle_timeout_ms(static_cast<uint32_t>(cfg.stream_idle_timeout_ms));
  l->set_stream_total_timeout_ms(static_cast<uint32_t>(cfg.stream_total_timeout_ms));
  if (const Admission* admission = ctx_->ingest->admission(); admission != nullptr) {
    const AdmissionCounters ac = admission->Counters();
    v1::AdmissionStats* a = response->mutable_admission();
    a->set_open_streams(ac.open_streams);
    a->set_reserved_bytes(ac.reserved_bytes);
    a->set_refused(ac.refused);
    a->set_expired_idle(ac.expired_idle);
    a->set_expired_total(ac.expired_total);
    a->set_open_reads(ac.open_reads);
    a->set_read_bytes(ac.read_bytes);
    const AdmissionLimits& al = admission->limits();
    a->set_max_reads_per_connection(static_cast<uint32_t>(al.max_reads_per_connection));
    a->set_max_reads_per_tenant(static_cast<uint32_t>(al.max_reads_per_tenant));
    a->set_max_read_bytes_per_connection(al.max_read_bytes_per_connection);
    a->set_max_read_bytes_per_tenant(al.max_read_bytes_per_tenant);
  }
  if (ctx_->listener != nullptr) {
    const ConnectionStats cs = ctx_->listener->Stats();
    v1::ConnectionStats* c = response->mutable_connections();
    c->set_open(cs.open);
    c->set_accepted(cs.accepted);
    c->set_refused_at_cap(cs.refused_at_cap);
    c->set_refused_no_descriptors(cs.refused_no_descriptors);
  }

  v1::TransportStats* t = response->mutable_transport();
  for (const Transport* tr : ctx_->transports) {
    t->add_available(std::string(tr->name()));
    const TransportStats ts = tr->Stats();
    if (tr->capabilities().kind == TransportKind::kUcx) t->set_ucx_transports(ts.transports);
    t->set_sessions(t->sessions() + ts.sessions);
    t->set_open_pushes(t->open_pushes() + ts.open_pushes);
    t->set_staging_bytes_in_use(t->staging_bytes_in_use() + ts.staging_bytes_in_use);
    t->set_staging_capacity_bytes(t->staging_capacity_bytes() + ts.staging_capacity_bytes);
    t->set_pending_messages(t->pending_messages() + ts.pending_messages);
    t->set_pushes_committed(t->pushes_committed() + ts.pushes_committed);
    t->set_pushes_aborted(t->pushes_aborted() + ts.pushes_aborted);
    t->set_peer_errors(t->peer_errors() + ts.peer_errors);
    t->set_timeouts(t->timeouts() + ts.timeouts);
    t->set_bytes_received(t->bytes_received() + ts.bytes_received);
    t->set_attention_calls(t->attention_calls() + ts.attention_calls);
    t->set_connections_refused(t->connections_refused() + ts.connections_refused);
  }

  if (request->include_sequences()) {
    for (const SequenceInfo& info : ctx_->store->List(tenant)) {
      v1::SequenceStats* out = response->add_sequences();
      out->set_sequence_id(info.id);
      out->set_model_id(info.model_id);
      out->set_total_tokens(info.total());
      out->set_pool_bytes(info.pool_bytes);
      out->set_ttl_ms(absl::ToInt64Milliseconds(info.ttl));
      out->set_idle_ms(absl::ToInt64Milliseconds(info.idle));
    }
  }
  response->set_tenant(tenant);
  response->set_quota_bytes(ctx_->quotas != nullptr ? ctx_->quotas->Get(tenant).pool_bytes : 0);
  // Every tenant with quotas or named in the tenants file (for a caller allowed to see them).
  std::vector<TenantId> known =
      ctx_->quotas != nullptr ? ctx_->quotas->Tenants() : std::vector<TenantId>{};
  if (ctx_->tenants != nullptr) {
    for (const TenantIdentity& t : ctx_->tenants->current()->tenants()) known.push_back(t.name);
  }
  for (const TenantId& t : TenantRowsVisibleTo(caller, known)) {
    *response->add_tenants() = TenantUsageOf(*ctx_, t);
  }
}

}  // namespace kvpool::server
