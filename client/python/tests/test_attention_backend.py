"""kvpool.attention_backend on the CPU path (numpy in, libkvpool_attention.so through ctypes):
near a float64 reference on batches in kvpool's block format, the same bits through DLPack and
non-contiguous inputs, the C structs' sizes equal to the library's, and every bad input raising
(the library's code, or a Python error before the call) with the outputs left as they were.
torch CPU tensors are tried where torch is installed."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from attention_backend_batch import (assert_near, call_kwargs, load_backend_module, make_batch,
                                     reference)

ab = load_backend_module()

SEQS = [(16, 70, 9), (0, 0, 0), (3, 0, 40), (0, 33, 0), (64, 129, 17)]


@pytest.fixture(scope="module")
def lib():
    try:
        return ab.load_library()
    except (FileNotFoundError, OSError) as e:
        pytest.skip(f"no libkvpool_attention.so: {e}")


MODELS = [
    ab.AttentionModel(q_heads=9, kv_heads=3, head_dim=64),  # SmolLM2-135M heads
    ab.AttentionModel(q_heads=8, kv_heads=2, head_dim=128, scale_dtype="fp16", block_tokens=32),
]


@pytest.mark.parametrize("model", MODELS, ids=["smollm2", "d128-t32"])
def test_numpy_matches_float64_reference(lib, model):
    batch = make_batch(model, SEQS, seed=model.head_dim)
    backend = ab.AttentionBackend(model)
    out, lse = backend.decode(batch["queries"], **call_kwargs(ab, model, batch))
    assert isinstance(out, np.ndarray) and out.shape == batch["queries"].shape
    assert lse.shape == batch["queries"].shape[:2] and lse.dtype == np.float32
    ref_out, ref_lse = reference(model, batch)
    assert_near(out, lse, ref_out, ref_lse, rel=1e-4)


def test_the_same_bits_through_dlpack_and_noncontiguous_inputs(lib):
    model = MODELS[0]
    batch = make_batch(model, SEQS, seed=3)
    backend = ab.AttentionBackend(model)
    out, lse = backend.decode(batch["queries"], **call_kwargs(ab, model, batch))

    class DlpackOnly:  # neither numpy nor torch: only the protocol
        def __init__(self, a):
            self._a = a

        def __dlpack__(self, **kwargs):
            return self._a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    out2, lse2 = backend.decode(DlpackOnly(batch["queries"]),
                                **call_kwargs(ab, model, batch, convert=DlpackOnly))
    assert np.array_equal(out, out2, equal_nan=False) and np.array_equal(lse, lse2)

    strided = np.asfortranarray(batch["queries"])  # copied to C order for the call
    out3, lse3 = backend.decode(strided, **call_kwargs(ab, model, batch))
    assert np.array_equal(out, out3) and np.array_equal(lse, lse3)

    # Caller-owned outputs are written in place.
    mine_out = np.zeros_like(out)
    mine_lse = np.zeros_like(lse)
    got_out, got_lse = backend.decode(batch["queries"], out=mine_out, lse=mine_lse,
                                      **call_kwargs(ab, model, batch))
    assert got_out is mine_out and np.array_equal(mine_out, out)
    assert got_lse is mine_lse and np.array_equal(mine_lse, lse)


def test_struct_sizes_match_the_library(lib):
    buf = ctypes.create_string_buffer(4096)
    lib.kvpool_attention_desc_init(ctypes.cast(buf, ctypes.c_void_p))
    assert ctypes.c_uint32.from_buffer(buf).value == ctypes.sizeof(ab._Desc)
    buf = ctypes.create_string_buffer(4096)
    lib.kvpool_attention_io_init(ctypes.cast(buf, ctypes.c_void_p))
    assert ctypes.c_uint32.from_buffer(buf).value == ctypes.sizeof(ab._Io)
    assert lib.kvpool_attention_version() == ab.API_VERSION


def _poisoned(batch, model):
    n = batch["queries"].shape[0]
    return (np.full((n, model.q_heads, model.head_dim), 7, np.float32),
            np.full((n, model.q_heads), 7, np.float32))


def test_bad_block_tables_raise_invalid_argument_and_write_nothing(lib):
    model = MODELS[0]
    backend = ab.AttentionBackend(model)
    batch = make_batch(model, SEQS, seed=5)
    cases = {
        "history block id == num_blocks": (1, (0, 1), batch["num_history_blocks"]),
        "negative sink block id": (0, (0, 0), -1),
        "recent block id past the pool": (2, (2, 0), batch["num_bf16_blocks"] + 9),
    }
    for what, (tier, at, bad) in cases.items():
        tables = batch["tables"][tier]
        good = tables[at]
        tables[at] = bad
        out, lse = _poisoned(batch, model)
        with pytest.raises(ab.AttentionBackendError) as e:
            backend.decode(batch["queries"], out=out, lse=lse, **call_kwargs(ab, model, batch))
        tables[at] = good
        assert e.value.code == 3 and e.value.code_name == "INVALID_ARGUMENT", what
        assert "block id" in e.value.message, what
        assert np.all(out == 7) and np.all(lse == 7), what

    counts = batch["counts"][2]
    counts[0] = -1
    out, lse = _poisoned(batch, model)
    with pytest.raises(ab.AttentionBackendError) as e:
        backend.decode(batch["queries"], out=out, lse=lse, max_bf16_tokens=128,
                       **call_kwargs(ab, model, batch))
    counts[0] = 9
    assert e.value.code == 3 and np.all(out == 7)

    # A count above the bound the caller gave.
    out, lse = _poisoned(batch, model)
    with pytest.raises(ab.AttentionBackendError) as e:
        backend.decode(batch["queries"], out=out, lse=lse, max_history_tokens=100,
                       **call_kwargs(ab, model, batch))
    assert e.value.code == 3 and np.all(out == 7) and np.all(lse == 7)


def test_bad_arguments_raise_before_the_call(lib):
    model = MODELS[0]
    backend = ab.AttentionBackend(model)
    batch = make_batch(model, SEQS, seed=6)
    kwargs = call_kwargs(ab, model, batch)
    with pytest.raises(TypeError):
        backend.decode(batch["queries"].astype(np.float64), **kwargs)
    with pytest.raises(ValueError):
        backend.decode(batch["queries"][:, :4], **kwargs)
    bad = dict(kwargs, history=ab.Tier(batch["tables"][1][:2], batch["firsts"][1],
                                       batch["counts"][1]))
    with pytest.raises(ValueError):
        backend.decode(batch["queries"], **bad)
    bad = dict(kwargs, history_pool=ab.Pool(batch["history_pool"][:-1],
                                            batch["num_history_blocks"]))
    with pytest.raises(ValueError, match="bytes"):
        backend.decode(batch["queries"], **bad)
    with pytest.raises(TypeError):
        backend.decode(batch["queries"], **dict(kwargs, rotation_k=batch["rotation_k"] * 1.0j))
    with pytest.raises(ValueError):
        backend.decode(batch["queries"], out=np.zeros((1, 9, 64), np.float32), **kwargs)
    # The library's own checks: a codec it cannot build.
    odd = ab.AttentionBackend(ab.AttentionModel(q_heads=9, kv_heads=3, head_dim=64,
                                                block_tokens=12))
    with pytest.raises(ab.AttentionBackendError) as e:
        odd.decode(batch["queries"], **call_kwargs(ab, odd.model, batch))
    assert e.value.code == 3 and "block_tokens" in e.value.message


def test_torch_cpu_tensors(lib):
    torch = pytest.importorskip("torch")
    model = MODELS[0]
    batch = make_batch(model, SEQS, seed=8)
    backend = ab.AttentionBackend(model)
    want_out, want_lse = backend.decode(batch["queries"], **call_kwargs(ab, model, batch))
    out, lse = backend.decode(torch.from_numpy(batch["queries"]),
                              **call_kwargs(ab, model, batch, convert=torch.from_numpy))
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu"
    assert np.array_equal(out.numpy(), want_out) and np.array_equal(lse.numpy(), want_lse)
