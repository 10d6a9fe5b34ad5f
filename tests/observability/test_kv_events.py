"""KvEventService against a real kvpoold: AllCleared, a replay of the units held and
ReplayComplete on subscribe, then BlockStored / BlockRemoved live, with the hashes LookupPrefix
reports; a subscriber that stops reading is dropped with RESOURCE_EXHAUSTED (reason LIMIT) while
appends go on."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvpool import KvpoolError
from kvpool.v1 import kv_event_service_pb2 as events_pb2
from kvpool.v1 import kv_event_service_pb2_grpc as events_grpc

from observed_daemon import ObservedDaemon

LAYERS, HQ, HKV, D = 1, 2, 1, 64
BLOCK = 16
QUANT = {"sink_tokens": 16, "recent_tokens": 32, "block_tokens": BLOCK, "demotion_batch": BLOCK}


def register(client, model):
    client.register_model(model, q_heads=HQ, kv_heads=HKV, num_layers=LAYERS, head_dim=D,
                          data_free="hadamard", quant=QUANT)


def store(client, model, seq, tokens, seed=0):
    rng = np.random.default_rng(seed)
    shape = (LAYERS, len(tokens), HKV, D)
    client.create_sequence(model, seq)
    client.append_kv(seq, rng.standard_normal(shape, dtype=np.float32),
                     rng.standard_normal(shape, dtype=np.float32), token_ids=tokens,
                     end_of_prefill=True)


def subscribe(client, skip_replay=False):
    stub = events_grpc.KvEventServiceStub(client.channel)
    return stub.SubscribeKvEvents(events_pb2.SubscribeKvEventsRequest(skip_replay=skip_replay),
                                  timeout=600)


def take(stream, n):
    return [next(stream) for _ in range(n)]


def test_replay_then_live_events_match_the_prefix_index():
    with ObservedDaemon() as d, d.client() as client:
        model = "events-model"
        register(client, model)
        tokens = list(range(5000, 5000 + 16 + 4 * BLOCK + 40))
        store(client, model, "first", tokens)
        units = client.lookup_prefix(model, tokens).units
        assert len(units) >= 2
        hashes = [u.hash for u in units]

        # A subscriber joining now: AllCleared, every unit (parents first), ReplayComplete.
        feed = subscribe(client)
        first = next(feed)
        assert first.WhichOneof("event") == "all_cleared"
        replay = take(feed, len(units) + 1)
        stored = [e.block_stored for e in replay[:-1]]
        assert [e.WhichOneof("event") for e in replay[:-1]] == ["block_stored"] * len(units)
        assert [s.unit_hash for s in stored] == hashes
        assert stored[0].sink and stored[0].parent_hash == ""
        assert [s.parent_hash for s in stored[1:]] == hashes[:-1]
        assert all(s.model_id == model for s in stored)
        assert [s.token_start for s in stored] == [u.token_start for u in units]
        assert replay[-1].replay_complete.units == len(units)
        assert all(e.sequence_number == 0 for e in [first, *replay])

        # Live: a longer prompt publishes its new blocks only, in order.
        longer = tokens + list(range(9000, 9000 + 3 * BLOCK))
        store(client, model, "second", longer, seed=1)
        new_units = client.lookup_prefix(model, longer).units[len(units):]
        assert new_units
        live = take(feed, len(new_units))
        assert [e.block_stored.unit_hash for e in live] == [u.hash for u in new_units]
        numbers = [e.sequence_number for e in live]
        assert numbers == sorted(numbers) and numbers[0] > 0

        # Deleting the model removes every unit.
        client.release_sequence("first")
        client.release_sequence("second")
        client.delete_model(model, force=True)
        all_hashes = set(hashes) | {u.hash for u in new_units}
        removed = take(feed, len(all_hashes))
        assert {e.block_removed.unit_hash for e in removed} == all_hashes
        assert {e.block_removed.reason for e in removed} == {
            events_pb2.KvBlockRemoved.MODEL_DELETED}
        feed.cancel()

        # skip_replay starts with the live feed.
        register(client, model)
        quiet = subscribe(client, skip_replay=True)
        store(client, model, "third", tokens, seed=2)
        assert next(quiet).WhichOneof("event") == "block_stored"
        quiet.cancel()


def test_a_subscriber_that_stops_reading_is_dropped_and_ingest_goes_on():
    with ObservedDaemon(["--kv_events_buffer=16"]) as d, d.client() as client:
        model = "flood-model"
        feed = subscribe(client)
        assert next(feed).WhichOneof("event") == "all_cleared"
        assert next(feed).WhichOneof("event") == "replay_complete"
        # Stop reading. Each round publishes, then removes, a few hundred units, until whatever
        # the transport buffers is full and the daemon's queue of 16 overflows.
        dropped = lambda: d.scrape().value("kvpool_kv_event_subscribers_dropped_total") == 1
        rounds = 0
        while not dropped():
            rounds += 1
            assert rounds <= 60, "the subscriber was never dropped"
            register(client, model)
            store(client, model, f"s{rounds}", list(range(16 + 400 * BLOCK)), seed=rounds)
            client.release_sequence(f"s{rounds}")
            client.delete_model(model, force=True)
        assert d.scrape().value("kvpool_kv_event_subscribers") == 0
        # What was in flight arrives, then the precise status.
        with pytest.raises(grpc.RpcError) as e:
            for _ in feed:
                pass
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert KvpoolError.from_rpc_error(e.value, "SubscribeKvEvents").reason == "LIMIT"
        # A fresh subscription works.
        again = subscribe(client)
        assert next(again).WhichOneof("event") == "all_cleared"
        again.cancel()


def test_subscribers_beyond_the_cap_are_refused():
    with ObservedDaemon(["--kv_events_max_subscribers=2"]) as d, d.client() as client:
        feeds = [subscribe(client) for _ in range(2)]
        for feed in feeds:
            assert next(feed).WhichOneof("event") == "all_cleared"
        with pytest.raises(grpc.RpcError) as e:
            next(subscribe(client))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert KvpoolError.from_rpc_error(e.value, "SubscribeKvEvents").reason == "LIMIT"
        feeds[0].cancel()
        scraped = lambda: d.scrape().value("kvpool_kv_event_subscribers")
        for _ in range(3000):  # the daemon hears of the cancel asynchronously
            if scraped() == 1:
                break
        assert scraped() == 1
        again = subscribe(client)
        assert next(again).WhichOneof("event") == "all_cleared"
        again.cancel()
        feeds[1].cancel()
