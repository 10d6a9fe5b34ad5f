"""Shared pieces of the SmolLM2 prefill/decode split: prompts, the batched decode step, the
daemon's tier layout, and the local views of a codec.

The model is calibration/smollm2.py (an exact numpy forward pass of SmolLM2-135M-Instruct); the
workers of this folder run it in separate processes and talk to kvpoold through the kvpool
Python package.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "calibration"))

import smollm2  # noqa: E402
import texts  # noqa: E402

from kvpool import dense_attention, merge_attention  # noqa: E402
from kvpool.tensors import bf16_bits, bf16_to_float32  # noqa: E402

# The questions asked about the held-out document (GPL-3, never seen by the calibration).
QUESTIONS = [
    "What is the name of this license?",
    "Who publishes this license, according to the text?",
    "Summarize what the preamble says about freedom, in one sentence.",
]
DOCUMENT_TOKENS = 2048  # tokens of the document, so that every prompt has more than 2048


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values of x rounded to BF16 (what a BF16 KV cache holds)."""
    return bf16_to_float32(bf16_bits(x))


@dataclasses.dataclass
class Prompt:
    """One prompt: a shared prefix (chat header + document + 'Question: ') and a suffix."""

    prefix_ids: List[int]
    suffix_ids: List[int]
    question: str

    @property
    def ids(self) -> List[int]:
        return self.prefix_ids + self.suffix_ids


def build_prompts(tok: "smollm2.Tokenizer", count: int,
                  document_tokens: int = DOCUMENT_TOKENS) -> List[Prompt]:
    """`count` chat prompts that share one document of `document_tokens` tokens (GPL-3's
    start, cut at a token boundary) and ask different questions. The pieces are tokenized
    separately, so that every prompt starts with exactly the same token ids."""
    head = tok.encode("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                      "trained by Hugging Face<|im_end|>\n<|im_start|>user\n")
    doc = tok.encode(texts.eval_text())[:document_tokens]
    prefix = head + doc + tok.encode("\n\nQuestion: ")
    prompts = []
    for q in QUESTIONS[:count]:
        suffix = tok.encode(q) + tok.encode("<|im_end|>\n<|im_start|>assistant\n")
        prompts.append(Prompt(prefix, suffix, q))
    return prompts


def load_model():
    """The model (weights memory-mapped from the cache beside the GGUF) and tokenizer."""
    return smollm2.Model.load(cache=True), smollm2.Tokenizer.from_gguf()


# -- prefill ---------------------------------------------------------------------------------------


def attend_with_past(q: np.ndarray, k_all: np.ndarray, v_all: np.ndarray,
                     start: int) -> np.ndarray:
    """Causal attention of new queries q [n, Hq, D] at positions start..start+n-1 over keys
    k_all/v_all [start + n, Hkv, D] (past + new)."""
    if start == 0:
        return smollm2.causal_attention(q, k_all, v_all)
    n, hq, d = q.shape
    hkv = k_all.shape[1]
    g = hq // hkv
    qg = q.reshape(n, hkv, g, d) * np.float32(1.0 / np.sqrt(d))
    logits = np.einsum("nhgd,thd->nhgt", qg, k_all)
    mask = np.arange(start + n)[None, :] > (start + np.arange(n))[:, None]  # [n, T]
    logits[np.broadcast_to(mask[:, None, None, :], logits.shape)] = -np.inf
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("nhgt,thd->nhgd", p, v_all).reshape(n, hq, d).astype(np.float32)


def prefill_forward(model, ids: Sequence[int], start: int,
                    past: Optional[List[Tuple[np.ndarray, np.ndarray]]],
                    on_layer: Callable[[int, np.ndarray, np.ndarray], None]):
    """Runs tokens `ids` at positions start.. over a past of `start` tokens (per layer K, V
    float32 [start, Hkv, D], or None when start == 0). The prefill engine attends over its own
    BF16 cache (past and new K/V rounded to BF16). Calls on_layer(layer, k, v) with each layer's
    new K/V [n, Hkv, D] (float32, post-RoPE) as soon as it is computed. Returns the logits of
    the last token and this chunk's K/V per layer."""
    ids = np.asarray(ids, dtype=np.int64)
    positions = np.arange(start, start + len(ids))
    x = model.w["token_embd.weight"][ids].astype(np.float32)
    kv = []
    for layer in range(model.cfg.num_layers):
        q, k, v = model.qkv(layer, x, positions)
        on_layer(layer, k, v)
        kv.append((k, v))
        kb, vb = round_bf16(k), round_bf16(v)
        if past is not None:
            kb = np.concatenate([round_bf16(past[layer][0]), kb])
            vb = np.concatenate([round_bf16(past[layer][1]), vb])
        o = attend_with_past(q, kb, vb, start)
        x = x + o.reshape(len(ids), -1) @ model.w[f"blk.{layer}.attn_output.weight"].T
        x = x + model.mlp(layer, x)
    h = model.rms_norm(x[-1:], model.w["output_norm.weight"])
    return (h @ model.w["output.weight"].T)[0], kv


# -- decode ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class StepTimes:
    model_s: float = 0.0  # the model's own compute (projections, MLP, logits)
    attention_s: float = 0.0  # attention (remote calls or local), merge included


def decode_step(model, tokens: Sequence[int], positions: Sequence[int],
                attend: Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray],
                times: Optional[StepTimes] = None):
    """One greedy decode step for a batch of rows. Row i feeds tokens[i] at positions[i];
    attend(layer, q [B, Hq, D], k [B, Hkv, D], v [B, Hkv, D]) returns the attention output
    [B, Hq, D] of each row over its stored tokens and itself. Returns logits [B, vocab] and
    the rows' new K and V [layers, B, Hkv, D] (float32)."""
    t_attn = 0.0
    t0 = time.perf_counter()
    x = model.w["token_embd.weight"][np.asarray(tokens, dtype=np.int64)].astype(np.float32)
    pos = np.asarray(positions)
    ks, vs = [], []
    for layer in range(model.cfg.num_layers):
        q, k, v = model.qkv(layer, x, pos)
        ks.append(k)
        vs.append(v)
        ta = time.perf_counter()
        o = attend(layer, q, k, v)
        t_attn += time.perf_counter() - ta
        x = x + o.reshape(len(tokens), -1) @ model.w[f"blk.{layer}.attn_output.weight"].T
        x = x + model.mlp(layer, x)
    h = model.rms_norm(x, model.w["output_norm.weight"])
    logits = h @ model.w["output.weight"].T
    if times is not None:
        times.attention_s += t_attn
        times.model_s += time.perf_counter() - t0 - t_attn
    return logits, np.stack(ks), np.stack(vs)


def self_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray):
    """Each row's attention over its own new token (BF16, as the engine holds it):
    q [B, Hq, D], k/v [B, Hkv, D] -> out [B, Hq, D], lse [B, Hq]."""
    outs, lses = [], []
    for i in range(q.shape[0]):
        o, lse = dense_attention(q[i:i + 1], round_bf16(k[i:i + 1]), round_bf16(v[i:i + 1]))
        outs.append(o[0])
        lses.append(lse[0])
    return np.stack(outs), np.stack(lses)


# -- the daemon's tier layout (kernels/mixed_sequence.cc, PlanAppend) ---------------------------------


@dataclasses.dataclass
class TierLayout:
    """Which tokens of a sequence are INT2: positions [sink_cap, sink_cap + history)."""

    sink_cap: int
    recent_cap: int
    batch: int
    sink: int = 0
    history: int = 0
    recent: int = 0

    @property
    def total(self) -> int:
        return self.sink + self.history + self.recent

    def attach_prefix(self, reused: int) -> None:
        """CreateSequence with a cached prefix: the sink and whole history blocks."""
        self.sink = min(reused, self.sink_cap)
        self.history = reused - self.sink

    def final_prefill(self, tokens: int) -> None:
        to_sink = min(tokens, max(0, self.sink_cap - self.sink))
        rest = tokens - to_sink
        to_recent = min(rest, self.recent_cap)
        self.sink += to_sink
        self.history += rest - to_recent
        self.recent += to_recent

    def decode(self) -> None:
        if self.recent + 1 >= self.recent_cap + self.batch:
            demote = min(self.batch, self.recent)
            to_history = self.batch - demote
            self.history += demote + to_history
            self.recent += (1 - to_history) - demote
        else:
            self.recent += 1

    def int2_mask(self, length: int) -> np.ndarray:
        pos = np.arange(length)
        return (pos >= self.sink) & (pos < self.sink + self.history)


class _Rows:
    """Per-layer K/V rows with room to grow (decode appends without copying the past)."""

    def __init__(self, rows: np.ndarray, capacity: int) -> None:
        self.buf = np.empty((capacity,) + rows.shape[1:], np.float32)
        self.buf[:len(rows)] = rows
        self.n = len(rows)

    def append(self, row: np.ndarray) -> None:
        if self.n == len(self.buf):
            self.buf = np.concatenate([self.buf, np.empty_like(self.buf)])
        self.buf[self.n] = row
        self.n += 1

    @property
    def rows(self) -> np.ndarray:
        return self.buf[:self.n]


class CodecRows:
    """One sequence held in-process under a kvpool codec: every stored token as attention sees
    it, its BF16-tier view (sink, recent) or its INT2-history view (both in the engine's basis,
    from the production codec via calibration/codec_c_api.h), switched by the daemon's tier
    layout; demotion turns recent rows into their history view."""

    def __init__(self, codec, layout: TierLayout, k: np.ndarray, v: np.ndarray,
                 extra: int = 64) -> None:
        """k, v: the prompt's K/V [layers, T, Hkv, D] (float32; rounded to BF16 first, as the
        daemon receives BF16)."""
        self.codec = codec
        self.layout = layout
        self.k, self.v, self.k_hist, self.v_hist = [], [], [], []
        mask = layout.int2_mask(k.shape[1])[:, None, None]
        for layer in range(k.shape[0]):
            kt, kh = codec.roundtrip(layer, 0, round_bf16(k[layer]))
            vt, vh = codec.roundtrip(layer, 1, round_bf16(v[layer]))
            cap = k.shape[1] + extra
            self.k.append(_Rows(np.where(mask, kh, kt), cap))
            self.v.append(_Rows(np.where(mask, vh, vt), cap))
            self.k_hist.append(_Rows(kh, cap))
            self.v_hist.append(_Rows(vh, cap))

    def views(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        return self.k[layer].rows, self.v[layer].rows

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Appends one decode token, k/v [layers, Hkv, D], and applies the decode tier plan."""
        old_end = self.layout.sink + self.layout.history
        self.layout.decode()
        new_end = self.layout.sink + self.layout.history
        for layer in range(len(self.k)):
            kt, kh = self.codec.roundtrip(layer, 0, round_bf16(k[layer][None]))
            vt, vh = self.codec.roundtrip(layer, 1, round_bf16(v[layer][None]))
            self.k_hist[layer].append(kh[0])
            self.v_hist[layer].append(vh[0])
            self.k[layer].append(kt[0])
            self.v[layer].append(vt[0])
            if new_end > old_end:  # demoted: these rows are INT2 from now on
                self.k[layer].buf[old_end:new_end] = self.k_hist[layer].buf[old_end:new_end]
                self.v[layer].buf[old_end:new_end] = self.v_hist[layer].buf[old_end:new_end]


class Bf16Rows:
    """One sequence with a plain BF16 KV cache (the reference)."""

    def __init__(self, k: np.ndarray, v: np.ndarray, extra: int = 64) -> None:
        self.k = [_Rows(round_bf16(k[layer]), k.shape[1] + extra) for layer in range(len(k))]
        self.v = [_Rows(round_bf16(v[layer]), k.shape[1] + extra) for layer in range(len(v))]

    def views(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        return self.k[layer].rows, self.v[layer].rows

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        for layer in range(len(self.k)):
            self.k[layer].append(round_bf16(k[layer]))
            self.v[layer].append(round_bf16(v[layer]))


def local_attend(rows: Sequence, layer: int, q: np.ndarray, k: np.ndarray,
                 v: np.ndarray) -> np.ndarray:
    """In-process attention of each row over its stored tokens (rows[i].views) merged with its
    own new token, exactly as the remote path merges the daemon's result."""
    so, slse = self_attention(q, k, v)
    out = np.empty_like(q)
    for i, row in enumerate(rows):
        kk, vv = row.views(layer)
        o, lse = dense_attention(q[i:i + 1], kk, vv)
        out[i] = merge_attention(o, lse, so[i:i + 1], slse[i:i + 1])[0][0]
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    return smollm2.log_softmax(x.astype(np.float64))


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def percentile_ms(samples: Sequence[float], p: float) -> float:
    return float(np.percentile(np.asarray(samples) * 1e3, p)) if len(samples) else float("nan")



def codec_for(lib_path: str, rotation: str, num_layers: int, head_dim: int,
              clip: Optional[Tuple[float, float]] = None):
    """The production codec in-process (calibration/fidelity.py's ctypes wrapper of
    libkvpool_eval_codec.so): a rotation file with its own quant config, or a data-free
    rotation ("hadamard") with clip ratios."""
    import fidelity

    lib = fidelity.CodecLib(lib_path)
    if clip is None:
        return fidelity.Codec(lib, rotation, num_layers, head_dim, use_file_quant=True)
    return fidelity.Codec(lib, rotation, num_layers, head_dim, clip_k=clip[0], clip_v=clip[1])

