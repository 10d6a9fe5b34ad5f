"""The prefill process of the SmolLM2 split: runs each prompt and pushes its K/V to kvpoold layer
by layer, as each layer is computed (one AppendKv stream per sequence, end_of_prefill set).

Prompts share their document; like an engine with prefix caching, this worker computes the
document once, and every sequence after the first starts from the daemon's cached prefix
(CreateSequence with the prompt's token ids), so only the tokens the daemon does not hold yet
are pushed. It hands each prompt to the decode side through --handoff: the token ids, the first
generated token (from the prompt's last logits) and, for the checks only, the prompt's K/V.

    python prefill_worker.py --target 127.0.0.1:PORT --handoff DIR --plan plan.json
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import split_common as sc
from kvpool import Client, ClientOptions, DType
from kvpool.tensors import bf16_bits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--handoff", required=True, help="folder shared with the decode side")
    ap.add_argument("--plan", required=True, help="plan.json written by run_split.py")
    args = ap.parse_args()
    plan = sc.read_json(args.plan)

    t_load = time.perf_counter()
    model, tok = sc.load_model()
    load_s = time.perf_counter() - t_load
    prompts = sc.build_prompts(tok, plan["prompts"], plan["document_tokens"])
    client = Client(args.target, ClientOptions(deadline_s=600.0))
    client.fit_to_server_limits()

    doc_kv = None
    for i, prompt in enumerate(prompts):
        ids = prompt.ids
        t_start = time.perf_counter()
        seqs = [(s["model_id"], s["sequence_id"].format(prompt=i)) for s in plan["sequences"]]
        reused = {}
        streams = {}
        for model_id, seq in seqs:
            r = client.create_sequence(model_id, seq, prefix_token_ids=ids)
            reused[seq] = int(r.reused_tokens)
            streams[seq] = client.open_append(
                seq, len(ids) - reused[seq], token_start=reused[seq], dtype=DType.BF16,
                token_ids=ids[reused[seq]:], end_of_prefill=True)
        push_s = 0.0
        n_prefix = len(prompt.prefix_ids)

        def push(layer, k, v, first):
            """Writes prompt tokens [first, first + len(k)) of `layer` to every stream that
            still needs them (each stream starts at its reused length)."""
            nonlocal push_s
            t = time.perf_counter()
            for _, seq in seqs:
                lo = max(first, reused[seq])
                if lo < first + len(k):
                    streams[seq].write_layer(layer, k[lo - first:], v[lo - first:],
                                             token_offset=lo - reused[seq])
            push_s += time.perf_counter() - t

        first_prompt = doc_kv is None
        if first_prompt:  # the document: computed once, each layer pushed as it is done
            _, doc_kv = sc.prefill_forward(model, prompt.prefix_ids, 0, None,
                                           lambda layer, k, v: push(layer, k, v, 0))

        def on_suffix(layer, k, v):
            if not first_prompt:  # document cached in this engine: push what the daemon lacks
                push(layer, doc_kv[layer][0], doc_kv[layer][1], 0)
            push(layer, k, v, n_prefix)

        logits, suffix_kv = sc.prefill_forward(model, prompt.suffix_ids, n_prefix, doc_kv,
                                               on_suffix)
        computed = (n_prefix if first_prompt else 0) + len(prompt.suffix_ids)
        t = time.perf_counter()
        appended = {seq: streams[seq].finish() for _, seq in seqs}
        push_s += time.perf_counter() - t
        first_token = int(np.argmax(logits))
        k_all = np.concatenate([np.stack([kv[0] for kv in doc_kv]),
                                np.stack([kv[0] for kv in suffix_kv])], axis=1)
        v_all = np.concatenate([np.stack([kv[1] for kv in doc_kv]),
                                np.stack([kv[1] for kv in suffix_kv])], axis=1)
        # For the checks only (local codec and BF16 decodes): the K/V the prefill produced.
        np.savez(os.path.join(args.handoff, f"prompt{i}.kv.npz"),
                 k=bf16_bits(k_all), v=bf16_bits(v_all))
        top2 = np.sort(logits)[-2:]
        sc.write_json(os.path.join(args.handoff, f"prompt{i}.json"), {
            "ids": ids, "question": prompt.question, "first_token": first_token,
            "first_margin": float(top2[1] - top2[0]), "reused": reused,
            "computed_tokens": computed,
            "pushed_tokens": {seq: len(ids) - reused[seq] for _, seq in seqs},
            "appended": {seq: {"to_sink": a.to_sink, "to_history": a.to_history,
                               "to_recent": a.to_recent} for seq, a in appended.items()},
            "seconds": time.perf_counter() - t_start, "push_seconds": push_s,
            "load_seconds": load_s})
        print(f"prefill: prompt {i}: {len(ids)} tokens, computed {computed}, reused "
              f"{min(reused.values())}-{max(reused.values())} from the daemon, "
              f"{time.perf_counter() - t_start:.1f} s", flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
