"""kvpool.routing.RoutingClient against real kvpoold processes (docs/scale-out.md).

As tests/integration/scaleout_test.cc: four daemons on 127.0.0.2-5, one port, each told the same
static peer list; the fourth is listed from the start but started only by the stale-client
test. The tests run in file order and share the daemons: placement and spread, prefix
co-location with dedup and the attention fan-out, a stale client redirected after a join, a
SIGKILLed daemon.
"""

from __future__ import annotations

import socket
import time
from typing import List, Optional

import grpc
import numpy as np
import pytest

from kvpool import Client, ClientOptions, DType, KvpoolError, RoutingClient, RoutingOptions
from kvpool.local_daemon import LocalDaemon, find_kvpoold
from kvpool.membership import Membership, parse_target
from kvpool.placement import epoch_of, placement_key_of_sequence
from kvpool.routing import EPOCH_METADATA, PLACEMENT_KEY_METADATA

HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
SINK, BLOCK, RECENT = 64, 16, 256
HQ, HKV, D = 2, 1, 64


def free_port_on_all_hosts() -> int:
    """A TCP port free on every address of HOSTS (bound on each, then released)."""
    for _ in range(50):
        socks: List[socket.socket] = []
        try:
            first = socket.socket()
            socks.append(first)
            first.bind((HOSTS[0], 0))
            port = first.getsockname()[1]
            for host in HOSTS[1:]:
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    return 0


class Cluster:
    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port_on_all_hosts()
        assert self.port, "no port free on 127.0.0.2-5"
        self.endpoints = [f"{h}:{self.port}" for h in HOSTS]
        self.peers = ",".join(self.endpoints)
        self.daemons: List[Optional[LocalDaemon]] = [None] * len(HOSTS)
        self.direct: List[Optional[Client]] = [None] * len(HOSTS)

    def start(self, i: int) -> None:
        d = LocalDaemon(self.binary, [
            "--pool_bytes=134217728", "--worker_threads=1", "--log_level=warn",
            f"--advertise={self.endpoints[i]}", f"--peers={self.peers}", "--peers_refresh=200ms",
            "--peer_probe_timeout=2s"], startup_timeout_s=180.0,
            listen=f"{HOSTS[i]}:{self.port}")
        d.start()
        self.daemons[i] = d
        c = Client(d.target, ClientOptions(deadline_s=120.0))
        c.register_model("m", q_heads=HQ, kv_heads=HKV, num_layers=1, head_dim=D,
                         data_free="randomized_hadamard", seed=7)
        self.direct[i] = c

    def members(self, indices) -> Membership:
        return Membership([(self.endpoints[i], 1) for i in indices])

    def wait_for_epoch(self, i: int, indices) -> bool:
        """Whether daemon i comes to redirect with the epoch of `indices`: asked for a key it
        does not own under that membership, it answers WRONG_OWNER with that epoch."""
        m = self.members(indices)
        n = 0
        while True:
            key = placement_key_of_sequence("probe", "m", f"p{n}")
            if m.owner_of(key) != self.endpoints[i]:
                break
            n += 1
        placed = self.direct[i].with_call_metadata(
            ((EPOCH_METADATA, m.epoch_hex), (PLACEMENT_KEY_METADATA, key.hex())))
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:
            try:
                placed.describe_sequence("no-such-sequence")
            except KvpoolError as e:
                if e.reason == "WRONG_OWNER" and e.metadata.get("epoch") == m.epoch_hex:
                    return True
            time.sleep(0.05)
        return False

    def index_of(self, endpoint: str) -> int:
        return self.endpoints.index(endpoint)

    def stop(self) -> None:
        for c in self.direct:
            if c is not None:
                c.close()
        for d in self.daemons:
            if d is not None:
                d.cleanup()


@pytest.fixture(scope="module")
def cluster():
    try:
        binary = find_kvpoold()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    c = Cluster(binary)
    try:
        for i in range(3):
            c.start(i)
        for i in range(3):
            assert c.wait_for_epoch(i, [0, 1, 2]), c.daemons[i].log_tail()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def stale(cluster):
    """A routing client made with three members that never refreshes on its own."""
    r = RoutingClient(cluster.peers, RoutingOptions(
        client=ClientOptions(deadline_s=120.0), refresh_interval_s=36000.0,
        connect_timeout_s=5.0))
    yield r
    r.close()


def router(cluster, refresh_interval_s: float = 2.0) -> RoutingClient:
    return RoutingClient(cluster.peers, RoutingOptions(
        client=ClientOptions(deadline_s=120.0), refresh_interval_s=refresh_interval_s,
        connect_timeout_s=5.0))


def prompt(n: int, salt: int) -> List[int]:
    return [(salt * 100003 + i * 7) & 0xFFFFFFFF for i in range(n)]


def test_target_syntax_is_checked():
    assert parse_target("a:1, b:2=5").entries == (("a:1", None), ("b:2", 5))
    assert parse_target("dns:///kvpool-headless.ns.svc:50051").dns_host == \
        "kvpool-headless.ns.svc"
    for bad in ["", " , ", "a", "a:0", "a:65536", "a:1=0", "a:1=x", "a b:1",
                "dns://8.8.8.8/name:1", "dns:///name"]:
        with pytest.raises(KvpoolError) as e:
            parse_target(bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, bad
    # A DNS server in the target is the C++ client's (c-ares); Python says so.
    with pytest.raises(KvpoolError, match="only dns:///NAME:PORT"):
        parse_target("dns://127.0.0.1:5353/kvpool-headless.test:50051")


def test_a_dns_target_resolves_to_every_address(daemon):
    """dns:///NAME:PORT through the system resolver: localhost names the session's daemon
    (which runs without --advertise and serves routed calls as before)."""
    port = daemon.target.rpartition(":")[2]
    with RoutingClient(f"dns:///localhost:{port}") as r:
        assert r.membership.endpoints == [f"127.0.0.1:{port}"]
        r.client_for(r.membership.endpoints[0]).register_model(
            "dns-m", q_heads=HQ, kv_heads=HKV, num_layers=1, head_dim=D, data_free="hadamard")
        r.create_sequence("dns-m", "dns-seq")
        assert r.describe_sequence("dns-seq").sequence_id == "dns-seq"
        r.release_sequence("dns-seq")


def test_nothing_answers_is_unavailable():
    port = free_port_on_all_hosts()
    with pytest.raises(KvpoolError) as e:
        RoutingClient(f"127.0.0.2:{port}", RoutingOptions(probe_timeout_s=2.0))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_get_stats_reports_the_membership(cluster):
    three = cluster.members([0, 1, 2])
    for i in range(3):
        m = cluster.direct[i].get_stats().membership
        assert m.advertise == cluster.endpoints[i]
        assert m.weight == 134217728  # its pool bytes
        assert m.epoch == three.epoch_hex
        assert [x.endpoint for x in m.members] == cluster.endpoints[:3]


def test_sequences_go_to_their_owners(cluster, stale):
    assert stale.membership.endpoints == cluster.endpoints[:3]
    assert stale.membership.epoch == epoch_of(cluster.endpoints[:3])
    three = cluster.members([0, 1, 2])
    expected = [0, 0, 0]
    for n in range(90):
        sid = f"spread-{n}"
        stale.create_sequence("m", sid)
        owner = three.owner_of(placement_key_of_sequence("default", "m", sid))
        assert stale.owner_of(sid) == owner
        expected[cluster.index_of(owner)] += 1
        # Only the owner holds it.
        for i in range(3):
            if cluster.endpoints[i] == owner:
                assert cluster.direct[i].describe_sequence(sid).sequence_id == sid
            else:
                with pytest.raises(KvpoolError) as e:
                    cluster.direct[i].describe_sequence(sid)
                assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert stale.redirects == 0
    assert all(n > 0 for n in expected), expected
    # A sequence this client never placed is refused before any call.
    with pytest.raises(KvpoolError) as e:
        stale.describe_sequence("never-placed")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_shared_first_block_colocates_dedups_and_attend_fans_out(cluster):
    with router(cluster) as r:
        tokens = SINK + 2 * BLOCK + RECENT
        rng = np.random.default_rng(5)
        firsts, owners = [], set()
        for p in range(1, 9):
            ids = prompt(tokens, p)
            first = f"pfx-{p}-a"
            r.create_sequence("m", first, first_block_tokens=ids[:SINK])
            k = rng.standard_normal((1, tokens, HKV, D)).astype(np.float32)
            v = rng.standard_normal((1, tokens, HKV, D)).astype(np.float32)
            if p == 1:  # the layer-wise stream goes to the owner too
                with r.open_append(first, tokens, dtype=DType.BF16, token_ids=ids,
                                   end_of_prefill=True) as stream:
                    stream.write_layer(0, k[0], v[0])
            else:
                r.append_kv(first, k, v, dtype=DType.BF16, token_ids=ids, end_of_prefill=True)
            owner = r.owner_of(first)
            # Same first block: same daemon, and the cached prefix is attached there.
            created = r.create_sequence("m", f"pfx-{p}-b", prefix_token_ids=ids)
            assert created.reused_tokens == SINK + 2 * BLOCK
            assert r.owner_of(f"pfx-{p}-b") == owner
            hit = r.lookup_prefix("m", ids)
            assert hit.matched_tokens == SINK + 2 * BLOCK
            read = r.read_kv(first, dtype=DType.FP32)
            assert read.k.shape == (1, tokens, HKV, D)
            owners.add(owner)
            firsts.append(first)
        assert len(owners) >= 2, "eight prompts all on one daemon"

        # Attend over sequences on several daemons: one result per query in the caller's
        # order, equal to asking each owner directly; an unknown sequence fails alone.
        queries = [(sid, rng.standard_normal((HQ, D)).astype(np.float32))
                   for sid in reversed(firsts)]
        queries.append(("never-created", np.zeros((HQ, D), np.float32)))
        results = r.attend("m", 0, queries)
        assert len(results) == len(queries)
        for (sid, q), got in zip(queries[:-1], results):
            assert not isinstance(got, KvpoolError), got
            assert got.sequence_id == sid
            assert got.attended_tokens == tokens
            alone = r.client_for(r.owner_of(sid)).attend("m", 0, {sid: q})[sid]
            np.testing.assert_array_equal(got.out, alone.out)
            np.testing.assert_array_equal(got.lse, alone.lse)
        assert isinstance(results[-1], KvpoolError)
        assert results[-1].code == grpc.StatusCode.NOT_FOUND
        assert r.redirects == 0

        released = r.release_sequence(firsts[0])
        assert released.freed_bytes >= 0
        with pytest.raises(KvpoolError) as e:
            r.describe_sequence(firsts[0])
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_a_joining_daemon_redirects_the_stale_client(cluster, stale):
    cluster.start(3)
    for i in range(4):
        assert cluster.wait_for_epoch(i, [0, 1, 2, 3]), cluster.daemons[i].log_tail()
    assert len(stale.membership) == 3  # it has not refreshed
    four = cluster.members([0, 1, 2, 3])
    moved = 0
    for n in range(40):
        sid = f"join-{n}"
        key = placement_key_of_sequence("default", "m", sid)
        give_up = time.monotonic() + 60
        while True:
            try:
                stale.create_sequence("m", sid)
                break
            except KvpoolError as e:
                # The client's refresh may not see the new daemon yet (its connection to it is
                # in reconnect backoff): the redirect reaches the caller, who retries later.
                if e.reason != "WRONG_OWNER" or time.monotonic() > give_up:
                    raise
                time.sleep(0.1)
        assert stale.owner_of(sid) == four.owner_of(key)
        moved += four.owner_of(key) == cluster.endpoints[3]
    # A new key owned by the fourth daemon was redirected; after the refresh the client knew.
    assert moved > 0
    assert stale.redirects >= 1
    assert stale.membership.epoch_hex == four.epoch_hex
    # Keys whose owner did not change are found where they were.
    three = cluster.members([0, 1, 2])
    kept = [f"spread-{n}" for n in range(90)
            if three.owner_of(placement_key_of_sequence("default", "m", f"spread-{n}")) ==
            four.owner_of(placement_key_of_sequence("default", "m", f"spread-{n}"))]
    assert 45 <= len(kept) < 90
    for sid in kept:
        assert stale.describe_sequence(sid).sequence_id == sid


def test_a_killed_daemon_fails_fast_and_leaves(cluster):
    # No periodic refresh: the call to the dead daemon is what makes the client refresh.
    with router(cluster, refresh_interval_s=36000.0) as r:
        assert len(r.membership) == 4
        on = {}
        n = 0
        while len(on) < 4:
            sid = f"kill-{n}"
            r.create_sequence("m", sid)
            on.setdefault(cluster.index_of(r.owner_of(sid)), sid)
            n += 1
        cluster.daemons[3].kill()
        # Attend over a live and the dead daemon's sequence: the dead part fails with
        # UNAVAILABLE, the live part is answered.
        q = np.zeros((HQ, D), np.float32)
        results = r.attend("m", 0, [(on[0], q), (on[3], q)])
        assert not isinstance(results[0], KvpoolError), results[0]
        assert isinstance(results[1], KvpoolError)
        assert results[1].code == grpc.StatusCode.UNAVAILABLE
        # The failure refreshed the membership: the dead daemon left, its sequence is a miss
        # on its new owner, the others are served.
        assert r.membership.endpoints == cluster.endpoints[:3]
        for i in range(3):
            assert cluster.wait_for_epoch(i, [0, 1, 2]), cluster.daemons[i].log_tail()
        with pytest.raises(KvpoolError) as e:
            r.describe_sequence(on[3])
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        for i in range(3):
            assert r.describe_sequence(on[i]).sequence_id == on[i]
