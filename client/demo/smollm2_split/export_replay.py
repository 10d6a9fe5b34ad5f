"""Packs a capture of the SmolLM2 split (run_split.py --capture DIR) into one safetensors file
for tests/gpu/split_replay.cc, which replays it against another kvpoold (the GPU daemon on the
lent H200 machine, which has no Python packages and takes at most 64 MiB per run).

The file holds prompt 0's K/V as the prefill pushed it, and per registered model (calibrated,
data-free) the greedy decode's steps: the query of every layer, the K/V appended after the
step, the CPU daemon's Attend output and LSE, the generated tokens and the top-two logit margin
of each step (what decides whether a small difference in attention can change a greedy token).

    python export_replay.py --capture DIR --out replay.safetensors
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import split_common as sc
from kvpool.tensors import bf16_to_float32
import st_io  # calibration/ (on the path through split_common)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", required=True, help="run_split.py --capture folder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    plan = sc.read_json(os.path.join(args.capture, "plan.json"))
    decode = sc.read_json(os.path.join(args.capture, "decode.json"))
    prompt = sc.read_json(os.path.join(args.capture, "prompt0.json"))
    kv = np.load(os.path.join(args.capture, "prompt0.kv.npz"))
    steps = np.load(os.path.join(args.capture, "decode_capture.npz"))

    tensors = {"k": ("BF16", bf16_to_float32(kv["k"])), "v": ("BF16", bf16_to_float32(kv["v"])),
               "token_ids": ("I32", np.asarray(prompt["ids"], np.int32))}
    models = []
    for j, row in enumerate(decode["rows"]):
        if row["prompt"] != 0:
            continue
        c = [x for x in plan["configs"] if x["name"] == row["config"]][0]
        n = len(row["tokens"]) - 1  # decode steps this row ran
        if n < 1:
            continue
        name = f"m{len(models)}"
        per = {x: np.stack([steps[f"step{s}.row{j}.{x}"] for s in range(1, n + 1)])
               for x in ("q", "out", "lse", "k", "v")}
        tensors[f"{name}.q"] = ("F32", per["q"].astype(np.float32))  # [S, layers, Hq, D]
        tensors[f"{name}.out"] = ("F32", per["out"].astype(np.float32))
        tensors[f"{name}.lse"] = ("F32", per["lse"].astype(np.float32))  # [S, layers, Hq]
        # [S, layers, Hkv, D]: what was appended
        tensors[f"{name}.k"] = ("BF16", per["k"])
        tensors[f"{name}.v"] = ("BF16", per["v"])
        tensors[f"{name}.tokens"] = ("I32", np.asarray(row["tokens"], np.int32))  # [S + 1]
        tensors[f"{name}.margins"] = ("F32", np.asarray(row["margins"], np.float32))
        models.append({"name": c["name"], "model_id": row["model_id"],
                       "rotation": "file" if c["codec_rotation"] != "hadamard" else "hadamard",
                       "quant": c["quant"], "steps": n})
    # "m0=MODEL_ID:file,m1=MODEL_ID:hadamard": which tensors belong to which model and how to
    # register it (the rotation file of run_split.py, or the data-free Hadamard rotation).
    st_io.write(args.out, tensors, {
        "models": ",".join(f"m{i}={m['model_id']}:{m['rotation']}" for i, m in enumerate(models)),
        "configs": json.dumps(models), "prompt_tokens": str(len(prompt["ids"]))})
    size = os.path.getsize(args.out)
    print(f"wrote {args.out}: {len(prompt['ids'])} prompt tokens, "
          f"{', '.join(m['name'] + ' ' + str(m['steps']) + ' steps' for m in models)}, "
          f"{size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
