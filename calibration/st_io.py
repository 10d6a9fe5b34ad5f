"""Minimal safetensors reader/writer (numpy) and BF16 rounding, for the calibration tools.

The container: u64 little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}, "__metadata__": {str: str}}, then the raw little-endian tensor bytes. Tensors
are written 8-byte aligned in the order given.

    write("x.safetensors", {"k": ("BF16", array)}, {"layer": "3"})
    tensors, meta = read("x.safetensors")      # BF16 comes back as float32
"""

from __future__ import annotations

import json
import struct

import numpy as np

_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
       "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8}


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Rounds float32 to bfloat16 (nearest, ties to even) and returns the 16-bit words."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 -> float32."""
    return from_bf16_bits(to_bf16_bits(x)).reshape(np.shape(x))


def write(path: str, tensors: dict, metadata: dict | None = None) -> None:
    header = {}
    blobs = []
    offset = 0
    for name, (dtype, arr) in tensors.items():
        arr = np.asarray(arr)
        if dtype == "BF16":
            raw = to_bf16_bits(arr).tobytes()
        else:
            raw = np.ascontiguousarray(arr, dtype=_NP[dtype]).astype(
                np.dtype(_NP[dtype]).newbyteorder("<"), copy=False).tobytes()
        pad = (-len(raw)) % 8
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hdr = json.dumps(header, separators=(",", ":")).encode()
    hdr += b" " * ((-len(hdr)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)))
        f.write(hdr)
        for b in blobs:
            f.write(b)


def read(path: str):
    """Returns ({name: float32/int array}, metadata dict). BF16 is widened to float32."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        raw = data[base + a:base + b]
        if info["dtype"] == "BF16":
            arr = from_bf16_bits(np.frombuffer(raw, dtype="<u2"))
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(_NP[info["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(info["shape"])
    return out, meta
