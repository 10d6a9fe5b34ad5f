"""kvpool.attention_backend on CUDA torch tensors: the GPU kernel through the C API on torch's
current stream, near the CPU path on the same batch (within the kernel's documented precision)
and near a float64 reference; the same bits on a repeat call; host arrays mixed in are refused.
Skips without torch, a CUDA device, or a library built with CUDA.

Runs under pytest, or alone (the GPU machine, tests/gpu/run.sh): python3 THIS_FILE
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_backend_batch import (assert_near, call_kwargs, load_backend_module,  # noqa: E402
                                     make_batch, reference)

ab = load_backend_module()

# The shapes: a 70B-class model and SmolLM2-135M.
MODELS = [ab.AttentionModel(q_heads=64, kv_heads=8, head_dim=128),
          ab.AttentionModel(q_heads=9, kv_heads=3, head_dim=64)]
SEQS = [(64, 1000, 256), (0, 0, 1), (16, 77, 270), (0, 0, 0), (5, 2048, 3)]


def _skip_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        lib = ab.load_library()
    except (FileNotFoundError, OSError) as e:
        return f"no libkvpool_attention.so: {e}"
    if not lib.kvpool_attention_has_cuda():
        return "libkvpool_attention.so was built without CUDA"
    return None


def check_cuda_matches_cpu_and_reference():
    import torch

    for model in MODELS:
        batch = make_batch(model, SEQS, seed=model.q_heads)
        backend = ab.AttentionBackend(model)
        cpu_out, cpu_lse = backend.decode(batch["queries"], **call_kwargs(ab, model, batch))
        to_gpu = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
        kwargs = call_kwargs(ab, model, batch, convert=to_gpu)
        bounds = {"max_history_tokens": int(batch["counts"][1].max()),
                  "max_bf16_tokens": int((batch["counts"][0] + batch["counts"][2]).max())}
        queries = to_gpu(batch["queries"])
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # the kernels go on the current stream
            out, lse = backend.decode(queries, **kwargs, **bounds)
            again_out, again_lse = backend.decode(queries, **kwargs, **bounds)
        side.synchronize()
        assert out.is_cuda and out.shape == queries.shape and lse.shape == queries.shape[:2]
        assert torch.equal(out, again_out) and torch.equal(lse, again_lse)
        out, lse = out.cpu().numpy(), lse.cpu().numpy()
        # cuda_attention.h: relative output error well under 1e-2.
        worst_cpu = assert_near(out, lse, cpu_out.astype(np.float64), cpu_lse.astype(np.float64),
                                rel=1e-2)
        ref_out, ref_lse = reference(model, batch)
        worst_ref = assert_near(out, lse, ref_out, ref_lse, rel=1e-2)
        print(f"Hq {model.q_heads} D {model.head_dim}: GPU vs CPU path {worst_cpu:.2e}, "
              f"vs float64 {worst_ref:.2e} (worst relative output error)")


def check_mixed_host_and_device_arrays_are_refused():
    import torch

    model = MODELS[1]
    batch = make_batch(model, SEQS[:2], seed=4)
    backend = ab.AttentionBackend(model)
    kwargs = call_kwargs(ab, model, batch)  # host arrays
    try:
        backend.decode(torch.from_numpy(batch["queries"]).cuda(), **kwargs)
    except ValueError as e:
        assert "where the queries are" in str(e)
    else:
        raise AssertionError("host pools with CUDA queries were accepted")


def test_cuda_matches_cpu_and_reference():
    import pytest

    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    check_cuda_matches_cpu_and_reference()


def test_mixed_host_and_device_arrays_are_refused():
    import pytest

    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    check_mixed_host_and_device_arrays_are_refused()


if __name__ == "__main__":
    reason = _skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        sys.exit(0 if "torch" in reason or "device" in reason else 1)
    check_cuda_matches_cpu_and_reference()
    check_mixed_host_and_device_arrays_are_refused()
    print("PASSED: attention backend on CUDA tensors")
