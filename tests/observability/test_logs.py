"""kvpoold's log against a real daemon: --log_format=json writes one valid JSON object per line
(every line of the log parsed), text one line per event, and each call's request id (the
client's x-request-id when valid, else one the daemon makes) reaches the log lines of the call,
the response metadata, the ErrorInfo of an error and KvpoolError.request_id."""

from __future__ import annotations

import json
import re
from typing import Callable, List, Sequence

import grpc
import pytest

from kvpool import NO_RETRY, Client, ClientOptions, KvpoolError
from kvpool.local_daemon import LocalDaemon, find_kvpoold
from kvpool.v1 import kv_event_service_pb2 as events_pb2
from kvpool.v1 import kv_event_service_pb2_grpc as events_grpc
from kvpool.v1 import stats_service_pb2 as stats_pb2

FLAGS = ["--pool_bytes=268435456", "--worker_threads=2", "--transports=", "--scrub_period=0",
         "--log_level=debug"]
GENERATED_ID = re.compile(r"^[0-9a-f]{32}$")
# Quotes, a backslash, a newline, a tab and non-ASCII text: a sequence id the daemon quotes into
# its NOT_FOUND message, which the debug line of the call logs.
HOSTILE_SEQUENCE = 'seq "q" \\ \n\t caf\u00e9 \u20ac'


def run_daemon(flags: Sequence[str], body: Callable[[LocalDaemon], None]) -> bytes:
    """Runs `body` against a daemon, stops it (SIGTERM, exit 0) and returns its whole log."""
    daemon = LocalDaemon(find_kvpoold(), [*FLAGS, *flags])
    daemon.start()
    try:
        body(daemon)
        daemon.stop()
        with open(daemon.log_path, "rb") as f:
            return f.read()
    finally:
        daemon.cleanup()


def client(daemon: LocalDaemon, request_id=None) -> Client:
    return Client(daemon.target, ClientOptions(deadline_s=120.0, retry=NO_RETRY,
                                               request_id=request_id))


def failed(fn: Callable[[], object]) -> KvpoolError:
    with pytest.raises(KvpoolError) as e:
        fn()
    return e.value


def register(c: Client, model: str) -> None:
    c.register_model(model, q_heads=2, kv_heads=1, num_layers=1, head_dim=64,
                     data_free="hadamard")


def test_json_log_is_one_object_per_line_and_carries_request_ids():
    seen = {}

    def calls(daemon: LocalDaemon) -> None:
        with client(daemon, "obs-req-stats") as c:
            c.get_stats()
        with client(daemon, "obs-req-delete") as c:
            register(c, "log-model")
            c.delete_model("log-model")
        with client(daemon, "obs-req-notfound") as c:
            e = failed(lambda: c.describe_sequence(HOSTILE_SEQUENCE))
            assert e.code == grpc.StatusCode.NOT_FOUND
            assert e.request_id == "obs-req-notfound"
        # Bad ids are replaced by the daemon's own, never logged or echoed.
        for bad in ("bad id with spaces", "x" * 129):
            with client(daemon, bad) as c:
                e = failed(lambda: c.describe_sequence("absent"))
                assert GENERATED_ID.match(e.request_id or ""), (bad, e.request_id)
        with client(daemon) as c:  # none sent: one is made per call
            first = failed(lambda: c.describe_sequence("absent")).request_id
            second = failed(lambda: c.describe_sequence("absent")).request_id
            assert GENERATED_ID.match(first) and GENERATED_ID.match(second)
            assert first != second
            seen["generated"] = first
            # A successful call answers its id in the initial metadata.
            _, call = c.stats.GetStats.with_call(stats_pb2.GetStatsRequest(), timeout=60,
                                                 metadata=(("x-request-id", "obs-req-meta"),))
            assert ("x-request-id", "obs-req-meta") in tuple(call.initial_metadata())
            # An error with a reason (ErrorInfo) carries the id in its metadata too.
            stub = events_grpc.KvEventServiceStub(c.channel)
            first_feed = stub.SubscribeKvEvents(events_pb2.SubscribeKvEventsRequest(), timeout=600)
            next(first_feed)  # joined: the one subscriber --kv_events_max_subscribers allows
            second_feed = stub.SubscribeKvEvents(events_pb2.SubscribeKvEventsRequest(),
                                                 timeout=600,
                                                 metadata=(("x-request-id", "obs-req-limit"),))
            with pytest.raises(grpc.RpcError) as rpc_error:
                next(second_feed)
            first_feed.cancel()
            e = KvpoolError.from_rpc_error(rpc_error.value, "SubscribeKvEvents")
            assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.reason == "LIMIT"
            assert e.metadata.get("request_id") == "obs-req-limit"
            assert e.request_id == "obs-req-limit"

    raw = run_daemon(["--log_format=json", "--kv_events_max_subscribers=1"], calls)
    text = raw.decode("utf-8")  # strict: the log is valid UTF-8
    lines = text.split("\n")
    assert lines[-1] == ""  # ends with a newline
    records: List[dict] = []
    for line in lines[:-1]:
        record = json.loads(line)  # every line of the log is one JSON object
        assert isinstance(record, dict), line
        assert {"time", "level", "program", "thread", "msg"} <= record.keys(), line
        assert record["program"] == "kvpoold"
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$", record["time"]), line
        assert record["level"] in {"trace", "debug", "info", "warning", "error", "critical"}
        records.append(record)

    def of(request_id: str) -> List[str]:
        return [r["msg"] for r in records if r.get("request_id") == request_id]

    assert "call kvpool.v1.StatsService/GetStats OK" in " | ".join(of("obs-req-stats"))
    delete_lines = of("obs-req-delete")
    assert any(m.startswith("deleted model 'log-model'") for m in delete_lines), delete_lines
    # Written on a worker, from a streaming call's reaction: the id follows there too.
    assert any(m.startswith("registered model 'log-model'") for m in delete_lines), delete_lines
    assert any(m.startswith("call kvpool.v1.ModelService/DeleteModel OK") for m in delete_lines)
    (not_found,) = of("obs-req-notfound")
    assert not_found.startswith("call kvpool.v1.SequenceService/DescribeSequence NOT_FOUND")
    # The daemon's message quotes the id with C escapes: quotes and backslashes reach the JSON.
    assert 'seq \\"q\\" \\\\ \\n\\t caf\\xc3\\xa9' in not_found, not_found
    assert any(m.startswith("call kvpool.v1.StatsService/GetStats OK") for m in of("obs-req-meta"))
    assert any("RESOURCE_EXHAUSTED" in m for m in of("obs-req-limit"))
    assert of(seen["generated"]), "a generated id is logged too"
    # Lines outside any call have no request id (start-up, shutdown).
    assert any("request_id" not in r and "serving on" in r["msg"] for r in records)
    assert "bad id with spaces" not in text and "x" * 129 not in text


def test_text_log_is_one_line_per_event_with_request_ids():
    def calls(daemon: LocalDaemon) -> None:
        with client(daemon, "obs-text-1") as c:
            c.get_stats()
            failed(lambda: c.describe_sequence(HOSTILE_SEQUENCE))

    text = run_daemon([], calls).decode("utf-8")
    line_format = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} "
                             r"(trace|debug|info|warning|error|critical) kvpoold: ")
    lines = text.split("\n")[:-1]
    for line in lines:
        assert line_format.match(line) or line.startswith("kvpoold listening on 127.0.0.1:"), line
    tagged = [l for l in lines if "[request_id=obs-text-1] " in l]
    assert any("call kvpool.v1.StatsService/GetStats OK" in l for l in tagged), tagged
    assert any("DescribeSequence NOT_FOUND" in l for l in tagged), tagged
    assert sum(l.startswith("kvpoold listening on") for l in lines) == 1
