"""Tensors in and out of the wire format: numpy arrays, and torch tensors through DLPack.

The daemon's tensors are raw little-endian bytes with a dtype beside them (DTYPE_BF16,
DTYPE_FP16, DTYPE_FP32). This module turns arrays into those bytes and back:

- numpy float32 and float16 map to FP32 and FP16;
- BF16 is ml_dtypes.bfloat16 when ml_dtypes is installed; without it (or by choice) a uint16
  array holding the BF16 bit patterns is accepted and returned (`bf16_as="uint16"`);
- torch tensors (CPU or GPU) are accepted wherever an array is: they are moved to the CPU and
  viewed through DLPack without a copy where possible (torch.bfloat16 is viewed as its uint16
  bits, since numpy has no bfloat16). torch is never imported unless the caller passed a tensor
  or asked for one (`to_torch`).

    k = np.random.default_rng(0).standard_normal((4096, 8, 128), dtype=np.float32)
    data = to_bytes(k, DType.BF16)              # rounds to BF16 (nearest even)
    back = from_bytes(data, DType.BF16, k.shape)  # ml_dtypes.bfloat16 array
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Sequence

import numpy as np

try:  # optional: a real numpy bfloat16 type
    import ml_dtypes as _ml_dtypes

    BFLOAT16: Optional[np.dtype] = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised where ml_dtypes is absent
    _ml_dtypes = None
    BFLOAT16 = None


class DType(enum.IntEnum):
    """kvpool.v1.DType values."""

    BF16 = 1
    FP16 = 2
    FP32 = 3

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FP32 else 2


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def as_numpy(x: Any) -> np.ndarray:
    """A numpy view of an array or torch tensor (DLPack; a GPU tensor is copied to the CPU).

    A torch.bfloat16 tensor comes back as ml_dtypes.bfloat16 when available, else as uint16
    bit patterns.
    """
    if isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        import torch  # only reached when the caller passed a tensor

        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            bits = np.from_dlpack(t.view(torch.int16)).view(np.uint16)
            return bits.view(BFLOAT16) if BFLOAT16 is not None else bits
        return np.from_dlpack(t)
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return np.asarray(x)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) of x: float arrays are rounded to nearest even; a uint16 or
    ml_dtypes.bfloat16 array is taken as BF16 already."""
    if x.dtype == np.uint16:
        return x
    if BFLOAT16 is not None and x.dtype == BFLOAT16:
        return x.view(np.uint16)
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(f)
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """float32 values of BF16 bit patterns (uint16 or ml_dtypes.bfloat16)."""
    u = np.ascontiguousarray(bits).view(np.uint16)
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_bytes(x: Any, dtype: DType) -> bytes:
    """Little-endian bytes of x (array or tensor) as `dtype`; values are converted (rounded to
    nearest for BF16 and FP16)."""
    a = as_numpy(x)
    if dtype is DType.BF16:
        out = bf16_bits(a)
    elif dtype is DType.FP16:
        if a.dtype == np.uint16 or (BFLOAT16 is not None and a.dtype == BFLOAT16):
            a = bf16_to_float32(a)
        out = np.ascontiguousarray(a, dtype="<f2")
    elif dtype is DType.FP32:
        if a.dtype == np.uint16 or (BFLOAT16 is not None and a.dtype == BFLOAT16):
            a = bf16_to_float32(a)
        out = np.ascontiguousarray(a, dtype="<f4")
    else:  # pragma: no cover - DType is closed
        raise ValueError(f"unsupported dtype {dtype!r}")
    return np.ascontiguousarray(out).tobytes()


def natural_dtype(x: Any) -> DType:
    """The wire dtype that carries x without conversion (BF16 for bfloat16/uint16 arrays and
    torch.bfloat16, FP16 for float16, FP32 otherwise)."""
    if _is_torch(x):
        name = str(x.dtype)
        if name == "torch.bfloat16":
            return DType.BF16
        if name == "torch.float16":
            return DType.FP16
        return DType.FP32
    a = np.asarray(x) if not isinstance(x, np.ndarray) else x
    if a.dtype == np.uint16 or (BFLOAT16 is not None and a.dtype == BFLOAT16):
        return DType.BF16
    if a.dtype == np.float16:
        return DType.FP16
    return DType.FP32


def from_bytes(data: bytes, dtype: DType, shape: Sequence[int],
               bf16_as: str = "auto") -> np.ndarray:
    """A numpy array of `shape` from wire bytes of `dtype` (a read-only view when possible).

    bf16_as: "auto" (ml_dtypes.bfloat16 if installed, else uint16), "uint16", "float32".
    """
    dtype = DType(dtype)
    count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if len(data) != count * dtype.itemsize:
        raise ValueError(f"{len(data)} bytes do not hold {tuple(shape)} of {dtype.name}")
    if dtype is DType.FP32:
        return np.frombuffer(data, dtype="<f4").reshape(shape)
    if dtype is DType.FP16:
        return np.frombuffer(data, dtype="<f2").reshape(shape)
    bits = np.frombuffer(data, dtype="<u2").reshape(shape)
    if bf16_as == "float32":
        return bf16_to_float32(bits).reshape(shape)
    if bf16_as == "uint16" or BFLOAT16 is None:
        return bits
    return bits.view(BFLOAT16)


def to_torch(a: np.ndarray, device: Optional[str] = None) -> Any:
    """A torch tensor from a numpy array through DLPack (BF16 arrays become torch.bfloat16).
    Requires torch; ImportError otherwise."""
    import torch

    a = np.ascontiguousarray(a)
    if not a.flags.writeable:  # DLPack exports writable memory only
        a = a.copy()
    if a.dtype == np.uint16 or (BFLOAT16 is not None and a.dtype == BFLOAT16):
        t = torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_dlpack(a)
    return t.to(device) if device is not None else t
