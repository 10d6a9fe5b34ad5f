"""The checks of the SmolLM2 split, in a process of their own, all rows in lockstep:

- a BF16-cache greedy decode of every prompt (the reference);
- per codec, a decode that applies the same codec in-process: the production codec
  (libkvpool_eval_codec.so: same rotation file or data-free rotation, clip, BF16 sink and recent
  windows, the daemon's tier plan) with attention computed here, fed the tokens the remote
  decode chose and storing the K/V rows the decode process appended (the same BF16 bits the
  daemon received: the engine's float rounding, which differs with the batch's shape, would
  otherwise flip BF16 roundings and drift); at every step its greedy choice must be the remote
  one, and its logits are compared with the remote decode's (so a near-tie, where float
  rounding may pick either token, is told apart from a real difference);
- per codec, a teacher-forced decode through kvpoold (remote attention + AppendDecode, its own
  sequence) fed the BF16 reference's tokens: top-1 agreement and KL(P_BF16 || P_kvpool) of the
  next-token distributions at every step.

    python check_worker.py --target 127.0.0.1:PORT --handoff DIR --plan plan.json \
        --codec-lib build/lib/libkvpool_eval_codec.so --out check.json
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import split_common as sc
from kvpool import Client, ClientOptions, DType, merge_attention
from kvpool.tensors import bf16_to_float32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--handoff", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--codec-lib", required=True)
    ap.add_argument("--decode", required=True, help="the decode process's result (decode.json)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    remote_rows = sc.read_json(args.decode)["rows"]
    appended = np.load(os.path.join(args.handoff, "appended.greedy.npz"))
    for j, r in enumerate(remote_rows):
        r["k"] = bf16_to_float32(appended[f"row{j}.k"])
        r["v"] = bf16_to_float32(appended[f"row{j}.v"])
    plan = sc.read_json(args.plan)
    model, tok = sc.load_model()
    cfg = model.cfg
    client = Client(args.target, ClientOptions(deadline_s=600.0))
    codecs = {}
    for c in plan["configs"]:
        codecs[c["name"]] = sc.codec_for(args.codec_lib, c["codec_rotation"], cfg.num_layers,
                                         cfg.head_dim,
                                         tuple(c["codec_clip"]) if c.get("codec_clip") else None)

    rows = []
    for i in range(plan["prompts"]):
        info = sc.read_json(os.path.join(args.handoff, f"prompt{i}.json"))
        kv = np.load(os.path.join(args.handoff, f"prompt{i}.kv.npz"))
        k, v = bf16_to_float32(kv["k"]), bf16_to_float32(kv["v"])
        def base():  # every row owns its token list
            return {"prompt": i, "length": len(info["ids"]), "tokens": [info["first_token"]],
                    "margins": [info["first_margin"]],
                    "done": info["first_token"] == tok.eos_id}

        ref = dict(base(), kind="bf16", state=sc.Bf16Rows(k, v))
        rows.append(ref)
        for c in plan["configs"]:
            seq_tf = [s for s in plan["sequences"]
                      if s["config"] == c["name"] and s["role"] == "teacher_forced"][0]
            q = c["quant"]
            layout = sc.TierLayout(q["sink_tokens"], q["recent_tokens"], q["demotion_batch"])
            seq_greedy = [s for s in plan["sequences"]
                          if s["config"] == c["name"] and s["role"] == "greedy"][0]
            layout.attach_prefix(info["reused"][seq_greedy["sequence_id"].format(prompt=i)])
            layout.final_prefill(len(info["ids"]) - layout.total)
            remote = [r for r in remote_rows
                      if r["prompt"] == i and r["config"] == c["name"]][0]
            rows.append(dict(base(), kind="codec", config=c["name"], remote=remote, delta=[],
                             agree=[],
                             state=sc.CodecRows(codecs[c["name"]], layout, k, v),
                             codec_version=codecs[c["name"]].version,
                             int2_share_first=float(layout.history / layout.total)))
            rows.append(dict(base(), kind="teacher_forced", config=c["name"],
                             model_id=c["model_id"], ref=ref, kl=[], top1=[],
                             seq=seq_tf["sequence_id"].format(prompt=i)))

    for step in range(1, plan["new_tokens"]):
        active = [r for r in rows if not r["done"]]
        if not active:
            break
        # Teacher-forced rows read the reference's token of the previous step.
        tokens = [r["ref"]["tokens"][-1] if r["kind"] == "teacher_forced"
                  else r["remote"]["tokens"][step - 1] if r["kind"] == "codec"
                  else r["tokens"][-1] for r in active]
        positions = [r["length"] + step - 1 for r in active]

        def attend(layer, q, k, v):
            out = np.empty_like(q)
            local = [j for j, r in enumerate(active) if r["kind"] != "teacher_forced"]
            if local:
                out[local] = sc.local_attend([active[j]["state"] for j in local], layer,
                                             q[local], k[local], v[local])
            remote = [j for j, r in enumerate(active) if r["kind"] == "teacher_forced"]
            if remote:
                so, slse = sc.self_attention(q[remote], k[remote], v[remote])
                for model_id in sorted({active[j]["model_id"] for j in remote}):
                    idx = [n for n, j in enumerate(remote) if active[j]["model_id"] == model_id]
                    res = client.attend(model_id, layer,
                                        [(active[remote[n]]["seq"], q[remote[n]]) for n in idx])
                    for n in idx:
                        r = res[active[remote[n]]["seq"]]
                        out[remote[n]] = merge_attention(r.out, r.lse, so[n:n + 1],
                                                         slse[n:n + 1])[0][0]
            return out

        logits, ks, vs = sc.decode_step(model, tokens, positions, attend)
        logp = {}
        for j, r in enumerate(active):
            if r["kind"] == "teacher_forced":
                client.append_decode(r["seq"], ks[:, j], vs[:, j], token_start=positions[j],
                                     dtype=DType.BF16)
            elif r["kind"] == "codec":  # the rows the daemon stored for this step
                r["state"].append(r["remote"]["k"][step - 1], r["remote"]["v"][step - 1])
                r["kv_delta"] = max(r.get("kv_delta", 0.0), float(np.abs(
                    sc.round_bf16(ks[:, j]) - r["remote"]["k"][step - 1]).max()))
            else:
                r["state"].append(ks[:, j], vs[:, j])
            logp[id(r)] = sc.log_softmax(logits[j])
        for j, r in enumerate(active):
            top = np.argsort(logits[j])[-2:]
            if r["kind"] == "teacher_forced":
                p_ref = logp[id(r["ref"])]
                p = logp[id(r)]
                r["kl"].append(float(np.sum(np.exp(p_ref) * (p_ref - p))))
                r["top1"].append(bool(np.argmax(p) == np.argmax(p_ref)))
            else:
                r["tokens"].append(int(top[1]))
                r["margins"].append(float(logits[j][top[1]] - logits[j][top[0]]))
                r["done"] = int(top[1]) == tok.eos_id
            if r["kind"] == "codec":  # the same step of the remote decode
                remote_top = r["remote"]["top5"][step - 1]
                r["agree"].append(int(top[1]) == remote_top[0][0])
                r["delta"].append(max(abs(float(logits[j][t]) - val) for t, val in remote_top))
                r["done"] = step + 1 >= len(r["remote"]["tokens"])
        for r in active:  # teacher-forced rows end with their reference
            if r["kind"] == "teacher_forced":
                r["done"] = r["ref"]["done"]

    out = []
    for r in rows:
        d = {k: r[k] for k in ("prompt", "kind", "length") if k in r}
        if r["kind"] == "teacher_forced":
            d.update(config=r["config"], kl=r["kl"], top1=r["top1"], seq=r["seq"])
        else:
            d.update(tokens=r["tokens"], margins=r["margins"])
        if r["kind"] == "codec":
            d.update(config=r["config"], codec_version=r["codec_version"], agree=r["agree"],
                     delta=r["delta"], kv_delta=r.get("kv_delta", 0.0),
                     int2_share_first=r["int2_share_first"],
                     layout={"sink": r["state"].layout.sink,
                             "history": r["state"].layout.history,
                             "recent": r["state"].layout.recent})
        out.append(d)
    sc.write_json(args.out, {"rows": out})
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
