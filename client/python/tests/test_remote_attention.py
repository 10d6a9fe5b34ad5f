"""The remote attention function as an engine's attention backend calls it: per layer, a batch
of sequences' decode queries, the daemon attending over what it stores, merged with the tokens
the engine still holds in its own paged cache (block tables, like vLLM's and SGLang's)."""

from __future__ import annotations

import numpy as np

from kvpool import dense_attention
from kvpool.connectors.remote_attention import RemoteAttention, gather_paged
from kvpool.tensors import bf16_bits, bf16_to_float32

LAYERS, HQ, HKV, D, BLOCK = 2, 8, 2, 64, 16


def test_remote_plus_local_paged_equals_dense(client, uid):
    model = f"attn-{uid}"
    client.register_model(model, q_heads=HQ, kv_heads=HKV, num_layers=LAYERS, head_dim=D,
                          data_free="identity",
                          quant={"method": "bypass", "sink_tokens": 16, "recent_tokens": 32})
    rng = np.random.default_rng(9)
    seqs, stored, local = [f"a-{uid}", f"b-{uid}"], [150, 97], [21, 40]
    full_k, full_v = [], []
    # The engine's paged cache holds each sequence's newest tokens.
    k_cache = np.zeros((32, BLOCK, HKV, D), np.float32)
    v_cache = np.zeros_like(k_cache)
    tables, free = [], list(range(32))[::-1]
    for s, n_stored, n_local in zip(seqs, stored, local):
        k = bf16_to_float32(bf16_bits(rng.standard_normal((LAYERS, n_stored + n_local, HKV, D),
                                                          dtype=np.float32)))
        v = bf16_to_float32(bf16_bits(rng.standard_normal(k.shape, dtype=np.float32)))
        full_k.append(k)
        full_v.append(v)
        client.create_sequence(model, s)
        client.append_kv(s, k[:, :n_stored], v[:, :n_stored], end_of_prefill=True)
        table = [free.pop() for _ in range(-(-n_local // BLOCK))]
        tables.append(table)
    attn = RemoteAttention(client, model)
    for layer in range(LAYERS):
        kc = np.zeros_like(k_cache)
        vc = np.zeros_like(v_cache)
        for i, table in enumerate(tables):  # this layer's cache, slots from the block table
            pos = np.arange(local[i])
            kc[np.asarray(table)[pos // BLOCK], pos % BLOCK] = full_k[i][layer, stored[i]:]
            vc[np.asarray(table)[pos // BLOCK], pos % BLOCK] = full_v[i][layer, stored[i]:]
        q = rng.standard_normal((2, 3, HQ, D), dtype=np.float32)  # 3 query rows each
        out, lse = attn(layer, seqs, q,
                        local_k=[gather_paged(kc, t, 0, n) for t, n in zip(tables, local)],
                        local_v=[gather_paged(vc, t, 0, n) for t, n in zip(tables, local)])
        assert out.shape == (2, 3, HQ, D) and lse.shape == (2, 3, HQ)
        for i in range(2):
            ref_o, ref_lse = dense_attention(q[i], full_k[i][layer], full_v[i][layer])
            np.testing.assert_allclose(out[i], ref_o, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(lse[i], ref_lse, rtol=1e-5, atol=1e-5)
        # One row per sequence, nothing held locally: the daemon's attention alone.
        o1, l1 = attn(layer, seqs, q[:, 0])
        ref_o, _ = dense_attention(q[0, :1], full_k[0][layer, :stored[0]],
                                   full_v[0][layer, :stored[0]])
        np.testing.assert_allclose(o1[0], ref_o[0], rtol=1e-4, atol=1e-5)
    client.delete_model(model, force=True)
