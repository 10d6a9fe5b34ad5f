"""AdminService from the Python package against a real kvpoold with a tenants file: drain and
tenants reload are the admin's alone; a drain refuses new sequences with reason DRAINING and the
daemon then exits with status 0."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import urllib.request

import grpc
import numpy as np
import pytest

from kvpool import Client, ClientOptions
from kvpool.errors import KvpoolError
from kvpool.local_daemon import LocalDaemon, find_kvpoold
from kvpool.options import NO_RETRY

TOKEN_TENANT = "py-admin-test-tenant-2718"
TOKEN_ADMIN = "py-admin-test-admin-1618"


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture()
def daemon():
    try:
        binary = find_kvpoold()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tmp = tempfile.mkdtemp(prefix="kvpool-py-admin-")
    tenants = os.path.join(tmp, "tenants.txtpb")
    with open(tenants, "w") as f:
        f.write(f'tenant {{ name: "team-a" role: ROLE_TENANT '
                f'token_sha256: "{sha256(TOKEN_TENANT)}" }}\n'
                f'tenant {{ name: "ops" role: ROLE_ADMIN token_sha256: "{sha256(TOKEN_ADMIN)}" }}\n')
    d = LocalDaemon(binary, ["--pool_bytes=67108864", "--worker_threads=2",
                             f"--tenants_file={tenants}", "--metrics_listen=127.0.0.1:0",
                             f"--metrics_port_file={tmp}/metrics.port"],
                    client_options=ClientOptions(token=TOKEN_TENANT))
    d.start()
    d.metrics_port_file = f"{tmp}/metrics.port"
    yield d
    try:
        d.stop()
    finally:
        d.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def gauge(daemon, name: str) -> float:
    """One unlabelled sample of the daemon's Prometheus page."""
    with open(daemon.metrics_port_file) as f:
        port = int(f.read())
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} on the metrics page")


def test_drain_and_reload_are_admin_only(daemon):
    with Client(daemon.target, ClientOptions(token=TOKEN_TENANT, retry=NO_RETRY)) as tenant:
        for call in (tenant.drain, tenant.reload_tenants):
            with pytest.raises(KvpoolError) as e:
                call()
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert tenant.health() == "SERVING"
    with Client(daemon.target, ClientOptions(token=TOKEN_ADMIN)) as admin:
        assert admin.reload_tenants() == 2


def test_admin_drain_refuses_new_sequences_then_exits_zero(daemon):
    with Client(daemon.target, ClientOptions(token=TOKEN_TENANT, retry=NO_RETRY)) as tenant, \
            Client(daemon.target, ClientOptions(token=TOKEN_ADMIN, retry=NO_RETRY)) as admin:
        tenant.register_model("m", q_heads=8, kv_heads=2, num_layers=2, head_dim=64,
                              data_free="hadamard")
        # An append in flight when the drain begins: it holds its admission ticket (GetStats
        # says so), and it finishes.
        tenant.create_sequence("m", "s")
        rng = np.random.default_rng(1)
        k = rng.standard_normal((2, 16, 2, 64)).astype(np.float32)
        stream = tenant.open_append("s", 16)
        stream.write_layer(0, k[0], k[0])
        deadline = time.monotonic() + 120
        while admin.get_stats().admission.open_streams != 1:
            assert time.monotonic() < deadline, "the append never opened"
            time.sleep(0.02)
        assert gauge(daemon, "kvpool_draining") == 0
        response = admin.drain()
        assert response.started
        assert response.serving.state == response.serving.DRAINING
        assert admin.get_stats().serving.state == response.serving.DRAINING
        assert tenant.health() == "NOT_SERVING"
        assert gauge(daemon, "kvpool_draining") == 1
        assert gauge(daemon, "kvpool_in_flight_calls") >= 1  # the append
        with pytest.raises(KvpoolError) as e:
            tenant.create_sequence("m", "s2")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert e.value.reason == "DRAINING"
        stream.write_layer(1, k[1], k[1])
        assert stream.finish().sequence.total_tokens == 16
    assert daemon.process.wait(timeout=120) == 0
