"""An SGLang HiCache storage backend (HiCacheStorage) that keeps pages in kvpoold, in 2 bits.

Loadable with the dynamic backend:

    python -m sglang.launch_server ... --enable-hierarchical-cache \
        --hicache-storage-backend dynamic \
        --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
            "module_path": "kvpool.connectors.sglang_hicache",
            "class_name": "KvpoolHiCacheStorage",
            "kvpool_target": "127.0.0.1:50051", "kvpool_model_id": "qwen3-4b-pages"}'

SGLang's cache controller hands the backend pages by their hash (a hex string chained over the
prefix): batch_exists(keys) returns how many leading pages are stored, batch_set(keys, values)
stores pages, batch_get(keys, target_locations) fills the controller's buffers. A page is
page_size tokens of every layer, laid out by the host pool (MHA, `layer_first`:
[2, layers, page_size, kv_heads, head_dim], K then V; `page_first`: [2, page_size, layers,
kv_heads, head_dim]). Each page becomes one daemon sequence, `hicache/<hash>`, appended as one
prefill (without end_of_prefill, so every token past the model's sink is quantized to INT2) and
sealed; batch_get reads it back dequantized (ReadKv). The model should be registered with a
small sink (e.g. sink_tokens=0 or 8) so that pages are stored mostly in 2 bits.

The generic (non zero-copy) interface is implemented: SGLang selects it for the dynamic backend
unless the extra config sets "interface_v1". When SGLang is importable the class subclasses its
HiCacheStorage; without it a stand-in base lets drivers exercise it
(client/python/tests/test_sglang_hicache.py).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import grpc
import numpy as np

from kvpool.client import Client
from kvpool.errors import KvpoolError
from kvpool.options import ClientOptions
from kvpool.tensors import DType, as_numpy, to_torch

try:
    from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig,
                                                      HiCacheStorageExtraInfo)
except ImportError:

    class HiCacheStorage:  # type: ignore[no-redef]
        """Stand-in for SGLang's HiCacheStorage base (the host pool registration)."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host

    HiCacheStorageConfig = Any  # type: ignore[misc,assignment]
    HiCacheStorageExtraInfo = Any  # type: ignore[misc,assignment]


class KvpoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """Pages of SGLang's hierarchical cache as kvpool sequences (one per page hash)."""

    def __init__(self, storage_config: Any, kwargs: Optional[Dict[str, Any]] = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        extra.update(kwargs or {})
        self._model_id = str(extra["kvpool_model_id"])
        self._client = Client(str(extra.get("kvpool_target", "127.0.0.1:50051")),
                              ClientOptions(deadline_s=float(extra.get("kvpool_deadline_s",
                                                                       60.0))))
        rank = getattr(storage_config, "tp_rank", 0)
        # Ranks hold different heads of the same page: each writes its own sequence.
        self._prefix = f"hicache/{self._model_id}/r{rank}/"
        self.mem_pool_host: Any = None

    # -- helpers --------------------------------------------------------------------------------

    def _sequence(self, key: str) -> str:
        return self._prefix + key

    def _geometry(self):
        pool = self.mem_pool_host
        if pool is None:
            raise RuntimeError("register_mem_pool_host was not called")
        layout = getattr(pool, "layout", "layer_first")
        if layout not in ("layer_first", "page_first"):
            raise ValueError(f"kvpool HiCache backend: unsupported layout {layout!r}")
        return (layout, int(pool.layer_num), int(pool.page_size), int(pool.head_num),
                int(pool.head_dim))

    def _split(self, flat: np.ndarray):
        """K, V [layers, page_size, heads, head_dim] of a flat page."""
        layout, layers, page, heads, dim = self._geometry()
        if layout == "layer_first":
            kv = flat.reshape(2, layers, page, heads, dim)
        else:
            kv = flat.reshape(2, page, layers, heads, dim).transpose(0, 2, 1, 3, 4)
        return kv[0], kv[1]

    def _join(self, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        layout, *_ = self._geometry()
        kv = np.stack([k, v])
        if layout == "page_first":
            kv = kv.transpose(0, 2, 1, 3, 4)
        return np.ascontiguousarray(kv).reshape(-1)

    # -- HiCacheStorage -------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        try:
            self._client.describe_sequence(self._sequence(key))
            return True
        except KvpoolError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return False
            raise

    def batch_exists(self, keys: List[str], extra_info: Optional[Any] = None) -> int:
        """How many leading keys are stored."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        if self.exists(key):
            return True  # pages are immutable: same hash, same content
        flat = as_numpy(value)
        k, v = self._split(flat)
        seq = self._sequence(key)
        try:
            self._client.create_sequence(self._model_id, seq)
            self._client.append_kv(seq, k, v)
            self._client.seal_sequence(seq)
            return True
        except KvpoolError as e:
            if e.code == grpc.StatusCode.ALREADY_EXISTS:
                return True  # another rank or thread stored it first
            try:  # leave nothing half-written behind
                self._client.release_sequence(seq)
            except KvpoolError:
                pass
            return False

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        return all([self.set(key, value) for key, value in zip(keys, values or [])])

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Any:
        """The page, written into target_location (a flat tensor of the host pool's dtype)
        when given; None when the key is not stored."""
        try:
            got = self._client.read_kv(self._sequence(key), dtype=DType.FP32)
        except KvpoolError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        flat = self._join(got.k, got.v)
        if target_location is None:
            return flat
        if isinstance(target_location, np.ndarray):
            target_location[...] = flat.astype(target_location.dtype)
        else:
            target_location.copy_(to_torch(flat).to(target_location.dtype))
        return target_location

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Any]:
        targets = target_locations or [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets)]

    def clear(self) -> None:
        """Releases every page sequence of this backend."""
        for s in self._client.get_stats(include_sequences=True).sequences:
            if s.sequence_id.startswith(self._prefix):
                try:
                    self._client.release_sequence(s.sequence_id)
                except KvpoolError:
                    pass

    def get_stats(self):
        return None
