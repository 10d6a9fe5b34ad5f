"""Attention helpers: merging partial results through their log-sum-exp, and dense attention.

A decode worker that holds some tokens itself (the token being decoded, a local window) and
leaves the rest to kvpoold merges the two partial attentions exactly:

    M = max(lse_a, lse_b)
    o = (e^(lse_a - M) o_a + e^(lse_b - M) o_b) / (e^(lse_a - M) + e^(lse_b - M))
    lse = M + ln(e^(lse_a - M) + e^(lse_b - M))

Shapes: o [..., heads, head_dim], lse [..., heads] (natural log, -inf for no tokens).
"""

from __future__ import annotations

from typing import Tuple

import numpy as np


def merge_attention(o_a: np.ndarray, lse_a: np.ndarray, o_b: np.ndarray,
                    lse_b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Exact merge of two attentions over disjoint token sets; float32 results."""
    lse_a = np.asarray(lse_a, dtype=np.float32)
    lse_b = np.asarray(lse_b, dtype=np.float32)
    m = np.maximum(lse_a, lse_b)
    m = np.where(np.isfinite(m), m, np.float32(0))  # both empty: weights 0, output 0
    wa = np.exp(lse_a - m)
    wb = np.exp(lse_b - m)
    total = wa + wb
    safe = np.where(total > 0, total, np.float32(1))
    out = (wa[..., None] * o_a + wb[..., None] * o_b) / safe[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, m + np.log(safe), np.float32(-np.inf))
    return out.astype(np.float32), lse.astype(np.float32)


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray
                    ) -> Tuple[np.ndarray, np.ndarray]:
    """Attention of queries q [n, Hq, D] over every token of k, v [T, Hkv, D] (GQA: query
    head j reads KV head j // (Hq / Hkv)), scale 1/sqrt(D), no mask. Returns out [n, Hq, D]
    and lse [n, Hq] in float32; T = 0 gives zeros and -inf."""
    q = np.asarray(q, dtype=np.float32)
    k = np.asarray(k, dtype=np.float32)
    v = np.asarray(v, dtype=np.float32)
    n, hq, d = q.shape
    t, hkv, _ = k.shape
    if t == 0:
        return np.zeros((n, hq, d), np.float32), np.full((n, hq), -np.inf, np.float32)
    g = hq // hkv
    qg = q.reshape(n, hkv, g, d) * np.float32(1.0 / np.sqrt(d))
    logits = np.einsum("nhgd,thd->nhgt", qg, k)
    m = logits.max(axis=-1, keepdims=True)
    p = np.exp(logits - m)
    s = p.sum(axis=-1, keepdims=True)
    out = np.einsum("nhgt,thd->nhgd", p / s, v).reshape(n, hq, d)
    lse = (m + np.log(s))[..., 0].reshape(n, hq)
    return out.astype(np.float32), lse.astype(np.float32)
