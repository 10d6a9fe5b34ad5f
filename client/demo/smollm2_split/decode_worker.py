"""The decode process of the SmolLM2 split: greedy decoding with the KV cache in kvpoold.

Every sequence the prefill pushed is one row of a batch. At each step, for every layer, the
worker sends the rows' queries to the daemon (one Attend call per model and layer, all of that
model's rows in it), merges the answer with attention over the token being decoded (which only
this process holds yet) through the log-sum-exp, and after the step appends every row's new
K/V for all layers with AppendDecode. Nothing of the prompt's K/V is in this process.

    python decode_worker.py --target 127.0.0.1:PORT --handoff DIR --plan plan.json \
        --role greedy --out decode.json [--capture capture.npz]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import split_common as sc
from kvpool import Client, ClientOptions, DType, merge_attention
from kvpool.tensors import bf16_bits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--handoff", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--role", default="greedy", help="which sequences of the plan to decode")
    ap.add_argument("--out", required=True)
    ap.add_argument("--capture", help="also save every Attend call's queries, outputs and the "
                    "appended K/V (for the GPU replay)")
    args = ap.parse_args()
    plan = sc.read_json(args.plan)
    model, tok = sc.load_model()
    client = Client(args.target, ClientOptions(deadline_s=600.0))

    rows = []  # one per (prompt, sequence of this role)
    for i in range(plan["prompts"]):
        info = sc.read_json(os.path.join(args.handoff, f"prompt{i}.json"))
        for s in plan["sequences"]:
            if s["role"] != args.role:
                continue
            rows.append({"prompt": i, "config": s["config"], "model_id": s["model_id"],
                         "seq": s["sequence_id"].format(prompt=i), "length": len(info["ids"]),
                         "tokens": [info["first_token"]], "margins": [info["first_margin"]],
                         "attended": [], "top5": [], "k": [], "v": [],
                         "done": info["first_token"] == tok.eos_id})
    new_tokens = plan["new_tokens"]
    attend_s, append_s, step_s = [], [], []
    times = sc.StepTimes()
    capture = {"q": [], "out": [], "lse": [], "k": [], "v": [], "rows": []}

    for step in range(1, new_tokens):
        active = [r for r in rows if not r["done"]]
        if not active:
            break
        t_step = time.perf_counter()
        positions = [r["length"] + step - 1 for r in active]
        step_q, step_o, step_lse = [], [], []

        def attend(layer, q, k, v):
            so, slse = sc.self_attention(q, k, v)
            out = np.empty_like(q)
            lay_o = np.empty_like(q)
            lay_lse = np.empty(q.shape[:2], np.float32)
            for model_id in sorted({r["model_id"] for r in active}):
                idx = [j for j, r in enumerate(active) if r["model_id"] == model_id]
                t = time.perf_counter()
                res = client.attend(model_id, layer, [(active[j]["seq"], q[j]) for j in idx])
                attend_s.append(time.perf_counter() - t)
                for j in idx:
                    r = res[active[j]["seq"]]
                    if layer == 0:
                        active[j]["attended"].append(r.attended_tokens)
                    lay_o[j], lay_lse[j] = r.out[0], r.lse[0]
                    out[j] = merge_attention(r.out, r.lse, so[j:j + 1], slse[j:j + 1])[0][0]
            step_q.append(q.copy())
            step_o.append(lay_o)
            step_lse.append(lay_lse)
            return out

        logits, ks, vs = sc.decode_step(model, [r["tokens"][-1] for r in active], positions,
                                        attend, times)
        for j, r in enumerate(active):
            t = time.perf_counter()
            client.append_decode(r["seq"], ks[:, j], vs[:, j], token_start=positions[j],
                                 dtype=DType.BF16)
            r["k"].append(ks[:, j])
            r["v"].append(vs[:, j])
            append_s.append(time.perf_counter() - t)
            top = np.argsort(logits[j])[-5:][::-1]
            r["tokens"].append(int(top[0]))
            r["margins"].append(float(logits[j][top[0]] - logits[j][top[1]]))
            r["top5"].append([[int(t), float(logits[j][t])] for t in top])
            r["done"] = int(top[0]) == tok.eos_id
        step_s.append(time.perf_counter() - t_step)
        if args.capture:
            capture["q"].append(np.stack(step_q, axis=1))  # [B, layers, Hq, D]
            capture["out"].append(np.stack(step_o, axis=1))
            capture["lse"].append(np.stack(step_lse, axis=1))
            capture["k"].append(np.transpose(ks, (1, 0, 2, 3)))  # [B, layers, Hkv, D]
            capture["v"].append(np.transpose(vs, (1, 0, 2, 3)))
            capture["rows"].append([rows.index(r) for r in active])

    # The K/V each row appended, for the in-process codec check (check_worker.py).
    np.savez(os.path.join(args.handoff, f"appended.{args.role}.npz"), **{
        f"row{j}.{name}": bf16_bits(np.stack(r[name])) if r[name] else np.zeros(0, np.uint16)
        for j, r in enumerate(rows) for name in ("k", "v")})
    if args.capture:
        flat = {}
        for step, idx in enumerate(capture["rows"]):
            for b, row in enumerate(idx):
                for name in ("q", "out", "lse", "k", "v"):
                    flat[f"step{step + 1}.row{row}.{name}"] = capture[name][step][b]
        np.savez(args.capture, **flat)
    generated = sum(len(r["tokens"]) - 1 for r in rows)
    sc.write_json(args.out, {
        "rows": [{k: r[k] for k in ("prompt", "config", "model_id", "seq", "length", "tokens",
                                    "margins", "attended", "top5")} for r in rows],
        "steps": len(step_s), "generated_tokens": generated, "decode_seconds": sum(step_s),
        "model_seconds": times.model_s, "attention_seconds": times.attention_s,
        "append_seconds": sum(append_s), "attend_calls": len(attend_s),
        "attend_p50_ms": sc.percentile_ms(attend_s, 50),
        "attend_p99_ms": sc.percentile_ms(attend_s, 99),
        "append_p50_ms": sc.percentile_ms(append_s, 50),
        "step_p50_ms": sc.percentile_ms(step_s, 50), "batch_rows": len(rows)})
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
