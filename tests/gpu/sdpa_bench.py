#!/usr/bin/env python3
"""Adds torch SDPA BF16 (F.scaled_dot_product_attention, enable_gqa=True) on the shapes that
gpu_bench measured, and writes bench-results/gpu.json (the benchmark format of
docs/operations.md) with every INT2 result compared against both its byte floor and SDPA, then
prints a short table.

  python3 tests/gpu/sdpa_bench.py --ours gpu-kernels.json --out bench-results/gpu.json
"""
import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F


def time_us(fn, sets, warmup=10, iters=50):
    for i in range(warmup):
        fn(i % sets)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i % sets)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends))


def sdpa_us(b, hq, hkv, d, ctx):
    set_bytes = b * hkv * ctx * d * 2 * 2
    sets = max(1, min(16, math.ceil(256e6 / set_bytes)))
    q = [torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    k = [torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    v = [torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]

    def run(s):
        F.scaled_dot_product_attention(q[s], k[s], v[s], enable_gqa=True)

    us = time_us(run, sets, iters=30 if set_bytes > 1e9 else 50)
    del q, k, v
    torch.cuda.empty_cache()
    return us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.ours) as f:
        ours = json.load(f)
    results = list(ours["results"])
    rows = []
    for r in ours["results"]:
        if r["name"] != "int2_decode_attention":
            continue
        p = r["params"]
        base = sdpa_us(p["batch"], p["Hq"], p["Hkv"], p["D"], p["context"])
        speedup = base / r["value"]
        results.append({"name": "int2_decode_attention_vs_sdpa", "params": p, "value": r["value"],
                        "unit": "us", "baseline": {"name": "torch_sdpa_bf16", "value": base},
                        "ratio": speedup})
        if p["D"] == 128:
            target = 5.0 if (p["batch"] >= 8 and p["context"] >= 32768) else (
                2.5 if (p["batch"] == 1 and p["context"] >= 131072) else 1.0)
        else:
            target = 4.0 if (p["batch"] >= 8 and p["context"] >= 32768) else 1.0
        rows.append((p, r["value"], base, speedup, r["baseline"]["value"], target))
        print(f"  sdpa {p['model']:9s} B={p['batch']:<2d} ctx={p['context']:<6d} {base:9.1f} us",
              flush=True)
    machine = dict(ours["machine"])
    machine["torch"] = torch.__version__
    with open(args.out, "w") as f:
        json.dump({"machine": machine, "results": results}, f, indent=1)

    print()
    print(f"device {machine.get('gpu')}, copy bandwidth {machine.get('copy_bandwidth_GBs')} GB/s")
    for r in ours["results"]:
        if r["name"] == "int2_decode_attention_variant":
            p = r["params"]
            print(f"A/B {p['model']:9s} {p['variant']:14s} B={p['batch']:<2d} "
                  f"ctx={p['context']:<6d} "
                  f"{r['value']:9.1f} us  ({r['ratio']:.2f}x floor)")
        elif r["name"] != "int2_decode_attention":
            print(f"{r['name']:30s} {r['value']:9.1f} {r['unit']}  ({r['ratio']:.2f} of copy bw)")
    print(f"{'model':9s} {'Hq':>3s} {'Hkv':>3s} {'D':>4s} {'B':>3s} {'ctx':>7s} "
          f"{'int2 us':>9s} {'sdpa us':>9s} {'speedup':>8s} {'target':>7s} {'floor us':>9s} "
          f"{'x floor':>8s}")
    for p, ours_us, base, speedup, floor_us, target in rows:
        flag = "ok" if speedup >= target else "MISS"
        print(f"{p['model']:9s} {p['Hq']:3d} {p['Hkv']:3d} {p['D']:4d} {p['batch']:3d} "
              f"{p['context']:7d} {ours_us:9.1f} {base:9.1f} {speedup:7.2f}x {target:5.1f}x "
              f"{floor_us:9.1f} {ours_us / floor_us:7.2f}x {flag}")


if __name__ == "__main__":
    main()
