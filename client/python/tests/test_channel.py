"""What the client puts on the wire that kvpoold does not check yet: the bearer token and
call metadata, TLS, retries of retryable codes, and error reasons in the status details.

kvpoold has no TLS or token support today, so these tests serve the kvpool.v1 StatsService
from an in-process gRPC server (grpcio) that records what it receives and answers as scripted:
the point is the client's side of the contract, which the daemon will check later.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent import futures

import grpc
import pytest

from kvpool import Client, ClientOptions, KvpoolError, RetryPolicy, TlsOptions
from kvpool.errors import parse_error_info
from kvpool.v1 import stats_service_pb2 as stats_pb2
from kvpool.v1 import stats_service_pb2_grpc as stats_grpc


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (all this test needs to build a google.rpc.Status)."""
    size, out = len(payload), bytearray([number << 3 | 2])
    while True:
        out.append((size & 0x7F) | (0x80 if size > 0x7F else 0))
        size >>= 7
        if not size:
            return bytes(out) + payload


def status_with_error_info(code: int, message: str, reason: str, meta: dict) -> bytes:
    info = _field(1, reason.encode()) + _field(2, b"kvpool")
    for key, value in meta.items():
        info += _field(3, _field(1, key.encode()) + _field(2, value.encode()))
    any_msg = _field(1, b"type.googleapis.com/google.rpc.ErrorInfo") + _field(2, info)
    return bytes([0x08, code]) + _field(2, message.encode()) + _field(3, any_msg)


class ScriptedStats(stats_grpc.StatsServiceServicer):
    def __init__(self):
        self.calls = []  # (metadata dict, auth context)
        self.failures = []  # (code, message, details bytes or None), consumed in order

    def GetStats(self, request, context):
        self.calls.append((dict(context.invocation_metadata()), context.auth_context()))
        if self.failures:
            code, message, details = self.failures.pop(0)
            if details is not None:
                context.set_trailing_metadata((("grpc-status-details-bin", details),))
            context.abort(code, message)
        return stats_pb2.GetStatsResponse(tenant="t")


def serve(servicer, credentials=None):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    stats_grpc.add_StatsServiceServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, f"127.0.0.1:{port}"


def test_token_and_metadata_are_sent_on_every_call():
    stats = ScriptedStats()
    server, target = serve(stats)
    try:
        c = Client(target, ClientOptions(token="s3cret", metadata=(("x-request-id", "r1"),)))
        assert c.get_stats().tenant == "t"
        meta = stats.calls[0][0]
        assert meta["authorization"] == "Bearer s3cret" and meta["x-request-id"] == "r1"
        c.close()
    finally:
        server.stop(None)


def test_retryable_codes_are_retried_and_others_are_not():
    stats = ScriptedStats()
    server, target = serve(stats)
    try:
        fast = RetryPolicy(max_attempts=3, initial_backoff_s=0.001)
        c = Client(target, ClientOptions(retry=fast))
        stats.failures = [(grpc.StatusCode.UNAVAILABLE, "draining", None),
                          (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", None)]
        assert c.get_stats().tenant == "t" and len(stats.calls) == 3
        stats.calls.clear()
        stats.failures = [(grpc.StatusCode.ABORTED, "busy", None)] * 3
        with pytest.raises(KvpoolError) as e:
            c.get_stats()
        assert e.value.code == grpc.StatusCode.ABORTED and len(stats.calls) == 3
        stats.calls.clear()
        stats.failures = [(grpc.StatusCode.INVALID_ARGUMENT, "bad", None)]
        with pytest.raises(KvpoolError) as e:
            c.get_stats()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and len(stats.calls) == 1
        # A draining daemon is not asked again (it never serves again; another daemon may).
        stats.calls.clear()
        draining = status_with_error_info(14, "draining", "DRAINING", {})
        stats.failures = [(grpc.StatusCode.UNAVAILABLE, "draining", draining)] * 3
        with pytest.raises(KvpoolError) as e:
            c.get_stats()
        assert e.value.reason == "DRAINING" and e.value.retryable and len(stats.calls) == 1
        c.close()
    finally:
        server.stop(None)


def test_error_reason_comes_from_status_details():
    stats = ScriptedStats()
    server, target = serve(stats)
    try:
        details = status_with_error_info(5, "evicted", "EVICTED", {"sequence": "req-1"})
        stats.failures = [(grpc.StatusCode.NOT_FOUND, "evicted", details)]
        c = Client(target)
        with pytest.raises(KvpoolError) as e:
            c.get_stats()
        assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.reason == "EVICTED"
        assert e.value.domain == "kvpool" and e.value.metadata == {"sequence": "req-1"}
        assert "[EVICTED]" in str(e.value)
        c.close()
    finally:
        server.stop(None)
    assert parse_error_info(b"\xff\xff") is None  # malformed details are ignored


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl tool")
def test_tls_options_build_a_secure_channel(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=kvpool.test", "-addext", "subjectAltName=DNS:kvpool.test",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    stats = ScriptedStats()
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    server, target = serve(stats, creds)
    try:
        tls = TlsOptions(root_certificates=cert.read_bytes(),
                         server_name_override="kvpool.test")
        c = Client(target, ClientOptions(tls=tls, token="tok"))
        assert c.secure and c.get_stats().tenant == "t"
        meta, auth = stats.calls[0]
        assert auth.get("transport_security_type") == [b"ssl"]
        assert meta["authorization"] == "Bearer tok"
        c.close()
        # The same server refuses a plaintext client.
        plain = Client(target, ClientOptions(deadline_s=5.0, retry=RetryPolicy(max_attempts=1)))
        with pytest.raises(KvpoolError) as e:
            plain.get_stats()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        plain.close()
    finally:
        server.stop(None)
    assert os.path.exists(cert)
