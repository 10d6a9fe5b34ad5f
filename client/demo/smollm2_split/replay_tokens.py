"""The greedy tokens of a replayed split (tests/gpu/split_replay.cc), on a machine with the model:
every decode step of the capture is rerun with the remote attention output taken from the
replay's output file (e.g. the GPU daemon's) and, beside it, from the CPU run's own outputs
(which must give back the CPU run's tokens). Teacher-forced on the CPU run's tokens, so that a
step's comparison does not depend on earlier ones: where the two paths pick different tokens,
the step's top-two logit margin and the logit difference say whether it is a near-tie.

The replay answered each layer's query as the CPU run sent it; the GPU's own queries at later
layers would differ by as much as its earlier outputs did, which this leaves out (a second-order
effect next to the outputs' difference itself).

    python replay_tokens.py --capture replay.safetensors --outputs split-replay-gpu.safetensors
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import split_common as sc
import st_io
from kvpool import merge_attention


def run(model, tokens, start, out, lse):
    """Logits of every step, teacher-forced on `tokens`, remote attention from out/lse."""
    logits = []
    for s in range(len(tokens) - 1):
        def attend(layer, q, k, v):
            so, slse = sc.self_attention(q, k, v)
            return merge_attention(out[s, layer][None], lse[s, layer][None], so, slse)[0]

        lg, _, _ = sc.decode_step(model, [int(tokens[s])], [start + s], attend, sc.StepTimes())
        logits.append(lg[0])
    return np.stack(logits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", required=True)
    ap.add_argument("--outputs", required=True, help="kvpool-split-replay --out file")
    args = ap.parse_args()
    cap, meta = st_io.read(args.capture)
    got, got_meta = st_io.read(args.outputs)
    model, _ = sc.load_model()
    start = int(meta["prompt_tokens"])
    ok = True
    for m in json.loads(meta["configs"]):
        key = f"m{json.loads(meta['configs']).index(m)}"
        tokens = cap[f"{key}.tokens"]
        ref = run(model, tokens, start, cap[f"{key}.out"], cap[f"{key}.lse"])
        new = run(model, tokens, start, got[f"{key}.out"], got[f"{key}.lse"])
        same_as_run = bool((ref.argmax(-1) == tokens[1:]).all())
        print(f"{m['name']}: {len(tokens) - 1} steps; CPU outputs give the CPU run's tokens: "
              f"{'yes' if same_as_run else 'NO'}; max |logit {got_meta.get('device', '?')} - "
              f"CPU| {np.abs(new - ref).max():.3e}")
        for s in range(len(ref)):
            top = np.argsort(ref[s])[-2:]
            margin = float(ref[s][top[1]] - ref[s][top[0]])
            delta = float(np.abs(new[s] - ref[s]).max())
            if int(new[s].argmax()) != int(ref[s].argmax()):
                tie = margin <= 2 * delta
                ok &= tie
                print(f"  step {s + 1}: {int(new[s].argmax())} instead of {int(ref[s].argmax())}"
                      f"; top-two margin {margin:.4f}, logits differ by {delta:.4f}"
                      f"{' (a near-tie)' if tie else ''}")
        agree = int((new.argmax(-1) == ref.argmax(-1)).sum())
        print(f"  greedy tokens agree at {agree}/{len(ref)} steps")
        ok &= same_as_run
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
