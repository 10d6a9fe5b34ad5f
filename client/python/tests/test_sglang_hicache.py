"""The SGLang HiCache storage backend driven as SGLang's cache controller drives it, against a
real kvpoold: construction as the dynamic backend factory does it (storage config, extra
config dict), register_mem_pool_host, then per batch of page hashes batch_exists (prefetch
check), batch_set with flat pages from the host pool (backup), batch_get into the host pool's
flat dummy pages (prefetch), for the host pool's layouts.

SGLang is not installed here: HostPool carries what SGLang's MHATokenToKVPoolHost exposes
(layout, layer_num, page_size, head_num, head_dim, dtype, get_data_page,
get_dummy_flat_data_page, set_from_flat_data_page with its page shapes).
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import pytest

from kvpool.connectors.sglang_hicache import KvpoolHiCacheStorage

LAYERS, HEADS, D, PAGE = 3, 2, 64, 64


class HostPool:
    """The host KV pool's page layout (MHATokenToKVPoolHost)."""

    def __init__(self, layout: str, pages: int):
        self.layout, self.layer_num, self.page_size = layout, LAYERS, PAGE
        self.head_num, self.head_dim, self.dtype = HEADS, D, ml_dtypes.bfloat16
        size = pages * PAGE
        dims = ((2, LAYERS, size, HEADS, D) if layout == "layer_first"
                else (2, size, LAYERS, HEADS, D))
        self.kv_buffer = np.zeros(dims, self.dtype)

    def get_data_page(self, index, flat=True):
        page = (self.kv_buffer[:, :, index:index + PAGE] if self.layout == "layer_first"
                else self.kv_buffer[:, index:index + PAGE])
        return page.reshape(-1) if flat else page

    def get_dummy_flat_data_page(self):
        return np.zeros((2, LAYERS, PAGE, HEADS, D), self.dtype).reshape(-1)

    def set_from_flat_data_page(self, index, data_page):
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + PAGE] = data_page.reshape(2, LAYERS, PAGE, HEADS, D)
        else:
            self.kv_buffer[:, index:index + PAGE] = data_page.reshape(2, PAGE, LAYERS, HEADS, D)


class StorageConfig:  # HiCacheStorageConfig (the fields the backend reads)
    def __init__(self, extra):
        self.tp_rank, self.tp_size, self.extra_config = 0, 1, extra


def page_hashes(tokens, salt=""):
    out, parent = [], salt
    for i in range(0, len(tokens), PAGE):
        parent = hashlib.sha256((parent + str(tokens[i:i + PAGE])).encode()).hexdigest()
        out.append(parent)
    return out


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_backup_then_prefetch_pages(client, uid, layout):
    model = f"pages-{uid}"
    client.register_model(model, q_heads=4, kv_heads=HEADS, num_layers=LAYERS, head_dim=D,
                          data_free="identity",
                          quant={"method": "bypass", "sink_tokens": 8, "recent_tokens": 8})
    extra = {"backend_name": "kvpool", "module_path": "kvpool.connectors.sglang_hicache",
             "class_name": "KvpoolHiCacheStorage", "kvpool_target": client.target,
             "kvpool_model_id": model}
    # The dynamic backend factory: backend_class(storage_config, kwargs).
    backend = KvpoolHiCacheStorage(StorageConfig(extra), {})
    src = HostPool(layout, pages=4)
    src.kv_buffer[...] = np.random.default_rng(3).standard_normal(
        src.kv_buffer.shape).astype(ml_dtypes.bfloat16)
    backend.register_mem_pool_host(src)
    keys = page_hashes(list(range(3 * PAGE)), uid)
    assert backend.batch_exists(keys) == 0
    # Backup: the controller's generic page set (_generic_page_set).
    host_indices = [0, PAGE, 2 * PAGE]
    assert backend.batch_set(keys[:2], [src.get_data_page(i) for i in host_indices[:2]])
    assert backend.batch_exists(keys) == 2
    assert backend.batch_set(keys[:2], [src.get_data_page(i) for i in host_indices[:2]])
    # Prefetch into another pool: the generic page get (_generic_page_get).
    dst = HostPool(layout, pages=4)
    backend.register_mem_pool_host(dst)
    dummies = [dst.get_dummy_flat_data_page() for _ in keys]
    pages = backend.batch_get(keys, dummies)
    assert pages[2] is None
    for i, page in enumerate(pages[:2]):
        dst.set_from_flat_data_page(PAGE * (3 - i), page)
        np.testing.assert_array_equal(dst.get_data_page(PAGE * (3 - i)).view(np.uint16),
                                      src.get_data_page(host_indices[i]).view(np.uint16))
    assert backend.exists(keys[0]) and not backend.exists(keys[2])
    backend.clear()
    assert backend.batch_exists(keys) == 0
    client.delete_model(model, force=True)


def test_pages_in_two_bits(client, uid):
    model = f"pages2-{uid}"
    client.register_model(model, q_heads=4, kv_heads=HEADS, num_layers=LAYERS, head_dim=D,
                          data_free="hadamard", quant={"sink_tokens": 8, "recent_tokens": 8})
    backend = KvpoolHiCacheStorage(StorageConfig({"kvpool_target": client.target,
                                                  "kvpool_model_id": model}))
    pool = HostPool("layer_first", pages=1)
    pool.kv_buffer[...] = np.random.default_rng(4).standard_normal(
        pool.kv_buffer.shape).astype(ml_dtypes.bfloat16)
    backend.register_mem_pool_host(pool)
    key = page_hashes(list(range(PAGE)), uid)[0]
    assert backend.set(key, pool.get_data_page(0))
    back = backend.get(key, pool.get_dummy_flat_data_page()).astype(np.float32)
    ref = pool.get_data_page(0).astype(np.float32)
    rel = np.linalg.norm(back - ref) / np.linalg.norm(ref)
    assert 0.05 < rel < 0.5  # 2 bits past the 8-token sink
    info = client.describe_sequence(f"hicache/{model}/r0/{key}")
    assert info.history_tokens == PAGE - 8 and info.state == 3  # sealed
    client.delete_model(model, force=True)
