"""The metrics port of a real kvpoold: Prometheus text that prometheus_client parses, every
counter equal to the GetStats field it names (read in a quiet moment), RPC latency histograms
per method and status code that count exactly the calls made, tenant labels only on request,
nothing served but /metrics."""

from __future__ import annotations

import socket
import subprocess

import numpy as np
import pytest

from kvpool import KvpoolError
from kvpool.local_daemon import find_kvpoold

from observed_daemon import ObservedDaemon

LAYERS, HQ, HKV, D = 2, 4, 2, 64
QUANT = {"sink_tokens": 16, "recent_tokens": 32, "block_tokens": 16, "demotion_batch": 16}
TOKENS = 96


def kv(rng, tokens):
    shape = (LAYERS, tokens, HKV, D)
    return (rng.standard_normal(shape, dtype=np.float32),
            rng.standard_normal(shape, dtype=np.float32))


def do_work(client, model):
    """Registers `model`, stores two sequences sharing a prefix, attends, looks a prefix up and
    makes one call fail. Returns the number of OK AppendKv calls."""
    client.register_model(model, q_heads=HQ, kv_heads=HKV, num_layers=LAYERS, head_dim=D,
                          data_free="hadamard", quant=QUANT)
    rng = np.random.default_rng(7)
    tokens = list(range(1000, 1000 + TOKENS))
    k, v = kv(rng, TOKENS)
    client.create_sequence(model, "a")
    client.append_kv("a", k, v, token_ids=tokens, end_of_prefill=True)
    client.seal_sequence("a")
    created = client.create_sequence(model, "b", prefix_token_ids=tokens)
    assert created.reused_tokens > 0
    reused = created.reused_tokens
    k2, v2 = kv(rng, TOKENS - reused)
    client.append_kv("b", k2, v2, token_start=reused, token_ids=tokens[reused:],
                     end_of_prefill=True)
    client.attend(model, 0, {"a": rng.standard_normal((HQ, D), dtype=np.float32),
                             "b": rng.standard_normal((HQ, D), dtype=np.float32)})
    assert client.lookup_prefix(model, tokens).matched_tokens > 0
    with pytest.raises(KvpoolError) as e:
        client.describe_sequence("no-such-sequence")
    assert e.value.code.name == "NOT_FOUND"
    return 2


def test_counters_equal_get_stats_exactly():
    with ObservedDaemon(["--codec_health_sample_every=1"]) as d, d.client() as client:
        appends = do_work(client, "metrics-model")
        stats = client.get_stats()
        m = d.scrape()
        p, s = stats.pool, stats.service
        tier = {"tier": "host"}
        assert m.value("kvpool_pool_capacity_bytes", **tier) == p.capacity_bytes
        for state, want in (("used", p.used_bytes), ("free", p.free_bytes),
                            ("cached", p.cached_bytes), ("shared", p.shared_bytes),
                            ("unassigned", p.unassigned_bytes)):
            assert m.value("kvpool_pool_bytes", state=state, **tier) == want, state
        assert p.used_bytes > 0 and p.shared_bytes > 0
        assert m.value("kvpool_pool_slabs", state="in_use", **tier) == p.slabs_in_use
        for c in p.classes:
            assert m.value("kvpool_pool_page_class_bytes", page_bytes=str(c.page_bytes),
                           **tier) == c.bytes_in_use
        assert m.value("kvpool_prefix_units") == p.prefix_units > 0
        assert m.value("kvpool_prefix_evicted_units_total") == p.evicted_units
        # Two lookups: CreateSequence from token ids and LookupPrefix.
        assert m.value("kvpool_prefix_lookups_total") == p.prefix_lookups == 2
        assert m.value("kvpool_prefix_lookup_tokens_total") == p.prefix_lookup_tokens
        assert m.value("kvpool_prefix_hit_tokens_total") == p.prefix_hit_tokens > 0

        (model,) = [x for x in stats.models if x.model_id == "metrics-model"]
        assert m.value("kvpool_model_sequences", model="metrics-model") == model.sequences == 2
        for tier_name, want in (("sink", model.sink_tokens), ("history", model.history_tokens),
                                ("recent", model.recent_tokens)):
            assert m.value("kvpool_model_tokens", model="metrics-model", tier=tier_name) == want
        assert m.value("kvpool_model_pool_bytes", model="metrics-model") == model.pool_bytes
        assert (m.value("kvpool_model_bf16_equivalent_bytes", model="metrics-model")
                == model.bf16_equivalent_bytes)
        assert m.value("kvpool_model_compression_ratio", model="metrics-model") == \
            model.bf16_equivalent_bytes / model.pool_bytes

        assert m.value("kvpool_ingested_bytes_total") == s.ingested_bytes > 0
        assert m.value("kvpool_ingested_tokens_total") == s.ingested_tokens
        assert m.value("kvpool_attention_calls_total") == s.attention_calls == 1
        assert m.value("kvpool_attention_sequences_total") == s.attention_sequences == 2
        assert m.value("kvpool_worker_threads") == s.worker_threads == 2
        assert m.value("kvpool_worker_queue_depth") == s.worker_queue_depth
        assert m.value("kvpool_worker_queue_capacity") == s.worker_queue_capacity
        assert m.value("kvpool_rejected_busy_total") == s.rejected_busy
        b = stats.build
        assert b.api_package == "kvpool.v1" and b.api_revision >= 1
        assert m.value("kvpool_build_info", version=s.version, backend="cpu",
                       git_commit=b.git_commit, build_type=b.build_type,
                       cuda="true" if b.cuda else "false",
                       api=f"{b.api_package}.{b.api_revision}") == 1
        a = stats.admission
        assert m.value("kvpool_admission_open_streams") == a.open_streams
        assert m.value("kvpool_admission_refused_total") == a.refused
        assert m.value("kvpool_admission_expired_total", timeout="idle") == a.expired_idle
        assert m.value("kvpool_connections_accepted_total") == stats.connections.accepted >= 1
        assert m.value("kvpool_connections_open") == stats.connections.open
        assert m.value("kvpool_expired_sequences_total") == stats.lifecycle.expired_sequences
        assert m.value("kvpool_corrupt_sequences_total") == stats.integrity.corrupt_sequences

        # Per transport; the sums are GetStats' totals.
        t = stats.transport
        names = {l["transport"] for l, _ in m.labelled("kvpool_transport_sessions")}
        assert names == set(t.available)
        for series, want in (("kvpool_transport_sessions", t.sessions),
                             ("kvpool_transport_received_bytes_total", t.bytes_received),
                             ("kvpool_transport_attention_calls_total", t.attention_calls),
                             ("kvpool_transport_pushes_committed_total", t.pushes_committed)):
            assert sum(v for _, v in m.labelled(series)) == want, series

        # Latency histograms count exactly the calls made, by method and status code.
        def count(method, code="OK"):
            return m.value("kvpool_rpc_duration_seconds_count",
                           method=f"kvpool.v1.{method}", code=code)
        assert count("SequenceService/AppendKv") == appends
        assert count("SequenceService/CreateSequence") == 2
        assert count("AttentionService/Attend") == 1
        assert count("SequenceService/DescribeSequence", "NOT_FOUND") == 1
        assert count("StatsService/GetStats") == 1  # the one above; the scrape is not a call
        assert m.value("kvpool_attend_duration_seconds_count", batch="2-4", code="OK") == 1
        family = m.families["kvpool_rpc_duration_seconds"]
        assert family.type == "histogram"
        buckets = [(l, v) for l, v in m.labelled("kvpool_rpc_duration_seconds_bucket")
                   if l["method"] == "kvpool.v1.AttentionService/Attend"]
        values = [v for _, v in sorted(buckets, key=lambda lv: float(lv[0]["le"]))]
        assert values == sorted(values) and values[-1] == 1  # cumulative, +Inf holds all

        # Codec health: every chunk sampled, each layer and tensor, errors below the signal.
        for layer in range(LAYERS):
            for tensor in ("k", "v"):
                at = dict(model="metrics-model", layer=str(layer), tensor=tensor)
                assert m.value("kvpool_codec_health_rows_total", **at) > 0
                signal = m.value("kvpool_codec_health_signal_energy_total", **at)
                error = m.value("kvpool_codec_health_error_energy_total", **at)
                assert 0 < error < signal
        assert m.value("kvpool_codec_health_samples_total") >= 2 * LAYERS
        assert m.value("kvpool_codec_health_sample_seconds_total") > 0

        # Still the same after another quiet scrape; no tenant label without the flag.
        again = d.scrape()
        assert again.value("kvpool_prefix_hit_tokens_total") == p.prefix_hit_tokens
        assert "tenant=" not in again.text


def test_codec_health_sees_heavier_tails_than_calibrated_for():
    """Rows with rare large outliers (what a drifted model looks like to a fitted rotation) lose
    far more energy to the clip than Gaussian rows do."""
    with ObservedDaemon(["--codec_health_sample_every=1"]) as d, d.client() as client:
        rng = np.random.default_rng(3)
        for model, outliers in (("calm", False), ("drifted", True)):
            client.register_model(model, q_heads=HQ, kv_heads=HKV, num_layers=LAYERS,
                                  head_dim=D, data_free="identity", quant=QUANT)
            k, v = kv(rng, TOKENS)
            if outliers:
                mask = rng.random(k.shape) < 0.02
                k[mask] *= 40.0
                v[mask] *= 40.0
            client.create_sequence(model, model)
            client.append_kv(model, k, v, end_of_prefill=True)
        m = d.scrape()

        def clip_fraction(model):
            clip = sum(v for l, v in m.labelled("kvpool_codec_health_clip_energy_total")
                       if l["model"] == model)
            signal = sum(v for l, v in m.labelled("kvpool_codec_health_signal_energy_total")
                         if l["model"] == model)
            return clip / signal
        assert clip_fraction("drifted") > 5 * clip_fraction("calm") > 0
        # A deleted model's series go away.
        client.release_sequence("calm")
        client.delete_model("calm")
        assert not [l for l, _ in d.scrape().labelled("kvpool_codec_health_rows_total")
                    if l["model"] == "calm"]


def test_tenant_labels_only_with_the_flag():
    with ObservedDaemon(["--metrics_tenant_labels"]) as d, d.client() as client:
        do_work(client, "tenant-model")
        stats = client.get_stats()
        m = d.scrape()
        (model,) = [x for x in stats.models if x.model_id == "tenant-model"]
        assert m.value("kvpool_model_pool_bytes", tenant=stats.tenant,
                       model="tenant-model") == model.pool_bytes
        assert m.value("kvpool_tenant_quota_bytes", tenant=stats.tenant) == stats.quota_bytes


def test_scaleout_membership_is_exported_only_with_advertise():
    """docs/scale-out.md: the members this daemon sees and its epoch, as GetStats has them."""
    from kvpool.placement import epoch_of

    with ObservedDaemon() as d, d.client() as client:
        assert not client.get_stats().membership.advertise
        m = d.scrape()
        assert not m.labelled("kvpool_scaleout_members")
        assert not m.labelled("kvpool_scaleout_epoch_info")
    # Alone (no --peers): itself is the only member.
    with ObservedDaemon(["--advertise=127.0.0.1:1"]) as d, d.client() as client:
        stats = client.get_stats().membership
        assert stats.epoch == epoch_of(["127.0.0.1:1"]).hex()
        m = d.scrape()
        assert m.value("kvpool_scaleout_members") == len(stats.members) == 1
        assert m.value("kvpool_scaleout_epoch_info", epoch=stats.epoch) == 1


def test_only_metrics_is_served():
    with ObservedDaemon() as d:
        assert d.get("/")[0] == 404
        assert d.get("/metrics/../admin")[0] == 404
        assert d.get("/debug")[0] == 404
        assert d.get("/metrics")[0] == 200


def test_hostile_bytes_on_the_metrics_port_leave_the_daemon_serving():
    def send(payload: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", d.metrics_port), timeout=60) as s:
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                return s.recv(4096)
            except OSError:  # the server may close on us mid-send: fine
                return b""
    with ObservedDaemon() as d, d.client() as client:
        send(bytes(range(256)) * 64 + b"\r\n\r\n")                     # binary garbage
        send(b"GET /" + b"a" * 100000 + b" HTTP/1.1\r\n\r\n")            # huge URI
        send(b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 20000 + b"\r\n")  # header flood
        answer = send(b"POST /metrics HTTP/1.1\r\nContent-Length: 100000000\r\n\r\n" +
                      b"x" * 65536)
        assert not answer.startswith(b"HTTP/1.1 200")
        assert d.get("/metrics")[0] == 200
        assert client.health() == "SERVING"


def test_bad_metrics_address_is_refused_at_start():
    run = subprocess.run([find_kvpoold(), "--listen=127.0.0.1:0", "--metrics_listen=nohost"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "--metrics_listen" in run.stderr
