"""kvpool's decode attention as an engine attention backend: ctypes over libkvpool_attention.so.

The C API (kernels/capi/kvpool_attention.h, docs/attention-backend.md) runs one decode step of
one layer over kvpool's blocks: 2-bit history blocks and BF16 sink and recent pages, addressed
by per-sequence block tables. This module hands it numpy arrays (the CPU path), torch tensors
(CPU, or CUDA on torch's current stream) or any DLPack object, and returns out and LSE.

    from kvpool.attention_backend import AttentionBackend, AttentionModel, Pool, Tier

    backend = AttentionBackend(AttentionModel(q_heads=64, kv_heads=8, head_dim=128))
    out, lse = backend.decode(
        queries,                                    # [num_seqs, q_heads, head_dim] float32
        history_pool=Pool(int2_blocks, num_blocks=n_int2),
        bf16_pool=Pool(bf16_pages, num_blocks=n_bf16),
        sink=Tier(sink_tables, sink_first, sink_count),         # int32 arrays
        history=Tier(hist_tables, hist_first, hist_count),
        recent=Tier(recent_tables, recent_first, recent_count),
        rotation_k=mk, rotation_v=mv,               # [head_dim, head_dim] float32 or None
        max_history_tokens=..., max_bf16_tokens=...)

Every array of one call lives in one place: host memory (numpy, CPU tensors) or one CUDA device.
The library is $KVPOOL_ATTENTION_LIB, else libkvpool_attention.so beside this file, else the
build tree's build/lib/. numpy is the only dependency; torch is imported only when a tensor is
passed. Failures raise AttentionBackendError with the C API's code (absl/gRPC numbering).
Thread-safety: calls may run concurrently; on CUDA each backend keeps one workspace per device,
so use one backend per stream (or pass `workspace=`).
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

import numpy as np

LIBRARY_ENV = "KVPOOL_ATTENTION_LIB"
LIBRARY_NAME = "libkvpool_attention.so"
API_VERSION = 10000  # KVPOOL_ATTENTION_VERSION of the header this module mirrors

HOST = -1
QUANT_METHODS = {"uniform": 0, "lloyd_max": 1, "bypass": 2}
SCALE_DTYPES = {"fp16": 0, "bf16": 1}
CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


class AttentionBackendError(RuntimeError):
    """A failed call: `code` (int, absl/gRPC numbering), `code_name` and the library's message."""

    def __init__(self, code: int, message: str):
        self.code = code
        self.code_name = CODE_NAMES.get(code, str(code))
        self.message = message
        super().__init__(f"{self.code_name}: {message}")


# The C structs, field for field (kvpool_attention.h).
class _Pool(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("num_blocks", ctypes.c_int64),
                ("block_stride", ctypes.c_int64)]


class _Tier(ctypes.Structure):
    _fields_ = [("block_tables", ctypes.c_void_p), ("block_table_stride", ctypes.c_int32),
                ("first_token", ctypes.c_void_p), ("num_tokens", ctypes.c_void_p)]


class _Desc(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("q_heads", ctypes.c_int32),
                ("kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("bits", ctypes.c_int32), ("group_size", ctypes.c_int32),
                ("quant_method", ctypes.c_int32), ("scale_dtype", ctypes.c_int32),
                ("block_tokens", ctypes.c_int32), ("history_pool", _Pool), ("bf16_pool", _Pool),
                ("sink", _Tier), ("history", _Tier), ("recent", _Tier),
                ("num_seqs", ctypes.c_int32), ("max_history_tokens", ctypes.c_int32),
                ("max_bf16_tokens", ctypes.c_int32), ("device", ctypes.c_int32)]


class _Io(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("queries", ctypes.c_void_p),
                ("rotation_k", ctypes.c_void_p), ("rotation_v", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("lse", ctypes.c_void_p),
                ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_uint64),
                ("stream", ctypes.c_void_p)]


_lib_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None


def find_library() -> str:
    """The path of libkvpool_attention.so this module loads (see the module doc)."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return env
    here = Path(__file__).resolve().parent
    beside = here / LIBRARY_NAME
    if beside.is_file():
        return str(beside)
    for parent in here.parents:
        candidate = parent / "build" / "lib" / LIBRARY_NAME
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"{LIBRARY_NAME} not found: set {LIBRARY_ENV} or build the kvpool_attention_capi target")


def load_library(path: Optional[str] = None) -> ctypes.CDLL:
    """Loads the library once (later calls return the same handle) and checks its version."""
    global _lib
    with _lib_lock:
        if _lib is not None and path is None:
            return _lib
        lib = ctypes.CDLL(path or find_library())
        lib.kvpool_attention_version.restype = ctypes.c_int32
        lib.kvpool_attention_has_cuda.restype = ctypes.c_int32
        lib.kvpool_attention_last_error.restype = ctypes.c_char_p
        lib.kvpool_attention_workspace_bytes.restype = ctypes.c_int32
        lib.kvpool_attention_workspace_bytes.argtypes = [ctypes.POINTER(_Desc),
                                                         ctypes.POINTER(ctypes.c_uint64)]
        lib.kvpool_attention_decode.restype = ctypes.c_int32
        lib.kvpool_attention_decode.argtypes = [ctypes.POINTER(_Desc), ctypes.POINTER(_Io)]
        lib.kvpool_attention_desc_init.argtypes = [ctypes.c_void_p]
        version = lib.kvpool_attention_version()
        if version // 10000 != API_VERSION // 10000 or version < API_VERSION:
            raise RuntimeError(f"libkvpool_attention version {version}, this module needs "
                               f"{API_VERSION} (same major, at least this minor)")
        if path is None:
            _lib = lib
        return lib


@dataclass(frozen=True)
class AttentionModel:
    """The model side: heads and the codec of the history blocks (kvpool's QuantConfig)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    bits: int = 2
    group_size: int = 0  # 0: head_dim
    quant_method: str = "uniform"  # uniform | lloyd_max | bypass
    scale_dtype: str = "fp16"  # fp16 | bf16
    block_tokens: int = 16

    def block_bytes(self, bf16: bool = False) -> int:
        """Bytes of one block (history) or one BF16 page (kernels/block_layout.h)."""
        bits = 16 if bf16 or self.quant_method == "bypass" else self.bits
        groups = 0 if bits == 16 else self.head_dim // (self.group_size or self.head_dim)
        raw = 2 * self.block_tokens * self.head_dim * bits // 8 + 2 * self.block_tokens * groups * 4
        return self.kv_heads * ((raw + 15) // 16 * 16)


@dataclass
class Pool:
    """num_blocks blocks of one layout in one array (any dtype; its bytes are the blocks).
    block_stride: bytes from one block id to the next, 0 = the block size."""

    data: Any
    num_blocks: int
    block_stride: int = 0


@dataclass
class Tier:
    """One tier of every sequence: int32 block_tables [num_seqs, stride], first_token and
    num_tokens [num_seqs] (positions [first, first + num) of the row's blocks)."""

    block_tables: Any
    first_token: Any
    num_tokens: Any


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


class _Arg:
    """One array argument: its address, device (-1 host), shape, dtype name and byte size; keeps
    the object (and any converted copy) alive for the call."""

    def __init__(self, x: Any, name: str, dtype: Optional[str], writable: bool = False):
        if not isinstance(x, np.ndarray) and not _is_torch(x):
            x = _from_dlpack(x, name)
        self.obj = x
        if _is_torch(x):
            if not x.is_contiguous():
                if writable:
                    raise ValueError(f"{name} must be contiguous")
                x = self.obj = x.contiguous()
            if x.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{name} is on {x.device}; use CPU or CUDA tensors")
            self.device = x.device.index if x.device.type == "cuda" else HOST
            self.dtype = str(x.dtype).replace("torch.", "")
            self.ptr = x.data_ptr()
            self.nbytes = x.numel() * x.element_size()
        else:
            if not x.flags.c_contiguous:
                if writable:
                    raise ValueError(f"{name} must be C-contiguous")
                x = self.obj = np.ascontiguousarray(x)
            if writable and not x.flags.writeable:
                raise ValueError(f"{name} is read-only")
            self.device = HOST
            self.dtype = x.dtype.name
            self.ptr = x.ctypes.data
            self.nbytes = x.nbytes
        self.shape = tuple(int(s) for s in x.shape)
        if dtype is not None and self.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, not {self.dtype}")


def _from_dlpack(x: Any, name: str) -> Any:
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"{name}: expected a numpy array, a torch tensor or a DLPack object")
    device_type, _ = x.__dlpack_device__()
    if device_type == 1:  # kDLCPU
        return np.from_dlpack(x)
    import torch  # device memory: torch reads the capsule

    return torch.from_dlpack(x)


def _check(lib: ctypes.CDLL, code: int) -> None:
    if code != 0:
        message = lib.kvpool_attention_last_error().decode(errors="replace")
        raise AttentionBackendError(code, message)


class AttentionBackend:
    """kvpool's decode attention for one model; one decode() per layer per step."""

    def __init__(self, model: AttentionModel, library: Optional[str] = None):
        if model.quant_method not in QUANT_METHODS:
            raise ValueError(f"quant_method must be one of {sorted(QUANT_METHODS)}")
        if model.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {sorted(SCALE_DTYPES)}")
        self.model = model
        self._lib = load_library(library)
        self._workspaces: dict = {}
        self._lock = threading.Lock()

    @property
    def has_cuda(self) -> bool:
        """Whether the library was built with the CUDA kernel."""
        return bool(self._lib.kvpool_attention_has_cuda())

    def decode(self, queries: Any, *, history_pool: Pool, bf16_pool: Pool, sink: Tier,
               history: Tier, recent: Tier, rotation_k: Any = None, rotation_v: Any = None,
               max_history_tokens: Optional[int] = None, max_bf16_tokens: Optional[int] = None,
               out: Any = None, lse: Any = None,
               workspace: Any = None) -> Tuple[Any, Any]:
        """One decode step of one layer: out [num_seqs, q_heads, head_dim] and lse
        [num_seqs, q_heads] (float32, natural log) in the queries' kind and place.

        queries are in the model's original basis; rotation_k / rotation_v are the layer's
        [head_dim, head_dim] float32 rotations (x_rot = x @ M; None = identity). The token
        bounds default to the arrays' maxima (on CUDA that reads them back: a synchronization;
        engines pass them). On CUDA the kernels are enqueued on torch's current stream.
        """
        m = self.model
        q = _Arg(queries, "queries", "float32")
        if len(q.shape) != 3 or q.shape[1:] != (m.q_heads, m.head_dim):
            raise ValueError(f"queries must be [num_seqs, {m.q_heads}, {m.head_dim}], "
                             f"not {list(q.shape)}")
        num_seqs = q.shape[0]
        device = q.device
        args = [q]

        def on_device(a: _Arg) -> _Arg:
            if a.device != device:
                raise ValueError(f"every array must be where the queries are (device {device}), "
                                 f"one is on {a.device}")
            args.append(a)
            return a

        pools = []
        for pool, name, bf16 in ((history_pool, "history_pool", False),
                                 (bf16_pool, "bf16_pool", True)):
            a = on_device(_Arg(pool.data, name, None))
            stride = pool.block_stride or m.block_bytes(bf16)
            need = 0
            if pool.num_blocks > 0:
                need = (pool.num_blocks - 1) * stride + m.block_bytes(bf16)
            if pool.num_blocks < 0 or a.nbytes < need:
                raise ValueError(f"{name} holds {a.nbytes} bytes, {pool.num_blocks} blocks need "
                                 f"{need}")
            pools.append(_Pool(a.ptr, pool.num_blocks, pool.block_stride))
        tiers = []
        counts = {}
        for tier, name in ((sink, "sink"), (history, "history"), (recent, "recent")):
            tables = on_device(_Arg(tier.block_tables, f"{name}.block_tables", "int32"))
            first = on_device(_Arg(tier.first_token, f"{name}.first_token", "int32"))
            count = on_device(_Arg(tier.num_tokens, f"{name}.num_tokens", "int32"))
            if len(tables.shape) != 2 or tables.shape[0] != num_seqs:
                raise ValueError(f"{name}.block_tables must be [num_seqs, stride]")
            if first.shape != (num_seqs,) or count.shape != (num_seqs,):
                raise ValueError(f"{name}.first_token and num_tokens must be [{num_seqs}]")
            tiers.append(_Tier(tables.ptr, tables.shape[1], first.ptr, count.ptr))
            counts[name] = count.obj
        if max_history_tokens is None:
            max_history_tokens = _max(counts["history"])
        if max_bf16_tokens is None:
            max_bf16_tokens = _max(counts["sink"] + counts["recent"])

        rotations = []
        for r, name in ((rotation_k, "rotation_k"), (rotation_v, "rotation_v")):
            if r is None:
                rotations.append(None)
                continue
            a = on_device(_Arg(r, name, "float32"))
            if a.shape != (m.head_dim, m.head_dim):
                raise ValueError(f"{name} must be [{m.head_dim}, {m.head_dim}]")
            rotations.append(a.ptr)

        out = self._output(out, queries, (num_seqs, m.q_heads, m.head_dim), device, "out")
        lse = self._output(lse, queries, (num_seqs, m.q_heads), device, "lse")
        out_arg = on_device(_Arg(out, "out", "float32", writable=True))
        lse_arg = on_device(_Arg(lse, "lse", "float32", writable=True))

        desc = _Desc(ctypes.sizeof(_Desc), m.q_heads, m.kv_heads, m.head_dim, m.bits, m.group_size,
                     QUANT_METHODS[m.quant_method], SCALE_DTYPES[m.scale_dtype], m.block_tokens,
                     pools[0], pools[1], tiers[0], tiers[1], tiers[2], num_seqs,
                     int(max_history_tokens), int(max_bf16_tokens), device)
        io = _Io(ctypes.sizeof(_Io), q.ptr, rotations[0], rotations[1], out_arg.ptr, lse_arg.ptr,
                 None, 0, None)
        if device != HOST:
            import torch

            bytes_ = ctypes.c_uint64(0)
            _check(self._lib, self._lib.kvpool_attention_workspace_bytes(ctypes.byref(desc),
                                                                       ctypes.byref(bytes_)))
            ws = self._workspace(device, bytes_.value) if workspace is None else workspace
            ws_arg = on_device(_Arg(ws, "workspace", None, writable=True))
            io.workspace = ws_arg.ptr
            io.workspace_bytes = ws_arg.nbytes
            io.stream = torch.cuda.current_stream(device).cuda_stream
        _check(self._lib, self._lib.kvpool_attention_decode(ctypes.byref(desc), ctypes.byref(io)))
        del args  # the inputs (and converted copies) lived through the call
        return out, lse

    def _output(self, given: Any, like: Any, shape: tuple, device: int, name: str) -> Any:
        if given is not None:
            a = _Arg(given, name, "float32", writable=True)
            if a.shape != shape:
                raise ValueError(f"{name} must be {list(shape)}, not {list(a.shape)}")
            return given
        if _is_torch(like):
            import torch

            return torch.empty(shape, dtype=torch.float32, device=like.device)
        if device != HOST:
            import torch

            return torch.empty(shape, dtype=torch.float32, device=f"cuda:{device}")
        return np.empty(shape, dtype=np.float32)

    def _workspace(self, device: int, nbytes: int) -> Any:
        import torch

        with self._lock:
            ws = self._workspaces.get(device)
            if ws is None or ws.numel() < nbytes:
                ws = torch.empty(max(nbytes, 16), dtype=torch.uint8, device=f"cuda:{device}")
                self._workspaces[device] = ws
            return ws


def _max(x: Any) -> int:
    if _is_torch(x):
        return int(x.max().item()) if x.numel() else 0
    x = np.asarray(x)
    return int(x.max()) if x.size else 0
