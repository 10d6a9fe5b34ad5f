"""The vLLM connector driven as vLLM's scheduler and model runner drive it, against a real
kvpoold: the engine's call order (scheduler: get_num_new_matched_tokens ->
update_state_after_alloc -> build_connector_meta; worker: bind_connector_metadata ->
start_load_kv -> per layer wait_for_layer_load / attention writes the paged cache /
save_kv_layer -> wait_for_save -> get_finished -> clear_connector_metadata; scheduler:
request_finished) and its data shapes (paged caches [num_blocks, kv_heads, block_size,
2 * head_dim] per layer, block ids per request, slots = block * block_size + offset, chunked
prefill through scheduled_cached_reqs).

vLLM itself is not installed here: the request and scheduler-output objects below carry the
fields vLLM's own types have (make check-connectors compares the method signatures with the
pinned vLLM source).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import ml_dtypes
import numpy as np
import pytest

from kvpool import Client
from kvpool.connectors.vllm_connector import (KvpoolConnector, KvpoolConnectorMetadata,
                                              KVConnectorRole, layer_index, slot_mapping)

LAYERS, HKV, D, BLOCK, NUM_BLOCKS = 3, 2, 64, 16, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


# -- the engine's data, as vLLM's types carry it ---------------------------------------------


@dataclasses.dataclass
class Request:  # vllm.v1.request.Request (the fields connectors read)
    request_id: str
    prompt_token_ids: List[int]
    num_computed_tokens: int = 0


@dataclasses.dataclass
class KVCacheBlocks:  # vllm.v1.core.kv_cache_manager.KVCacheBlocks
    block_ids: List[int]

    def get_block_ids(self):
        return (self.block_ids,)  # one tuple entry per KV cache group


@dataclasses.dataclass
class NewRequestData:  # vllm.v1.core.sched.output.NewRequestData
    req_id: str
    prompt_token_ids: List[int]
    block_ids: tuple
    num_computed_tokens: int


@dataclasses.dataclass
class CachedRequestData:  # vllm.v1.core.sched.output.CachedRequestData
    req_ids: List[str] = dataclasses.field(default_factory=list)
    new_block_ids: List[Optional[tuple]] = dataclasses.field(default_factory=list)
    num_computed_tokens: List[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SchedulerOutput:  # vllm.v1.core.sched.output.SchedulerOutput
    scheduled_new_reqs: List[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: Dict[str, int]


@dataclasses.dataclass
class ForwardContext:  # vllm.forward_context.ForwardContext (attn_metadata per layer)
    attn_metadata: dict


class VllmConfig:
    def __init__(self, target: str, model_id: str):
        self.cache_config = type("CacheConfig", (), {"block_size": BLOCK})()
        self.kv_transfer_config = type("KVTransferConfig", (), {
            "kv_connector_extra_config": {"kvpool_target": target, "kvpool_model_id": model_id,
                                          "kvpool_sequence_prefix": f"vllm-{model_id}"}})()


class Engine:
    """One vLLM instance: a scheduler-side and a worker-side connector and paged caches."""

    def __init__(self, target: str, model_id: str):
        cfg = VllmConfig(target, model_id)
        self.scheduler = KvpoolConnector(cfg, KVConnectorRole.SCHEDULER, None)
        self.worker = KvpoolConnector(cfg, KVConnectorRole.WORKER, None)
        self.caches = {n: np.zeros((NUM_BLOCKS, HKV, BLOCK, 2 * D), ml_dtypes.bfloat16)
                       for n in NAMES}
        self.worker.register_kv_caches(self.caches)
        self.free = list(range(NUM_BLOCKS))

    def allocate(self, tokens: int) -> List[int]:
        n = -(-tokens // BLOCK)
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def step(self, so: SchedulerOutput, kv_of_token) -> KvpoolConnectorMetadata:
        """One model-runner step: kv_of_token(layer, positions) -> K, V of computed tokens."""
        meta = self.scheduler.build_connector_meta(so)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(ForwardContext({n: None for n in NAMES}))
        for name in NAMES:
            self.worker.wait_for_layer_load(name)
            # Attention writes the step's new tokens into the paged cache at their slots.
            for new in so.scheduled_new_reqs:
                self._write(name, new.req_id, new.block_ids[0], new.num_computed_tokens,
                            so.num_scheduled_tokens[new.req_id], kv_of_token)
            for i, req_id in enumerate(so.scheduled_cached_reqs.req_ids):
                blocks = self.scheduler._blocks[req_id]
                self._write(name, req_id, blocks, so.scheduled_cached_reqs.num_computed_tokens[i],
                            so.num_scheduled_tokens[req_id], kv_of_token)
            self.worker.save_kv_layer(name, self.caches[name], None)
        self.worker.wait_for_save()
        assert self.worker.get_finished(set()) == (None, None)
        self.worker.clear_connector_metadata()
        return meta

    def _write(self, name, req_id, blocks, start, count, kv_of_token):
        layer = layer_index(name)
        slots = slot_mapping(blocks, BLOCK, start, start + count)
        k, v = kv_of_token(layer, np.arange(start, start + count))
        self.caches[name][slots // BLOCK, :, slots % BLOCK] = \
            np.concatenate([k, v], axis=-1).astype(ml_dtypes.bfloat16)

    def read(self, name, blocks, start, stop):
        slots = slot_mapping(blocks, BLOCK, start, stop)
        rows = self.caches[name][slots // BLOCK, :, slots % BLOCK].astype(np.float32)
        return rows[..., :D], rows[..., D:]


def model_kv(layer: int, positions: np.ndarray):
    """Deterministic K/V of a token position (what the model would compute)."""
    rng = np.random.default_rng(1000 * layer + 7)
    table = rng.standard_normal((512, 2, HKV, D), dtype=np.float32)
    return table[positions, 0], table[positions, 1]


@pytest.mark.parametrize("kind", ["exact", "int2"])
def test_prefill_saves_and_a_second_instance_loads(client, uid, kind):
    model = f"vllm-{kind}-{uid}"
    if kind == "exact":
        quant = {"method": "bypass", "sink_tokens": 16, "recent_tokens": 32}
        client.register_model(model, q_heads=4, kv_heads=HKV, num_layers=LAYERS, head_dim=D,
                              data_free="identity", quant=quant)
    else:
        client.register_model(model, q_heads=4, kv_heads=HKV, num_layers=LAYERS, head_dim=D,
                              data_free="hadamard", quant={"sink_tokens": 16})
    prompt = list(range(100, 300))  # 200 tokens

    # Instance A: nothing cached; a chunked prefill (128 + 72 tokens) saved layer by layer.
    a = Engine(client.target, model)
    req = Request("a1", prompt)
    assert a.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = a.allocate(len(prompt))
    a.scheduler.update_state_after_alloc(req, KVCacheBlocks(blocks), 0)
    meta = a.step(SchedulerOutput([NewRequestData("a1", prompt, (blocks,), 0)],
                                  CachedRequestData(), {"a1": 128}), model_kv)
    assert [(s.start, s.stop) for s in meta.saves] == [(0, 128)] and not meta.loads
    meta = a.step(SchedulerOutput([], CachedRequestData(["a1"], [None], [128]), {"a1": 72}),
                  model_kv)
    assert [(s.start, s.stop) for s in meta.saves] == [(128, 200)]
    held = client.describe_sequence("vllm-" + model + "/a1")
    assert held.total_tokens == 200
    assert a.scheduler.request_finished(req, blocks)[0] is False

    # Instance B: the same document with another question; the daemon supplies the prefix.
    b = Engine(client.target, model)
    prompt_b = prompt[:180] + [7, 8, 9, 10, 11]
    req_b = Request("b1", prompt_b)
    n_ext, is_async = b.scheduler.get_num_new_matched_tokens(req_b, 0)
    assert not is_async and n_ext > 0 and n_ext % BLOCK == 0 and n_ext <= 180
    blocks_b = b.allocate(len(prompt_b))[::-1]  # any block order
    b.scheduler.update_state_after_alloc(req_b, KVCacheBlocks(blocks_b), n_ext)
    computed = []

    def rest_kv(layer, positions):
        computed.append(positions)
        return model_kv(layer, positions)

    meta = b.step(SchedulerOutput([NewRequestData("b1", prompt_b, (blocks_b,), n_ext)],
                                  CachedRequestData(), {"b1": len(prompt_b) - n_ext}), rest_kv)
    assert [(x.start, x.stop) for x in meta.loads] == [(0, n_ext)]
    assert computed[0][0] == n_ext  # the engine computed only what was not loaded
    for name in NAMES:
        k, v = b.read(name, blocks_b, 0, n_ext)
        ref_k, ref_v = model_kv(layer_index(name), np.arange(n_ext))
        ref_k = ref_k.astype(ml_dtypes.bfloat16).astype(np.float32)
        ref_v = ref_v.astype(ml_dtypes.bfloat16).astype(np.float32)
        if kind == "exact":
            np.testing.assert_array_equal(k, ref_k)
            np.testing.assert_array_equal(v, ref_v)
        else:  # 2-bit history (the sink rows stay BF16)
            rel = np.linalg.norm(k[16:] - ref_k[16:]) / np.linalg.norm(ref_k[16:])
            assert 0.05 < rel < 0.5  # uniform 2-bit on Gaussian rows: about 0.4
            np.testing.assert_allclose(k[:16], ref_k[:16], atol=0.02)  # BF16 sink, rotated
    b.scheduler.request_finished(req_b, blocks_b)
    client.delete_model(model, force=True)


def test_lookup_leaves_the_last_token_and_survives_an_unreachable_daemon(client, uid):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    e = KvpoolConnector(VllmConfig(dead, "m"), KVConnectorRole.SCHEDULER, None)
    e._client = Client(dead)  # default retries, then a miss
    assert e.get_num_new_matched_tokens(Request("x", list(range(64))), 0) == (0, False)
