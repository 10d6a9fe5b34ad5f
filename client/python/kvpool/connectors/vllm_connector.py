"""A vLLM KV connector (KVConnectorBase_V1) that keeps prompts' KV caches in kvpoold.

Loadable out of tree:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvpoolConnector",
        "kv_connector_module_path": "kvpool.connectors.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvpool_target": "127.0.0.1:50051",
                                      "kvpool_model_id": "qwen3-4b"}}'

The model must be registered with kvpoold first (same shape, a rotation). What it does:

- scheduler side: get_num_new_matched_tokens asks the daemon for the longest cached prefix of
  the prompt (LookupPrefix), floored to whole vLLM blocks and leaving at least one token to
  compute; update_state_after_alloc remembers which blocks will receive those tokens;
  build_connector_meta tells the workers what to load and which freshly computed prompt tokens
  to save; request_finished releases the request's daemon sequence (its prefix units stay
  cached for later requests).
- worker side: register_kv_caches takes the paged caches (per layer [num_blocks, kv_heads,
  block_size, 2 * head_dim], K then V in the last dimension, vLLM's FlashAttention layout);
  start_load_kv reads the matched tokens back from the daemon (ReadKv, layer by layer in a
  background thread) and wait_for_layer_load waits for one layer; save_kv_layer gathers the
  layer's new prompt tokens from their slots and writes them to one AppendKv stream per request
  and step (the layer-wise push), and wait_for_save commits them.

The daemon stores 2-bit K/V: what comes back is the dequantized cache (docs/oscar-method.md),
not the bytes vLLM computed. Prompts are pushed without `end_of_prefill`, so every whole block
is quantized and published for reuse. Decode tokens stay in vLLM.

When vLLM is importable the connector subclasses its KVConnectorBase_V1 (and the metadata
class its KVConnectorMetadata); without vLLM a small stand-in base with the same methods lets
drivers exercise it (client/python/tests/test_vllm_connector.py).
"""

from __future__ import annotations

import dataclasses
import enum
import re
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from kvpool.client import Client
from kvpool.errors import KvpoolError
from kvpool.options import ClientOptions
from kvpool.tensors import DType, as_numpy, to_torch

try:  # the engine's own base classes, when vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                   KVConnectorMetadata,
                                                                   KVConnectorRole)
except ImportError:

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's scheduler-to-worker metadata base."""

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in for vLLM's base: the metadata binding the engine calls around a step."""

        def __init__(self, vllm_config: Any, role: KVConnectorRole,
                     kv_cache_config: Any) -> None:
            self._vllm_config = vllm_config
            self._role = role
            self._connector_metadata: Optional[KVConnectorMetadata] = None

        @property
        def role(self) -> KVConnectorRole:
            return self._role

        def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> KVConnectorMetadata:
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None


_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(layer_name: str) -> int:
    """The layer number in a vLLM layer name ("model.layers.12.self_attn.attn" -> 12)."""
    m = _LAYER_INDEX.search(layer_name)
    if m is None:
        raise ValueError(f"no layer number in {layer_name!r}")
    return int(m.group(1))


def slot_mapping(block_ids: List[int], block_size: int, start: int, stop: int) -> np.ndarray:
    """Slots of tokens [start, stop) of a request whose blocks are block_ids (vLLM's slot =
    block_id * block_size + offset)."""
    pos = np.arange(start, stop)
    return np.asarray(block_ids, dtype=np.int64)[pos // block_size] * block_size + \
        pos % block_size


@dataclasses.dataclass
class LoadSpec:
    req_id: str
    token_ids: List[int]
    block_ids: List[int]
    start: int  # first token to load (tokens vLLM already holds come before)
    stop: int


@dataclasses.dataclass
class SaveSpec:
    req_id: str
    token_ids: List[int]  # the prompt
    block_ids: List[int]
    start: int  # tokens [start, stop) were computed in this step
    stop: int


@dataclasses.dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: List[LoadSpec] = dataclasses.field(default_factory=list)
    saves: List[SaveSpec] = dataclasses.field(default_factory=list)


def _extra_config(vllm_config: Any) -> Dict[str, Any]:
    kt = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(kt, "kv_connector_extra_config", None) or {}
    return dict(extra)


class KvpoolConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvpool as vLLM's KV connector (scheduler and worker roles)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = _extra_config(vllm_config)
        self._model_id = str(extra["kvpool_model_id"])
        self._prefix = str(extra.get("kvpool_sequence_prefix", "vllm"))
        self._block_size = int(vllm_config.cache_config.block_size)
        self._client = Client(str(extra.get("kvpool_target", "127.0.0.1:50051")),
                              ClientOptions(deadline_s=float(extra.get("kvpool_deadline_s",
                                                                       60.0))))
        self._is_scheduler = role == KVConnectorRole.SCHEDULER
        # scheduler state
        self._pending_loads: Dict[str, LoadSpec] = {}
        self._blocks: Dict[str, List[int]] = {}
        self._prompts: Dict[str, List[int]] = {}
        # worker state
        self._kv_caches: Dict[str, Any] = {}
        self._layer_events: Dict[int, threading.Event] = {}
        self._load_thread: Optional[threading.Thread] = None
        self._load_error: Optional[BaseException] = None
        self._streams: Dict[str, Any] = {}
        self._saved: Dict[str, int] = {}  # tokens the daemon holds per request
        self._failed_loads: Set[int] = set()

    def sequence_id(self, req_id: str) -> str:
        return f"{self._prefix}/{req_id}"

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """Tokens beyond num_computed_tokens the daemon can supply (whole blocks, never the
        prompt's last token), loaded synchronously (False)."""
        prompt = list(request.prompt_token_ids or [])
        if len(prompt) < 2:
            return 0, False
        try:
            matched = int(self._client.lookup_prefix(self._model_id, prompt).matched_tokens)
        except KvpoolError:
            return 0, False  # the daemon is a cache: unreachable means a miss
        usable = min(matched, len(prompt) - 1) // self._block_size * self._block_size
        return max(0, usable - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        block_ids = list(blocks.get_block_ids()[0])
        self._blocks[req_id] = block_ids
        if num_external_tokens > 0:
            start = int(request.num_computed_tokens)
            self._pending_loads[req_id] = LoadSpec(req_id, list(request.prompt_token_ids),
                                                   block_ids, start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvpoolConnectorMetadata:
        meta = KvpoolConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            block_ids = list(new.block_ids[0])
            self._blocks[new.req_id] = block_ids
            self._prompts[new.req_id] = prompt
            load = self._pending_loads.pop(new.req_id, None)
            if load is not None:
                load.block_ids = block_ids
                meta.loads.append(load)
            start = int(new.num_computed_tokens)
            stop = min(len(prompt), start + int(scheduled.get(new.req_id, 0)))
            if stop > start:
                meta.saves.append(SaveSpec(new.req_id, prompt, block_ids, start, stop))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(getattr(cached, "req_ids", [])):
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                self._blocks.setdefault(req_id, []).extend(new_blocks[0])
            prompt = self._prompts.get(req_id)
            if prompt is None:
                continue
            start = int(cached.num_computed_tokens[i])
            stop = min(len(prompt), start + int(scheduled.get(req_id, 0)))
            if stop > start:  # a later chunk of a chunked prefill
                meta.saves.append(SaveSpec(req_id, prompt, list(self._blocks[req_id]), start,
                                           stop))
        return meta

    def request_finished(self, request: Any,
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Blocks are freed at once (False); the daemon sequence is released, its published
        prefix units stay cached."""
        req_id = request.request_id
        self._blocks.pop(req_id, None)
        self._prompts.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        try:
            self._client.release_sequence(self.sequence_id(req_id))
        except KvpoolError:
            pass  # never saved, or already gone
        return False, {"kvpool_sequence": self.sequence_id(req_id)}

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self._kv_caches = dict(kv_caches)

    def _cache(self, layer: int) -> Tuple[str, Any]:
        for name, cache in self._kv_caches.items():
            if layer_index(name) == layer:
                return name, cache
        raise KeyError(f"no registered KV cache for layer {layer}")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpoolConnectorMetadata)
        layers = sorted({layer_index(n) for n in self._kv_caches})
        self._layer_events = {layer: threading.Event() for layer in layers}
        self._load_error = None
        if not meta.loads:
            for e in self._layer_events.values():
                e.set()
            return
        loads = list(meta.loads)

        def run() -> None:
            temps = []
            try:
                sources = []
                for load in loads:  # attach the daemon's cached prefix to a temporary sequence
                    seq = self.sequence_id(f"load-{load.req_id}")
                    r = self._client.create_sequence(self._model_id, seq,
                                                     prefix_token_ids=load.token_ids[:load.stop])
                    temps.append(seq)
                    if r.reused_tokens < load.stop:
                        raise KvpoolError.invalid_argument(
                            f"{load.req_id}: the daemon now holds {r.reused_tokens} of "
                            f"{load.stop} tokens (evicted since the lookup)")
                    sources.append((load, seq))
                for layer in layers:
                    for load, seq in sources:
                        got = self._client.read_kv(seq, layers=[layer], token_start=load.start,
                                                   num_tokens=load.stop - load.start)
                        self._scatter(layer, load, got.k[0], got.v[0])
                    self._layer_events[layer].set()
            except BaseException as e:  # surfaced by wait_for_layer_load
                self._load_error = e
                for load in loads:
                    self._failed_loads.update(load.block_ids)
            finally:
                for seq in temps:
                    try:
                        self._client.release_sequence(seq)
                    except KvpoolError:
                        pass
                for e in self._layer_events.values():
                    e.set()

        self._load_thread = threading.Thread(target=run, name="kvpool-load", daemon=True)
        self._load_thread.start()

    def _scatter(self, layer: int, load: LoadSpec, k: np.ndarray, v: np.ndarray) -> None:
        _, cache = self._cache(layer)
        slots = slot_mapping(load.block_ids, self._block_size, load.start, load.stop)
        blocks, offsets = slots // self._block_size, slots % self._block_size
        kv = np.concatenate([np.asarray(k, dtype=np.float32), np.asarray(v, dtype=np.float32)],
                            axis=-1)
        if isinstance(cache, np.ndarray):
            cache[blocks, :, offsets] = kv.astype(cache.dtype)
        else:  # a torch tensor: index and copy with torch, on its device
            import torch

            value = to_torch(kv, device=str(cache.device)).to(cache.dtype)
            cache[torch.as_tensor(blocks, device=cache.device), :,
                  torch.as_tensor(offsets, device=cache.device)] = value

    def wait_for_layer_load(self, layer_name: str) -> None:
        event = self._layer_events.get(layer_index(layer_name))
        if event is not None:
            event.wait()
        if self._load_error is not None:
            raise self._load_error

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpoolConnectorMetadata)
        layer = layer_index(layer_name)
        for save in meta.saves:
            stream = self._streams.get(save.req_id)
            if stream is None:
                held = self._saved.get(save.req_id)
                if held is None:  # first chunk: start from the daemon's cached prefix
                    r = self._client.create_sequence(self._model_id,
                                                     self.sequence_id(save.req_id),
                                                     prefix_token_ids=save.token_ids)
                    held = int(r.reused_tokens)
                    self._saved[save.req_id] = held
                if held >= save.stop:
                    continue
                stream = self._client.open_append(
                    self.sequence_id(save.req_id), save.stop - held, token_start=held,
                    dtype=DType.BF16, token_ids=save.token_ids[held:save.stop])
                self._streams[save.req_id] = stream
            start = int(stream.header.token_start)
            slots = slot_mapping(save.block_ids, self._block_size, start, save.stop)
            blocks, offsets = slots // self._block_size, slots % self._block_size
            if isinstance(kv_layer, np.ndarray):
                rows = kv_layer[blocks, :, offsets]
            else:
                import torch

                rows = kv_layer[torch.as_tensor(blocks, device=kv_layer.device), :,
                                torch.as_tensor(offsets, device=kv_layer.device)]
            rows = as_numpy(rows)
            d = rows.shape[-1] // 2
            stream.write_layer(layer, rows[..., :d], rows[..., d:])

    def wait_for_save(self) -> None:
        streams, self._streams = self._streams, {}
        for req_id, stream in streams.items():
            r = stream.finish()
            self._saved[req_id] = int(r.sequence.total_tokens)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]],
                                                               Optional[Set[str]]]:
        """Loads and saves complete within the step: nothing is pending."""
        for req_id in finished_req_ids:
            self._saved.pop(req_id, None)
        return None, None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        failed, self._failed_loads = self._failed_loads, set()
        return failed
