"""Remote decode attention for an engine's attention backend, one call per layer.

The engine keeps some tokens itself (the newest ones, e.g. the tokens of this step and a local
window in its paged cache) and leaves the rest of each sequence to kvpoold. Per layer it calls
RemoteAttention with the step's queries and the K/V it still holds; the daemon attends over its
stored tokens (sink + INT2 history + recent), the engine's tokens are attended here, and the two
are merged exactly through their log-sum-exp (kvpool.attention.merge_attention).

    attn = RemoteAttention(client, "qwen3-4b")
    out, lse = attn(layer, ["req-1", "req-2"], q,                  # q [B, n, Hq, D]
                    local_k=[k1, k2], local_v=[v1, v2])            # each [t_i, Hkv, D]

Queries and the local K/V may be numpy arrays or torch tensors (any device); the result has
q's kind and device. Local tokens are attended by every query row of their sequence (no causal
mask among them), as in decode; pass a sequence's still-unstored current token as its local
K/V. gather_paged() reads a sequence's tokens out of a paged cache by its block table.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from kvpool.attention import dense_attention, merge_attention
from kvpool.client import Client
from kvpool.tensors import DType, as_numpy, to_torch


def gather_paged(cache: Any, block_table: Sequence[int], start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of a sequence from a paged cache [num_blocks, block_size, ...]
    addressed by its block table (token t lives in block block_table[t // block_size] at
    offset t % block_size). Returns [stop - start, ...] as float32."""
    c = as_numpy(cache)
    block_size = c.shape[1]
    pos = np.arange(start, stop)
    blocks = np.asarray(block_table, dtype=np.int64)[pos // block_size]
    return np.asarray(c[blocks, pos % block_size], dtype=np.float32)


class RemoteAttention:
    """Per-layer remote attention over kvpoold's stored tokens merged with local ones."""

    def __init__(self, client: Client, model_id: str, dtype: DType = DType.FP32) -> None:
        self.client = client
        self.model_id = model_id
        self.dtype = dtype

    def __call__(self, layer: int, sequence_ids: Sequence[str], q: Any,
                 local_k: Optional[Sequence[Any]] = None,
                 local_v: Optional[Sequence[Any]] = None) -> Tuple[Any, Any]:
        """q [B, n, Hq, D] (or [B, Hq, D] for one row each) -> out [B, n, Hq, D] (float32) and
        lse [B, n, Hq] (natural log), same leading shape as q."""
        qn = np.asarray(as_numpy(q), dtype=np.float32)
        squeeze = qn.ndim == 3
        if squeeze:
            qn = qn[:, None]
        results = self.client.attend(self.model_id, layer,
                                     [(s, qn[i]) for i, s in enumerate(sequence_ids)],
                                     dtype=self.dtype)
        out = np.empty_like(qn)
        lse = np.empty(qn.shape[:3], np.float32)
        for i, s in enumerate(sequence_ids):
            o, l = results[s].out, results[s].lse
            if local_k is not None and local_v is not None:
                lk = np.asarray(as_numpy(local_k[i]), dtype=np.float32)
                lv = np.asarray(as_numpy(local_v[i]), dtype=np.float32)
                lo, ll = dense_attention(qn[i], lk, lv)
                o, l = merge_attention(o, l, lo, ll)
            out[i], lse[i] = o, l
        if squeeze:
            out, lse = out[:, 0], lse[:, 0]
        if type(q).__module__.split(".")[0] == "torch":
            device = str(q.device)
            return to_torch(out, device), to_torch(lse, device)
        return out, lse
