"""Random decode batches in kvpool's block format (kernels/block_layout.h), written with numpy,
and a float64 reference over the values they hold, for the attention backend's tests.

History blocks are 2-bit (G = head_dim): random codes, and fp16 scale and min pairs that keep
the rows real-like; BF16 pages hold normal values truncated to BF16. Block ids are shuffled,
tables padded with block 0, and the history and recent tiers start part way into a block.

    batch = make_batch(model, seqs=[(16, 70, 9), (0, 0, 0)], seed=1)
    out, lse = reference(model, batch)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np


def load_backend_module():
    """kvpool.attention_backend, from the installed package or else from the source tree (the
    GPU machine runs these files without installing the package)."""
    try:
        from kvpool import attention_backend

        return attention_backend
    except ImportError:
        path = Path(__file__).resolve().parents[1] / "kvpool" / "attention_backend.py"
        spec = importlib.util.spec_from_file_location("kvpool_attention_backend", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while defining
        spec.loader.exec_module(module)
        return module


def _segment_bytes(model, bits):
    t, d = model.block_tokens, model.head_dim
    groups = 0 if bits == 16 else 1
    raw = 2 * t * d * bits // 8 + 2 * t * groups * 4
    return (raw + 15) // 16 * 16


def _assign(counts, firsts, bt, ids):
    stride = max([1] + [(f + c + bt - 1) // bt for f, c in zip(firsts, counts)])
    tables = np.zeros((len(counts), stride), dtype=np.int32)
    for i, (f, c) in enumerate(zip(firsts, counts)):
        for b in range(f // bt, (f + c + bt - 1) // bt):
            tables[i, b] = ids.pop()
    return tables


def make_batch(model, seqs, seed):
    """A batch for `model` (AttentionModel, 2-bit history with G = D): `seqs` lists
    (sink, history, recent) token counts per sequence. Returns a dict of numpy arrays."""
    rng = np.random.default_rng(seed)
    bt, d, hkv = model.block_tokens, model.head_dim, model.kv_heads
    n = len(seqs)
    counts = [np.array([s[t] for s in seqs], dtype=np.int32) for t in range(3)]
    firsts = [np.zeros(n, dtype=np.int32), np.array([(5 * i) % bt for i in range(n)], np.int32),
              np.array([(3 * i + 1) % bt for i in range(n)], np.int32)]
    n_hist = 3 + sum(int(f + c) // bt + 1 for f, c in zip(firsts[1], counts[1]))
    n_bf16 = 3 + sum(int(f + c) // bt + 1 for t in (0, 2) for f, c in zip(firsts[t], counts[t]))
    hist_ids = list(rng.permutation(n_hist).astype(np.int32))
    bf16_ids = list(rng.permutation(n_bf16).astype(np.int32))
    tables = [_assign(counts[0], firsts[0], bt, bf16_ids),
              _assign(counts[1], firsts[1], bt, hist_ids),
              _assign(counts[2], firsts[2], bt, bf16_ids)]

    # History blocks: per KV head [K codes][V codes][K meta][V meta], padded to 16 bytes.
    seg = _segment_bytes(model, 2)
    hist = rng.integers(0, 256, size=(n_hist, hkv, seg), dtype=np.uint8)
    code_bytes = bt * d // 4
    scale = rng.uniform(0.02, 0.1, size=(n_hist, hkv, 2, bt)).astype(np.float16)
    minimum = rng.uniform(-0.15, -0.05, size=(n_hist, hkv, 2, bt)).astype(np.float16)
    meta = np.stack([scale.view(np.uint16), minimum.view(np.uint16)], axis=-1)  # [.., 2, bt, 2]
    hist[:, :, 2 * code_bytes:2 * code_bytes + 2 * bt * 4] = (
        meta.reshape(n_hist, hkv, -1).view(np.uint8))
    # BF16 pages: per KV head [K rows][V rows].
    seg16 = _segment_bytes(model, 16)
    values = (rng.standard_normal((n_bf16, hkv, seg16 // 2)) * 0.5).astype(np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)

    rot_k = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)
    rot_v = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)
    queries = (rng.standard_normal((n, model.q_heads, d)) * 0.5).astype(np.float32)
    return {
        "history_pool": hist.reshape(-1), "bf16_pool": bf16.reshape(-1),
        "num_history_blocks": n_hist, "num_bf16_blocks": n_bf16,
        "tables": tables, "firsts": firsts, "counts": counts,
        "queries": queries, "rotation_k": rot_k, "rotation_v": rot_v,
    }


def _history_rows(model, batch, block, slot, tensor):
    """[kv_heads, D] float64 values of one history token (x = min + code * scale)."""
    bt, d, hkv = model.block_tokens, model.head_dim, model.kv_heads
    seg = _segment_bytes(model, 2)
    code_bytes = d // 4
    blk = batch["history_pool"].reshape(-1, hkv, seg)[block]
    rows = np.empty((hkv, d))
    for h in range(hkv):
        at = tensor * bt * code_bytes + slot * code_bytes
        codes = blk[h, at:at + code_bytes]
        unpacked = np.stack([(codes >> (2 * i)) & 3 for i in range(4)], axis=1).reshape(-1)
        m_at = 2 * bt * code_bytes + tensor * bt * 4 + slot * 4
        s, mn = blk[h, m_at:m_at + 4].view(np.float16).astype(np.float64)
        rows[h] = mn + unpacked * s
    return rows


def _bf16_rows(model, batch, block, slot, tensor):
    bt, d, hkv = model.block_tokens, model.head_dim, model.kv_heads
    seg = _segment_bytes(model, 16)
    blk = batch["bf16_pool"].reshape(-1, hkv, seg)[block]
    at = tensor * bt * d * 2 + slot * d * 2
    words = blk[:, at:at + 2 * d].copy().view(np.uint16).astype(np.uint32) << 16
    return words.view(np.float32).astype(np.float64)


def reference(model, batch):
    """Float64 attention over what the batch holds: out [B, Hq, D], lse [B, Hq]."""
    bt, d = model.block_tokens, model.head_dim
    n = batch["queries"].shape[0]
    group = model.q_heads // model.kv_heads
    out = np.zeros((n, model.q_heads, d))
    lse = np.full((n, model.q_heads), -np.inf)
    mk = batch["rotation_k"].astype(np.float64)
    mv = batch["rotation_v"].astype(np.float64)
    for i in range(n):
        keys, vals = [], []
        for t in range(3):
            rows = _history_rows if t == 1 else _bf16_rows
            first, count = int(batch["firsts"][t][i]), int(batch["counts"][t][i])
            for p in range(first, first + count):
                block = int(batch["tables"][t][i, p // bt])
                keys.append(rows(model, batch, block, p % bt, 0))
                vals.append(rows(model, batch, block, p % bt, 1))
        if not keys:
            continue
        k = np.stack(keys)  # [n, Hkv, D]
        v = np.stack(vals)
        q = batch["queries"][i].astype(np.float64) @ mk  # [Hq, D]
        for j in range(model.q_heads):
            logits = k[:, j // group] @ q[j] / np.sqrt(d)
            mx = logits.max()
            w = np.exp(logits - mx)
            out[i, j] = (w @ v[:, j // group]) / w.sum() @ mv.T
            lse[i, j] = mx + np.log(w.sum())
    return out, lse


def call_kwargs(backend_module, model, batch, convert=lambda x: x):
    """The keyword arguments of AttentionBackend.decode for `batch` (arrays through `convert`)."""
    tiers = [backend_module.Tier(convert(batch["tables"][t]), convert(batch["firsts"][t]),
                                 convert(batch["counts"][t])) for t in range(3)]
    return {
        "history_pool": backend_module.Pool(convert(batch["history_pool"]),
                                            batch["num_history_blocks"]),
        "bf16_pool": backend_module.Pool(convert(batch["bf16_pool"]), batch["num_bf16_blocks"]),
        "sink": tiers[0], "history": tiers[1], "recent": tiers[2],
        "rotation_k": convert(batch["rotation_k"]), "rotation_v": convert(batch["rotation_v"]),
    }


def assert_near(out, lse, ref_out, ref_lse, rel):
    """out / lse within `rel` of the reference (relative to each row's largest value)."""
    out = np.asarray(out, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    empty = np.isinf(ref_lse)
    assert np.array_equal(np.isinf(lse), empty)
    assert np.all(out[empty] == 0)
    assert np.allclose(lse[~empty], ref_lse[~empty], rtol=0, atol=rel * 10)
    scale = np.abs(ref_out).max(axis=-1, keepdims=True)
    err = np.abs(out - ref_out) / np.where(scale > 0, scale, 1)
    assert err.max() <= rel, f"worst relative error {err.max():.3e} > {rel}"
    return float(err.max())
