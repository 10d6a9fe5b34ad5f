"""KvpoolError: the one exception type of the kvpool package.

Every failed call raises KvpoolError carrying the gRPC status code the daemon answered (or the
one gRPC produced locally: UNAVAILABLE when the daemon cannot be reached, DEADLINE_EXCEEDED past
the deadline), the RPC's name, the message, and, when the daemon attached a
google.rpc.ErrorInfo (domain "kvpool") to the status details, its machine-readable reason and
metadata. Clients branch on `code` and `reason`, never on the message text.

    try:
        client.describe_sequence("req-1")
    except KvpoolError as e:
        if e.code == grpc.StatusCode.NOT_FOUND and e.reason == "EVICTED":
            ...  # recompute the prefill
"""

from __future__ import annotations

from typing import Mapping, Optional

import grpc

# Codes after which the daemon guarantees the request changed nothing and a later attempt may
# succeed (docs/api.md, Errors): the worker queue or pool was full, another append to the same
# sequence was in progress, or the daemon could not be reached. UNAVAILABLE with reason DRAINING
# is retryable on another daemon only: the client does not retry it on the same one.
RETRYABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})

# Call metadata of request ids: sent by the client (ClientOptions.request_id), answered by the
# daemon in the initial metadata of every call and the trailing metadata of a failed one.
REQUEST_ID_KEY = "x-request-id"

_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_ERROR_INFO_TYPE = "type.googleapis.com/google.rpc.ErrorInfo"


class KvpoolError(Exception):
    """A failed kvpool call.

    Attributes:
      code: the grpc.StatusCode (INVALID_ARGUMENT, NOT_FOUND, ...).
      message: the daemon's message (ids quoted, truncated by the daemon).
      rpc: the RPC's name ("AppendKv"), or "" for errors raised before any call.
      reason: google.rpc.ErrorInfo.reason when the daemon sent one ("EVICTED", "QUOTA", ...),
        else None.
      domain: ErrorInfo.domain ("kvpool"), else None.
      metadata: ErrorInfo.metadata (e.g. the owner of a sequence), else empty.
      request_id: the request id the daemon answered for the call (its log lines of the call
        carry it), else None (e.g. when it was not reached).
    """

    def __init__(self, code: grpc.StatusCode, message: str, rpc: str = "",
                 reason: Optional[str] = None, domain: Optional[str] = None,
                 metadata: Optional[Mapping[str, str]] = None,
                 request_id: Optional[str] = None) -> None:
        self.code = code
        self.request_id = request_id
        self.message = message
        self.rpc = rpc
        self.reason = reason
        self.domain = domain
        self.metadata = dict(metadata or {})
        where = f"{rpc}: " if rpc else ""
        why = f" [{reason}]" if reason else ""
        super().__init__(f"{where}{code.name}: {message}{why}")

    @property
    def retryable(self) -> bool:
        """Whether the code is one after which a retry may succeed (RETRYABLE_CODES)."""
        return self.code in RETRYABLE_CODES

    @staticmethod
    def from_rpc_error(error: grpc.RpcError, rpc: str) -> "KvpoolError":
        """Converts what a grpc call raised (a grpc.Call that is also an RpcError)."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        message = error.details() if hasattr(error, "details") else str(error)
        trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        reason = domain = request_id = None
        meta: dict = {}
        for key, value in trailers or ():
            if key == _STATUS_DETAILS_KEY and isinstance(value, bytes):
                info = parse_error_info(value)
                if info is not None:
                    reason, domain, meta = info
            elif key == REQUEST_ID_KEY and isinstance(value, str):
                request_id = value
        if request_id is None and hasattr(error, "initial_metadata"):
            for key, value in error.initial_metadata() or ():
                if key == REQUEST_ID_KEY and isinstance(value, str):
                    request_id = value
        return KvpoolError(code or grpc.StatusCode.UNKNOWN, message or "", rpc, reason, domain,
                           meta, request_id)

    @staticmethod
    def invalid_argument(message: str, rpc: str = "") -> "KvpoolError":
        """An error found on the client side before anything was sent."""
        return KvpoolError(grpc.StatusCode.INVALID_ARGUMENT, message, rpc)


# -- google.rpc.Status / ErrorInfo, decoded from the wire (no googleapis dependency) ----------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _fields(buf: bytes):
    """(field number, wire type, value) of a serialized message; value is int or bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("truncated field")
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield number, wire, value


def parse_error_info(status_bytes: bytes):
    """(reason, domain, metadata) of the first ErrorInfo in a serialized google.rpc.Status,
    or None when there is none or the bytes do not parse (a malformed trailer is ignored)."""
    try:
        for number, wire, value in _fields(status_bytes):
            if number != 3 or wire != 2:  # Status.details (repeated Any)
                continue
            type_url, payload = "", b""
            for n, w, v in _fields(value):
                if n == 1 and w == 2:
                    type_url = v.decode("utf-8", "replace")
                elif n == 2 and w == 2:
                    payload = v
            if type_url != _ERROR_INFO_TYPE:
                continue
            reason, domain, meta = "", "", {}
            for n, w, v in _fields(payload):
                if n == 1 and w == 2:
                    reason = v.decode("utf-8", "replace")
                elif n == 2 and w == 2:
                    domain = v.decode("utf-8", "replace")
                elif n == 3 and w == 2:  # map entry {1: key, 2: value}
                    entry = {en: ev for en, ew, ev in _fields(v) if ew == 2}
                    meta[entry.get(1, b"").decode("utf-8", "replace")] = \
                        entry.get(2, b"").decode("utf-8", "replace")
            return reason, domain, meta
    except (ValueError, UnicodeDecodeError):
        return None
    return None
