"""Client: one method per kvpool.v1 RPC, numpy arrays in and out.

    from kvpool import Client, DType

    with Client("127.0.0.1:50051") as c:
        c.register_model("smollm2", q_heads=9, kv_heads=3, rotation_file="smollm2.safetensors")
        c.create_sequence("smollm2", "req-1")
        with c.open_append("req-1", num_tokens=T, dtype=DType.BF16, end_of_prefill=True) as s:
            for layer in range(30):                 # as each layer is computed
                s.write_layer(layer, k[layer], v[layer])
        r = c.attend("smollm2", layer=0, queries={"req-1": q})   # q [Hq, D] or [n, Hq, D]
        r["req-1"].out, r["req-1"].lse

Errors are KvpoolError (kvpool.errors) with the gRPC code, the RPC name and, when the daemon
sent one, the reason. The generated stubs and messages are kvpool.v1.*_pb2(_grpc); every method
that takes a message also accepts the message itself, and `client.models`, `.sequences`,
`.reads`, `.attention`, `.stats`, `.admin` are the raw stubs.

Thread-safety: a Client may be shared by threads (gRPC channels are thread-safe); an
AppendStream belongs to one thread.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from kvpool._stubs import ServiceStub
from kvpool.errors import KvpoolError
from kvpool.options import ClientOptions
from kvpool.stream import AppendStream
from kvpool.tensors import DType, as_numpy, from_bytes, natural_dtype, to_bytes
from kvpool.v1 import admin_service_pb2 as admin_pb2
from kvpool.v1 import attention_service_pb2 as attention_pb2
from kvpool.v1 import common_pb2
from kvpool.v1 import model_service_pb2 as model_pb2
from kvpool.v1 import read_service_pb2 as read_pb2
from kvpool.v1 import sequence_service_pb2 as sequence_pb2
from kvpool.v1 import stats_service_pb2 as stats_pb2

ArrayLike = Any  # numpy array, torch tensor, or anything numpy accepts

_ROTATION_KINDS = {
    "identity": common_pb2.ROTATION_KIND_IDENTITY,
    "hadamard": common_pb2.ROTATION_KIND_HADAMARD,
    "randomized_hadamard": common_pb2.ROTATION_KIND_RANDOMIZED_HADAMARD,
}
_QUANT_METHODS = {
    "uniform": common_pb2.QUANT_METHOD_UNIFORM,
    "lloyd_max": common_pb2.QUANT_METHOD_LLOYD_MAX,
    "bypass": common_pb2.QUANT_METHOD_BYPASS,
}
_SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


# -- answers gathered from streams -------------------------------------------------------------


@dataclasses.dataclass
class ModelDescription:
    """DescribeModel: the model and, when asked for, its effective rotation per layer as
    float32 [D, D] matrices applied to row vectors (x_rot = x @ M)."""

    info: model_pb2.ModelInfo
    k_rotation: List[np.ndarray] = dataclasses.field(default_factory=list)
    v_rotation: List[np.ndarray] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KvRead:
    """ReadKv: K and V [layers, tokens, kv_heads, head_dim] in the engine's basis."""

    header: read_pb2.ReadKvHeader
    layers: List[int]
    k: np.ndarray
    v: np.ndarray


@dataclasses.dataclass
class LayerBlocks:
    """ReadBlocks, one layer, rotated basis: BF16 sink and recent rows (uint16 bit patterns or
    ml_dtypes.bfloat16, [tokens, kv_heads, head_dim]) and the INT2 history blocks as stored."""

    layer: int
    blocks: List[read_pb2.KvBlock]
    sink_k: np.ndarray
    sink_v: np.ndarray
    recent_k: np.ndarray
    recent_v: np.ndarray


@dataclasses.dataclass
class BlocksRead:
    header: read_pb2.ReadBlocksHeader
    layers: List[LayerBlocks]


@dataclasses.dataclass
class Attention:
    """One sequence's remote attention: out float32 [num_queries, q_heads, head_dim] in the
    engine's basis, lse float32 [num_queries, q_heads] (natural log), tokens attended."""

    sequence_id: str
    out: np.ndarray
    lse: np.ndarray
    attended_tokens: int


# -- health (grpc.health.v1), encoded by hand: two one-field messages ---------------------------


def _encode_health_request(service: str) -> bytes:
    data = service.encode()
    if not data:
        return b""
    size, out = len(data), bytearray(b"\x0a")
    while True:
        out.append((size & 0x7F) | (0x80 if size > 0x7F else 0))
        size >>= 7
        if not size:
            break
    return bytes(out) + data


def _decode_health_response(data: bytes) -> int:
    # HealthCheckResponse { ServingStatus status = 1; } : a single varint field, if present.
    if len(data) >= 2 and data[0] == 0x08:
        return data[1] & 0x7F
    return 0


class Client:
    """A connection to kvpoold. Does not contact the daemon until the first call."""

    def __init__(self, target: str, options: Optional[ClientOptions] = None) -> None:
        if not target:
            raise KvpoolError.invalid_argument("empty target")
        self.target = target
        self.options = options or ClientOptions()
        args: List[Tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self.options.max_receive_message_bytes),
            ("grpc.max_send_message_length", -1),
        ]
        tls = self.options.tls
        if tls is not None and tls.server_name_override:
            args.append(("grpc.ssl_target_name_override", tls.server_name_override))
        args.extend(self.options.channel_args)
        if tls is not None:
            self.channel = grpc.secure_channel(target, tls.credentials(), options=args)
        else:
            self.channel = grpc.insecure_channel(target, options=args)
        self.secure = tls is not None
        def stub(module: Any, name: str) -> Any:
            return ServiceStub(self.channel, module.DESCRIPTOR.services_by_name[name])

        self.models = stub(model_pb2, "ModelService")
        self.sequences = stub(sequence_pb2, "SequenceService")
        self.reads = stub(read_pb2, "ReadService")
        self.attention = stub(attention_pb2, "AttentionService")
        self.stats = stub(stats_pb2, "StatsService")
        self.admin = stub(admin_pb2, "AdminService")
        self._health = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response)
        self.chunk_bytes = self.options.chunk_bytes

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- call plumbing --------------------------------------------------------------------------

    def with_call_metadata(self, metadata: Sequence[Tuple[str, str]]) -> "Client":
        """A view of this client (same channel) that also sends `metadata` with every call;
        as the C++ KvpoolClient::WithCallMetadata. Close the original, not the view."""
        view = copy.copy(self)
        view.options = dataclasses.replace(
            self.options, metadata=tuple(self.options.metadata) + tuple(metadata))
        return view

    def call_kwargs(self) -> Dict[str, Any]:
        """timeout, metadata and wait_for_ready of one call (for the raw stubs too)."""
        return {"timeout": self.options.deadline_s, "metadata": self.options.call_metadata(),
                "wait_for_ready": self.options.wait_for_ready}

    def _call(self, rpc: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn(*args, **call_kwargs) with the retry policy; raises KvpoolError."""
        policy = self.options.retry
        attempt = 1
        while True:
            try:
                return fn(*args, **self.call_kwargs())
            except grpc.RpcError as e:
                err = KvpoolError.from_rpc_error(e, rpc)
            # A draining daemon never serves again: retrying it is pointless (another may).
            if (attempt >= policy.max_attempts or err.code not in policy.codes
                    or err.reason == "DRAINING"):
                raise err
            attempt += 1
            time.sleep(policy.backoff(attempt))

    # -- health ---------------------------------------------------------------------------------

    def health(self, service: str = "") -> str:
        """The serving status of `service` ("" = the whole daemon): "SERVING", ..."""
        return _SERVING_STATUS.get(self._call("Health", self._health, service), "UNKNOWN")

    def health_probe(self, timeout_s: float) -> str:
        """One health call that does not wait for the connection: a refused connection fails
        at once, an unanswered one after timeout_s (KvpoolError UNAVAILABLE or
        DEADLINE_EXCEEDED); no retries."""
        try:
            status = self._health("", timeout=timeout_s, metadata=self.options.call_metadata(),
                                   wait_for_ready=False)
        except grpc.RpcError as e:
            raise KvpoolError.from_rpc_error(e, "Health") from None
        return _SERVING_STATUS.get(status, "UNKNOWN")

    def wait_for_serving(self, timeout_s: float = 60.0) -> None:
        """Polls health until SERVING; KvpoolError DEADLINE_EXCEEDED after timeout_s."""
        give_up = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            try:
                status = self._health("", timeout=min(5.0, timeout_s),
                                      metadata=self.options.call_metadata())
                if status == 1:
                    return
                last = _SERVING_STATUS.get(status, "UNKNOWN")
            except grpc.RpcError as e:
                last = str(KvpoolError.from_rpc_error(e, "Health"))
            if time.monotonic() > give_up:
                raise KvpoolError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"{self.target} not SERVING after {timeout_s} s: {last}",
                                  "Health")
            time.sleep(0.05)

    def fit_to_server_limits(self) -> stats_pb2.ServerLimits:
        """Lowers chunk_bytes so that every AppendKv message fits the daemon's limits (k and v
        each at most max_chunk_bytes, the message well under max_message_bytes)."""
        limits = self.get_stats().limits
        fit = self.chunk_bytes
        if limits.max_chunk_bytes:
            fit = min(fit, 2 * int(limits.max_chunk_bytes))
        if limits.max_message_bytes:
            fit = min(fit, int(limits.max_message_bytes) // 2)
        self.chunk_bytes = max(1, fit)
        return limits

    # -- ModelService ---------------------------------------------------------------------------

    def register_model(self, model_id: str = "", *, q_heads: int = 0, kv_heads: int = 0,
                       num_layers: int = 0, head_dim: int = 0,
                       rotation_file: Union[str, os.PathLike, bytes, None] = None,
                       server_path: Optional[str] = None,
                       data_free: Optional[str] = None, seed: int = 0,
                       quant: Optional[Mapping[str, Any]] = None, v_prerotated: bool = False,
                       expected_codec_version: str = "",
                       spec: Optional[model_pb2.ModelSpec] = None
                       ) -> model_pb2.RegisterModelResponse:
        """Registers a model. Exactly one rotation source: `rotation_file` (a path or the
        file's bytes, uploaded in chunks), `server_path` (inside the daemon's --model_dir) or
        `data_free` ("identity", "hadamard", "randomized_hadamard" with `seed`; then `quant`
        may set QuantConfig fields, e.g. {"clip_ratio_k": 0.83, "method": "bypass"}).
        A prepared ModelSpec may be passed as `spec` instead."""
        if spec is None:
            spec = model_pb2.ModelSpec(
                model_id=model_id, expected_codec_version=expected_codec_version,
                shape=common_pb2.ModelShape(num_layers=num_layers, q_heads=q_heads,
                                            kv_heads=kv_heads, head_dim=head_dim))
            sources = sum(x is not None for x in (rotation_file, server_path, data_free))
            if sources != 1:
                raise KvpoolError.invalid_argument(
                    "give exactly one of rotation_file, server_path, data_free", "RegisterModel")
            if server_path is not None:
                spec.server_path = server_path
            elif data_free is not None:
                if data_free not in _ROTATION_KINDS:
                    raise KvpoolError.invalid_argument(
                        f"data_free must be one of {sorted(_ROTATION_KINDS)}", "RegisterModel")
                spec.data_free.kind = _ROTATION_KINDS[data_free]
                spec.data_free.seed = seed
                spec.v_prerotated = v_prerotated
                for key, value in (quant or {}).items():
                    if key == "method":
                        value = _QUANT_METHODS[value] if isinstance(value, str) else value
                    setattr(spec.quant, key, value)
        payload = b""
        if rotation_file is not None:
            if isinstance(rotation_file, (bytes, bytearray, memoryview)):
                payload = bytes(rotation_file)
            else:
                with open(rotation_file, "rb") as f:
                    payload = f.read()
            spec.upload_size = len(payload)
        piece = max(1, self.chunk_bytes // 2)

        def messages() -> Iterable[model_pb2.RegisterModelRequest]:
            yield model_pb2.RegisterModelRequest(spec=spec)
            for start in range(0, len(payload), piece):
                yield model_pb2.RegisterModelRequest(
                    rotation_file_chunk=payload[start:start + piece])

        return self._call("RegisterModel", lambda **kw: self.models.RegisterModel(messages(),
                                                                                   **kw))

    def list_models(self) -> List[model_pb2.ModelInfo]:
        return list(self._call("ListModels", self.models.ListModels,
                               model_pb2.ListModelsRequest()).models)

    def describe_model(self, model_id: str, include_rotation: bool = False) -> ModelDescription:
        request = model_pb2.DescribeModelRequest(model_id=model_id,
                                                 include_rotation=include_rotation)

        def gather(**kw: Any) -> ModelDescription:
            desc: Optional[ModelDescription] = None
            for part in self.models.DescribeModel(request, **kw):
                if part.HasField("model"):
                    desc = ModelDescription(info=part.model)
                elif desc is not None and part.HasField("rotation"):
                    d = desc.info.shape.head_dim
                    desc.k_rotation.append(from_bytes(part.rotation.k_matrix, DType.FP32, (d, d)))
                    desc.v_rotation.append(from_bytes(part.rotation.v_matrix, DType.FP32, (d, d)))
            if desc is None:
                raise KvpoolError(grpc.StatusCode.DATA_LOSS, "no ModelInfo in the stream",
                                  "DescribeModel")
            return desc

        return self._call("DescribeModel", gather)

    def delete_model(self, model_id: str, force: bool = False) -> model_pb2.DeleteModelResponse:
        return self._call("DeleteModel", self.models.DeleteModel,
                          model_pb2.DeleteModelRequest(model_id=model_id, force=force))

    # -- SequenceService ------------------------------------------------------------------------

    def create_sequence(self, model_id: str, sequence_id: str = "",
                        prefix_token_ids: Optional[Sequence[int]] = None
                        ) -> sequence_pb2.CreateSequenceResponse:
        """An empty sequence (the daemon picks the id when none is given); with
        `prefix_token_ids` it starts from the longest cached prefix (`reused_tokens`)."""
        request = sequence_pb2.CreateSequenceRequest(
            model_id=model_id, sequence_id=sequence_id,
            prefix_token_ids=[int(t) for t in (prefix_token_ids or ())])
        return self._call("CreateSequence", self.sequences.CreateSequence, request)

    def open_append(self, sequence_id: str, num_tokens: int, *, token_start: int = 0,
                    dtype: DType = DType.BF16, token_ids: Optional[Sequence[int]] = None,
                    end_of_prefill: bool = False) -> AppendStream:
        """A layer-wise push: an AppendKv stream with its header sent. Write each layer with
        AppendStream.write_layer as soon as it is computed, then finish() (or use it as a
        context manager, which finishes on success and cancels on an exception)."""
        header = sequence_pb2.AppendKvHeader(
            sequence_id=sequence_id, token_start=token_start, num_tokens=num_tokens,
            dtype=int(dtype), token_ids=[int(t) for t in (token_ids or ())],
            end_of_prefill=end_of_prefill)
        return AppendStream(self, header)

    def append_kv(self, sequence_id: str, k: ArrayLike, v: ArrayLike, *, token_start: int = 0,
                  dtype: Optional[DType] = None, token_ids: Optional[Sequence[int]] = None,
                  end_of_prefill: bool = False) -> sequence_pb2.AppendKvResponse:
        """One whole append of k, v [layers, tokens, kv_heads, head_dim] (every layer)."""
        k, v = as_numpy(k), as_numpy(v)
        if k.ndim != 4 or k.shape != v.shape:
            raise KvpoolError.invalid_argument(
                f"k and v must both be [layers, tokens, kv_heads, head_dim]; got {k.shape} and "
                f"{v.shape}", "AppendKv")
        dtype = DType(dtype) if dtype is not None else natural_dtype(k)
        with self.open_append(sequence_id, k.shape[1], token_start=token_start, dtype=dtype,
                              token_ids=token_ids, end_of_prefill=end_of_prefill) as stream:
            for layer in range(k.shape[0]):
                stream.write_layer(layer, k[layer], v[layer])
        assert stream.response is not None
        return stream.response

    def append_decode(self, sequence_id: str, k: ArrayLike, v: ArrayLike, *, token_start: int,
                      dtype: Optional[DType] = None,
                      token_ids: Optional[Sequence[int]] = None
                      ) -> sequence_pb2.AppendDecodeResponse:
        """Appends decode tokens of every layer: k, v [layers, tokens, kv_heads, head_dim], or
        [layers, kv_heads, head_dim] for one token. `token_start` is the sequence's length."""
        k, v = as_numpy(k), as_numpy(v)
        if k.ndim == 3:
            k, v = k[:, None], v[:, None]
        if k.ndim != 4 or k.shape != v.shape:
            raise KvpoolError.invalid_argument(
                f"k and v must both be [layers, tokens, kv_heads, head_dim]; got {k.shape} and "
                f"{v.shape}", "AppendDecode")
        dtype = DType(dtype) if dtype is not None else natural_dtype(k)
        request = sequence_pb2.AppendDecodeRequest(
            sequence_id=sequence_id, token_start=token_start, num_tokens=k.shape[1],
            dtype=int(dtype), k=to_bytes(k, dtype), v=to_bytes(v, dtype),
            token_ids=[int(t) for t in (token_ids or ())])
        return self._call("AppendDecode", self.sequences.AppendDecode, request)

    def seal_sequence(self, sequence_id: str) -> sequence_pb2.SequenceInfo:
        return self._call("SealSequence", self.sequences.SealSequence,
                          sequence_pb2.SealSequenceRequest(sequence_id=sequence_id)).sequence

    def release_sequence(self, sequence_id: str) -> sequence_pb2.ReleaseSequenceResponse:
        return self._call("ReleaseSequence", self.sequences.ReleaseSequence,
                          sequence_pb2.ReleaseSequenceRequest(sequence_id=sequence_id))

    def describe_sequence(self, sequence_id: str) -> sequence_pb2.SequenceInfo:
        return self._call("DescribeSequence", self.sequences.DescribeSequence,
                          sequence_pb2.DescribeSequenceRequest(sequence_id=sequence_id))

    def lookup_prefix(self, model_id: str, token_ids: Sequence[int]
                      ) -> sequence_pb2.LookupPrefixResponse:
        return self._call("LookupPrefix", self.sequences.LookupPrefix,
                          sequence_pb2.LookupPrefixRequest(
                              model_id=model_id, token_ids=[int(t) for t in token_ids]))

    # -- ReadService ----------------------------------------------------------------------------

    def read_kv(self, sequence_id: str, layers: Optional[Sequence[int]] = None,
                token_start: int = 0, num_tokens: int = 0, dtype: DType = DType.BF16,
                bf16_as: str = "auto") -> KvRead:
        """Dequantized K and V [layers, tokens, kv_heads, head_dim] in the engine's basis
        (num_tokens 0 = to the end). BF16 comes back as ml_dtypes.bfloat16 (or uint16, see
        tensors.from_bytes), FP32 as float32."""
        request = read_pb2.ReadKvRequest(sequence_id=sequence_id, layers=list(layers or ()),
                                         token_start=token_start, num_tokens=num_tokens,
                                         dtype=int(dtype))

        def gather(**kw: Any) -> KvRead:
            header = None
            k_parts: Dict[int, List[bytes]] = {}
            v_parts: Dict[int, List[bytes]] = {}
            for part in self.reads.ReadKv(request, **kw):
                if part.HasField("header"):
                    header = part.header
                elif part.HasField("rows"):
                    k_parts.setdefault(part.rows.layer, []).append(part.rows.k)
                    v_parts.setdefault(part.rows.layer, []).append(part.rows.v)
            if header is None:
                raise KvpoolError(grpc.StatusCode.DATA_LOSS, "no header in the stream", "ReadKv")
            shape = (len(header.layers), header.num_tokens, header.shape.kv_heads,
                     header.shape.head_dim)
            wire = DType(header.dtype)
            k_all = b"".join(b"".join(k_parts.get(layer, [])) for layer in header.layers)
            v_all = b"".join(b"".join(v_parts.get(layer, [])) for layer in header.layers)
            try:
                k_arr = from_bytes(k_all, wire, shape, bf16_as)
                v_arr = from_bytes(v_all, wire, shape, bf16_as)
            except ValueError as e:
                raise KvpoolError(grpc.StatusCode.DATA_LOSS, str(e), "ReadKv") from None
            return KvRead(header, list(header.layers), k_arr, v_arr)

        return self._call("ReadKv", gather)

    def read_blocks(self, sequence_id: str, layers: Optional[Sequence[int]] = None,
                    bf16_as: str = "auto") -> BlocksRead:
        """Attention-ready storage as stored (rotated basis), gathered per layer."""
        request = read_pb2.ReadBlocksRequest(sequence_id=sequence_id, layers=list(layers or ()))

        def gather(**kw: Any) -> BlocksRead:
            header = None
            per_layer: Dict[int, Dict[str, Any]] = {}
            for part in self.reads.ReadBlocks(request, **kw):
                if part.HasField("header"):
                    header = part.header
                    for layer in header.layers:
                        per_layer[layer] = {"blocks": [], "sink_k": [], "sink_v": [],
                                            "recent_k": [], "recent_v": []}
                elif header is None:
                    raise KvpoolError(grpc.StatusCode.DATA_LOSS, "data before the header",
                                      "ReadBlocks")
                elif part.HasField("blocks"):
                    for block in part.blocks.blocks:
                        per_layer[block.layer]["blocks"].append(block)
                elif part.HasField("rows"):
                    tier = "sink" if part.rows.tier == read_pb2.BF16_TIER_SINK else "recent"
                    per_layer[part.rows.layer][tier + "_k"].append(part.rows.k)
                    per_layer[part.rows.layer][tier + "_v"].append(part.rows.v)
            if header is None:
                raise KvpoolError(grpc.StatusCode.DATA_LOSS, "no header in the stream",
                                  "ReadBlocks")
            lay = header.block_layout

            def rows(parts: List[bytes], tokens: int) -> np.ndarray:
                return from_bytes(b"".join(parts), DType.BF16,
                                  (tokens, lay.kv_heads, lay.head_dim), bf16_as)

            out = []
            for layer in header.layers:
                p = per_layer[layer]
                out.append(LayerBlocks(
                    layer, sorted(p["blocks"], key=lambda b: b.block_index),
                    rows(p["sink_k"], header.sink_tokens), rows(p["sink_v"], header.sink_tokens),
                    rows(p["recent_k"], header.recent_tokens),
                    rows(p["recent_v"], header.recent_tokens)))
            return BlocksRead(header, out)

        return self._call("ReadBlocks", gather)

    # -- AttentionService -----------------------------------------------------------------------

    def attend(self, model_id: str, layer: int,
               queries: Union[Mapping[str, ArrayLike], Sequence[Tuple[str, ArrayLike]]],
               dtype: DType = DType.FP32) -> Dict[str, Attention]:
        """Remote decode attention of one layer for a batch of sequences.

        queries: sequence id -> q of [q_heads, head_dim] or [num_queries, q_heads, head_dim]
        (unrotated, the engine's basis). Returns sequence id -> Attention, with out shaped
        [num_queries, q_heads, head_dim] and lse [num_queries, q_heads]."""
        items = list(queries.items()) if isinstance(queries, Mapping) else list(queries)
        return {a.sequence_id: a for a in self.attend_in_order(model_id, layer, items, dtype)}

    def attend_in_order(self, model_id: str, layer: int,
                        queries: Sequence[Tuple[str, ArrayLike]],
                        dtype: DType = DType.FP32) -> List[Attention]:
        """As attend, one Attention per (sequence id, q) pair in the order given."""
        request = attention_pb2.AttendRequest(model_id=model_id, layer=layer, dtype=int(dtype))
        shapes = []
        for sequence_id, q in queries:
            q = as_numpy(q)
            if q.ndim == 2:
                q = q[None]
            if q.ndim != 3:
                raise KvpoolError.invalid_argument(
                    f"query of {sequence_id!r} must be [q_heads, head_dim] or "
                    f"[num_queries, q_heads, head_dim]; got {q.shape}", "Attend")
            shapes.append(q.shape)
            request.queries.add(sequence_id=sequence_id, num_queries=q.shape[0],
                                q=to_bytes(q, DType(dtype)))
        response = self._call("Attend", self.attention.Attend, request)
        if len(response.results) != len(shapes):
            raise KvpoolError(grpc.StatusCode.DATA_LOSS,
                              "the daemon answered a different number of results", "Attend")
        out: List[Attention] = []
        for shape, result in zip(shapes, response.results):
            n, hq, d = shape
            out.append(Attention(
                result.sequence_id, from_bytes(result.out, DType.FP32, (n, hq, d)),
                np.asarray(result.lse, dtype=np.float32).reshape(n, hq),
                int(result.attended_tokens)))
        return out

    # -- StatsService ---------------------------------------------------------------------------

    def get_stats(self, include_sequences: bool = False) -> stats_pb2.GetStatsResponse:
        return self._call("GetStats", self.stats.GetStats,
                          stats_pb2.GetStatsRequest(include_sequences=include_sequences))

    # -- AdminService (admin role) -------------------------------------------------------------

    def drain(self) -> admin_pb2.DrainResponse:
        """Begins the daemon's drain, as SIGTERM does: health NOT_SERVING, new sequences and
        appends refused (UNAVAILABLE, reason DRAINING), exit once the calls in flight end.
        `.started` is False when a drain was already under way."""
        return self._call("Drain", self.admin.Drain, admin_pb2.DrainRequest())

    def reload_tenants(self) -> int:
        """Re-reads the daemon's tenants file, as SIGHUP does; the number of tenants in force."""
        return self._call("ReloadTenants", self.admin.ReloadTenants,
                          admin_pb2.ReloadTenantsRequest()).tenants
