"""The Python client against a real kvpoold: every RPC, the layer-wise push, numpy dtypes,
remote attention against dense attention, and the error codes clients branch on."""

from __future__ import annotations

import ml_dtypes
import grpc
import numpy as np
import pytest

from kvpool import (Client, ClientOptions, DType, KvpoolError, NO_RETRY, dense_attention,
                    merge_attention)
from kvpool.tensors import bf16_bits, bf16_to_float32

LAYERS, HQ, HKV, D = 3, 8, 2, 64
EXACT = {"method": "bypass", "sink_tokens": 16, "recent_tokens": 32, "block_tokens": 16,
         "demotion_batch": 16}


def kv(rng, tokens, layers=LAYERS):
    k = rng.standard_normal((layers, tokens, HKV, D), dtype=np.float32)
    v = rng.standard_normal((layers, tokens, HKV, D), dtype=np.float32)
    return k, v


def register_exact(client: Client, model_id: str):
    """Identity rotation + bypass quantizer: every path returns what was sent."""
    return client.register_model(model_id, q_heads=HQ, kv_heads=HKV, num_layers=LAYERS,
                                 head_dim=D, data_free="identity", quant=EXACT)


def exact_sequence(client: Client, uid: str):
    """An exact model (register_exact) and an empty sequence of it, named after `uid`."""
    model, seq = f"exact-{uid}", f"seq-{uid}"
    register_exact(client, model)
    client.create_sequence(model, seq)
    return model, seq


def test_health_stats_and_limits(client):
    assert client.health() == "SERVING"
    stats = client.get_stats()
    assert stats.service.backend == "cpu"
    limits = client.fit_to_server_limits()
    assert limits.max_chunk_bytes > 0
    assert client.chunk_bytes <= 2 * limits.max_chunk_bytes


def test_layerwise_push_is_bit_exact_in_any_layer_order(client, uid):
    model, seq = f"exact-{uid}", f"seq-{uid}"
    reg = register_exact(client, model)
    assert reg.model.shape.num_layers == LAYERS and not reg.already_registered
    assert register_exact(client, model).already_registered
    rng = np.random.default_rng(1)
    k, v = kv(rng, 100)
    kb, vb = k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)
    client.create_sequence(model, seq)
    small = Client(client.target, ClientOptions(chunk_bytes=4096))  # many messages per layer
    with small.open_append(seq, 100, dtype=DType.BF16, token_ids=range(100),
                           end_of_prefill=True) as stream:
        for layer in reversed(range(LAYERS)):  # any layer order
            stream.write_layer(layer, kb[layer], vb[layer])
    assert stream.messages_sent >= LAYERS * (100 * HKV * D * 2 * 2 // 4096)
    assert stream.bytes_sent == 2 * kb.nbytes
    info = stream.response.sequence
    assert info.total_tokens == 100 and info.sink_tokens == 16
    assert stream.response.to_sink + stream.response.to_history + stream.response.to_recent == 100
    back = client.read_kv(seq)
    assert back.k.dtype == ml_dtypes.bfloat16 and back.k.shape == (LAYERS, 100, HKV, D)
    np.testing.assert_array_equal(back.k.view(np.uint16), kb.view(np.uint16))
    np.testing.assert_array_equal(back.v.view(np.uint16), vb.view(np.uint16))
    part = client.read_kv(seq, layers=[2], token_start=10, num_tokens=5, bf16_as="uint16")
    assert part.k.dtype == np.uint16
    np.testing.assert_array_equal(part.k[0], kb[2, 10:15].view(np.uint16))
    small.close()
    client.release_sequence(seq)
    client.delete_model(model)


@pytest.mark.parametrize("dtype", [DType.FP32, DType.FP16])
def test_float_inputs_are_rounded_like_the_daemon(client, uid, dtype):
    """FP32/FP16 payloads are stored as BF16 by the daemon; our BF16 rounding agrees bit for
    bit, and an FP32 read returns the same values."""
    model, seq = exact_sequence(client, uid)
    k, v = kv(np.random.default_rng(2), 40)
    if dtype is DType.FP16:
        k, v = k.astype(np.float16), v.astype(np.float16)
    client.append_kv(seq, k, v, end_of_prefill=True)  # dtype from the arrays
    back = client.read_kv(seq, dtype=DType.FP32)
    assert back.k.dtype == np.float32
    np.testing.assert_array_equal(back.k, bf16_to_float32(bf16_bits(k.astype(np.float32))))
    np.testing.assert_array_equal(back.v, bf16_to_float32(bf16_bits(v.astype(np.float32))))
    client.delete_model(model, force=True)


def test_remote_attention_matches_dense_and_merges(client, uid):
    model, seq = exact_sequence(client, uid)
    rng = np.random.default_rng(3)
    k, v = kv(rng, 300)
    client.append_kv(seq, k[:, :200], v[:, :200], token_ids=range(200), end_of_prefill=True)
    stored_k, stored_v = bf16_to_float32(bf16_bits(k)), bf16_to_float32(bf16_bits(v))
    q = rng.standard_normal((2, HQ, D), dtype=np.float32)
    for layer in range(LAYERS):
        r = client.attend(model, layer, {seq: q})[seq]
        assert r.attended_tokens == 200 and r.out.shape == (2, HQ, D) and r.lse.shape == (2, HQ)
        ref_o, ref_lse = dense_attention(q, stored_k[layer, :200], stored_v[layer, :200])
        np.testing.assert_allclose(r.out, ref_o, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(r.lse, ref_lse, rtol=1e-5, atol=1e-5)
        # The engine holds tokens 200..299 itself: merged == dense over all 300.
        loc_o, loc_lse = dense_attention(q, stored_k[layer, 200:], stored_v[layer, 200:])
        o, lse = merge_attention(r.out, r.lse, loc_o, loc_lse)
        all_o, all_lse = dense_attention(q, stored_k[layer], stored_v[layer])
        np.testing.assert_allclose(o, all_o, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse, all_lse, rtol=1e-5, atol=1e-5)
    client.delete_model(model, force=True)


def test_decode_appends_demote_and_describe(client, uid):
    model, seq = exact_sequence(client, uid)
    rng = np.random.default_rng(4)
    k, v = kv(rng, 64)
    client.append_kv(seq, k, v, end_of_prefill=True)
    demoted = 0
    for step in range(20):
        dk, dv = kv(rng, 1)
        r = client.append_decode(seq, dk[:, 0], dv[:, 0], token_start=64 + step)
        demoted += r.demoted_tokens
    info = client.describe_sequence(seq)
    assert info.total_tokens == 84
    assert info.sink_tokens + info.history_tokens + info.recent_tokens == 84
    assert 32 <= info.recent_tokens < 32 + 16 and demoted > 0
    assert info.bf16_equivalent_bytes == 84 * LAYERS * HKV * D * 2 * 2
    with pytest.raises(KvpoolError) as e:  # a repeated token_start never appends twice
        client.append_decode(seq, dk[:, 0], dv[:, 0], token_start=64)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert client.seal_sequence(seq).state == 3  # SEQUENCE_STATE_SEALED
    client.delete_model(model, force=True)


def test_prefix_lookup_reuse_and_blocks(client, uid):
    model = f"int2-{uid}"
    client.register_model(model, q_heads=HQ, kv_heads=HKV, num_layers=LAYERS, head_dim=D,
                          data_free="hadamard",
                          quant={"sink_tokens": 16, "recent_tokens": 32, "block_tokens": 16})
    rng = np.random.default_rng(5)
    k, v = kv(rng, 160)
    ids = list(range(1000, 1160))
    client.create_sequence(model, f"a-{uid}")
    r = client.append_kv(f"a-{uid}", k, v, token_ids=ids, end_of_prefill=True)
    assert r.published_units
    found = client.lookup_prefix(model, ids)
    assert found.matched_tokens >= 16 and found.matched_tokens % 16 == 0
    created = client.create_sequence(model, f"b-{uid}", prefix_token_ids=ids)
    assert created.reused_tokens == found.matched_tokens
    blocks = client.read_blocks(f"a-{uid}", layers=[1])
    h = blocks.header
    assert h.sink_tokens + h.history_tokens + h.recent_tokens == 160
    layer = blocks.layers[0]
    assert layer.layer == 1 and layer.sink_k.shape == (h.sink_tokens, HKV, D)
    assert layer.recent_v.shape == (h.recent_tokens, HKV, D)
    assert len(layer.blocks) == -(-h.history_tokens // h.block_layout.tokens)
    assert all(len(b.data) == h.block_layout.block_bytes for b in layer.blocks)
    desc = client.describe_model(model, include_rotation=True)
    assert desc.info.rotation_kind == 2 and len(desc.k_rotation) == LAYERS
    m = desc.k_rotation[0]
    np.testing.assert_allclose(m @ m.T, np.eye(D), atol=1e-5)
    assert [x.model_id for x in client.list_models()].count(model) == 1
    with pytest.raises(KvpoolError) as e:
        client.delete_model(model)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert client.delete_model(model, force=True).released_sequences == 2


def test_errors_carry_code_and_rpc(client, uid):
    with pytest.raises(KvpoolError) as e:
        client.describe_sequence(f"nope-{uid}")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.rpc == "DescribeSequence"
    assert not e.value.retryable and e.value.reason is None
    model, seq = exact_sequence(client, uid)
    with pytest.raises(KvpoolError) as e:
        client.create_sequence(model, seq)
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(KvpoolError) as e:
        client.register_model(model, q_heads=HQ, kv_heads=HKV, num_layers=LAYERS, head_dim=D,
                               data_free="hadamard")
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    k, v = kv(np.random.default_rng(6), 8)
    client.append_kv(seq, k, v, end_of_prefill=True)
    with pytest.raises(KvpoolError) as e:  # wrong query shape
        client.attend(model, 0, {seq: np.zeros((HQ + 1, D), np.float32)})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.rpc == "Attend"
    with pytest.raises(KvpoolError) as e:  # a query value out of range
        client.attend(model, 0, {seq: np.full((HQ, D), 1e6, np.float32)})
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
    client.delete_model(model, force=True)


def test_failed_and_cancelled_streams_change_nothing(client, uid):
    model, seq = exact_sequence(client, uid)
    k, v = kv(np.random.default_rng(7), 32)
    # A layer outside the model: the daemon fails the call, the stream reports it.
    with pytest.raises(KvpoolError) as e:
        with client.open_append(seq, 32, end_of_prefill=True) as stream:
            stream.write_layer(0, k[0], v[0])
            stream.write_layer(LAYERS + 5, k[1], v[1])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.rpc == "AppendKv"
    # A missing layer fails at commit.
    with pytest.raises(KvpoolError) as e:
        with client.open_append(seq, 32, end_of_prefill=True) as stream:
            stream.write_layer(0, k[0], v[0])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # Cancelled: rolled back.
    stream = client.open_append(seq, 32, end_of_prefill=True)
    stream.write_layer(0, k[0], v[0])
    stream.cancel()
    with pytest.raises(KvpoolError) as e:
        stream.finish()
    assert e.value.code == grpc.StatusCode.CANCELLED
    with pytest.raises(KvpoolError) as e:  # shapes are checked before anything is sent
        client.append_kv(seq, k[:, :, :1], v, end_of_prefill=True)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.rpc == "AppendKv"
    assert client.describe_sequence(seq).total_tokens == 0
    # The sequence still takes a whole append (retrying ABORTED while the rollback finishes).
    retrying = Client(client.target)
    for _ in range(200):
        try:
            retrying.append_kv(seq, k, v, end_of_prefill=True)
            break
        except KvpoolError as err:
            if err.code != grpc.StatusCode.ABORTED:
                raise
    assert client.describe_sequence(seq).total_tokens == 32
    retrying.close()
    client.delete_model(model, force=True)


def test_unreachable_daemon_is_unavailable():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = Client(f"127.0.0.1:{port}", ClientOptions(deadline_s=5.0, retry=NO_RETRY))
    with pytest.raises(KvpoolError) as e:
        c.get_stats()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.retryable
    c.close()
