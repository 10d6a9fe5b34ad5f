"""AppendStream: a layer-wise push (one AppendKv client stream).

A prefill worker opens one stream per prefill chunk (Client.open_append) and writes each layer
as soon as it is computed; the daemon rotates and quantizes chunks as they arrive and commits
the whole append atomically when the stream finishes. Each layer is split into messages of at
most Client.chunk_bytes of K+V payload.

States: open (write_layer allowed) -> finished (finish() returned, or the call failed: every
later call raises the daemon's error). Leaving a `with` block by an exception, or cancel(),
cancels the call and the daemon rolls the append back.
"""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING, Any, Iterator, Optional

import grpc

from kvpool.errors import KvpoolError
from kvpool.tensors import DType, as_numpy, to_bytes
from kvpool.v1 import sequence_service_pb2 as sequence_pb2

if TYPE_CHECKING:
    from kvpool.client import Client

_END = object()


class AppendStream:
    """Created by Client.open_append with the header already queued. One thread at a time."""

    def __init__(self, client: "Client", header: sequence_pb2.AppendKvHeader,
                 max_queued_messages: int = 16) -> None:
        self.header = header
        self.dtype = DType(header.dtype)
        self.chunk_bytes = client.chunk_bytes
        self.bytes_sent = 0
        self.messages_sent = 0
        self.response: Optional[sequence_pb2.AppendKvResponse] = None
        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=max_queued_messages)
        self._error: Optional[KvpoolError] = None
        self._finished = False
        self._queue.put(sequence_pb2.AppendKvRequest(header=header))
        self._future = client.sequences.AppendKv.future(self._messages(),
                                                        **client.call_kwargs())

    def _messages(self) -> Iterator[sequence_pb2.AppendKvRequest]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            yield item

    def _failure(self) -> KvpoolError:
        """The call's error once it has ended (waits for it)."""
        if self._error is None:
            try:
                self._future.result()
                self._error = KvpoolError(grpc.StatusCode.INTERNAL,
                                          "the daemon answered before the stream ended",
                                          "AppendKv")
            except grpc.RpcError as e:
                self._error = KvpoolError.from_rpc_error(e, "AppendKv")
            except grpc.FutureCancelledError:
                self._error = KvpoolError(grpc.StatusCode.CANCELLED, "append cancelled",
                                          "AppendKv")
        self._finished = True
        try:  # let gRPC's request iterator end
            self._queue.put_nowait(_END)
        except queue.Full:
            pass
        return self._error

    def _put(self, message: Any) -> None:
        while True:
            if self._future.done():
                raise self._failure()
            try:
                self._queue.put(message, timeout=0.05)
                return
            except queue.Full:
                continue

    def write_layer(self, layer: int, k: Any, v: Any, token_offset: int = 0) -> None:
        """Sends K and V of `layer` for header tokens [token_offset, token_offset + n):
        arrays (or tensors) [n, kv_heads, head_dim], converted to the header's dtype. Raises
        KvpoolError: INVALID_ARGUMENT for mismatched shapes (nothing sent), or the daemon's
        error when it has already failed the call."""
        if self._finished:
            raise self._error or KvpoolError(grpc.StatusCode.FAILED_PRECONDITION,
                                             "the stream is finished", "AppendKv")
        k, v = as_numpy(k), as_numpy(v)
        if k.shape != v.shape or k.ndim != 3 or k.shape[0] < 1:
            raise KvpoolError.invalid_argument(
                f"layer {layer}: k and v must both be [tokens, kv_heads, head_dim]; got "
                f"{k.shape} and {v.shape}", "AppendKv")
        n = k.shape[0]
        k_bytes, v_bytes = memoryview(to_bytes(k, self.dtype)), memoryview(to_bytes(v, self.dtype))
        row = len(k_bytes) // n
        per_message = max(1, self.chunk_bytes // (2 * row))
        for start in range(0, n, per_message):
            count = min(per_message, n - start)
            chunk = sequence_pb2.KvChunk(
                layer=layer, token_offset=token_offset + start, num_tokens=count,
                k=bytes(k_bytes[start * row:(start + count) * row]),
                v=bytes(v_bytes[start * row:(start + count) * row]))
            self._put(sequence_pb2.AppendKvRequest(chunk=chunk))
            self.bytes_sent += 2 * count * row
            self.messages_sent += 1

    def finish(self) -> sequence_pb2.AppendKvResponse:
        """Half-closes and waits for the committed append; KvpoolError when it failed."""
        if self.response is not None:
            return self.response
        if self._finished:
            raise self._failure()
        self._finished = True
        self._put(_END)
        try:
            self.response = self._future.result()
        except grpc.RpcError as e:
            self._error = KvpoolError.from_rpc_error(e, "AppendKv")
            raise self._error from None
        except grpc.FutureCancelledError:
            self._error = KvpoolError(grpc.StatusCode.CANCELLED, "append cancelled", "AppendKv")
            raise self._error from None
        return self.response

    def cancel(self) -> None:
        """Cancels the call; the daemon rolls the append back."""
        self._future.cancel()
        self._finished = True
        if self._error is None:
            self._error = KvpoolError(grpc.StatusCode.CANCELLED, "append cancelled", "AppendKv")
        try:  # let the request iterator end
            self._queue.put_nowait(_END)
        except queue.Full:
            pass

    def __enter__(self) -> "AppendStream":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.cancel()
        elif self.response is None:
            self.finish()

    def __del__(self) -> None:
        if getattr(self, "response", 1) is None and not getattr(self, "_finished", True):
            self._future.cancel()
