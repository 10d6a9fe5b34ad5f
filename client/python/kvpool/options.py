"""Client options: deadlines, chunking, retries, TLS and token credentials.

They mirror client/kvpool_client.h's ClientOptions (deadline, chunk_bytes,
max_receive_message_bytes, wait_for_ready) and add what a deployment needs in front of the
daemon: retries of retryable codes, TLS, and a bearer token sent as call metadata.

kvpoold checks both when it runs with --tenants_file (docs/security.md): the token's SHA-256
must be in the tenants file, or the client certificate's URI SAN kvpool://tenant/NAME (else its
CN) must name a tenant there.
"""

from __future__ import annotations

import dataclasses
from typing import FrozenSet, Optional, Sequence, Tuple

import grpc

from kvpool.errors import REQUEST_ID_KEY, RETRYABLE_CODES


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Retries of calls that failed with a retryable code (errors.RETRYABLE_CODES by default).

    Unary calls and whole reads are retried; a streaming append is not (its data was consumed
    once; the caller re-pushes after `KvpoolError.retryable`). The daemon leaves the pool
    unchanged on every failure, and appends name their `token_start`, so a retried append that
    did succeed the first time fails with FAILED_PRECONDITION instead of appending twice.
    """

    max_attempts: int = 3  # 1 = no retry
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    codes: FrozenSet[grpc.StatusCode] = RETRYABLE_CODES

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt` (1-based; attempt 1 does not wait)."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 2))


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclasses.dataclass(frozen=True)
class TlsOptions:
    """TLS for the channel (grpc.ssl_channel_credentials): PEM bytes. All None uses the
    system's root certificates; private_key + certificate_chain present a client
    certificate (mTLS)."""

    root_certificates: Optional[bytes] = None
    private_key: Optional[bytes] = None
    certificate_chain: Optional[bytes] = None
    # Expected server name when it differs from the target's host (tests, IP targets).
    server_name_override: Optional[str] = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key,
                                            self.certificate_chain)


@dataclasses.dataclass(frozen=True)
class ClientOptions:
    """How a Client talks to kvpoold."""

    # Deadline of every call (streams included) from its start, per attempt.
    deadline_s: float = 300.0
    # Largest K+V payload of one AppendKv message; a rotation-file chunk is half of it.
    # Client.fit_to_server_limits() lowers it to the daemon's limits.
    chunk_bytes: int = 256 << 10
    # Largest message the client accepts.
    max_receive_message_bytes: int = 64 << 20
    # Wait for the channel to connect instead of failing fast with UNAVAILABLE.
    wait_for_ready: bool = False
    retry: RetryPolicy = RetryPolicy()
    # None: a plaintext channel (kvpoold today, loopback by default).
    tls: Optional[TlsOptions] = None
    # Sent as "authorization: Bearer <token>" on every call.
    token: Optional[str] = None
    # Sent as "x-request-id" on every call: the daemon's log lines of the call carry it, and it
    # answers it back (KvpoolError.request_id). Printable ASCII without spaces, at most 128
    # characters (the daemon replaces any other). None: the daemon makes one per call.
    request_id: Optional[str] = None
    # Further call metadata.
    metadata: Tuple[Tuple[str, str], ...] = ()
    # Further channel arguments, e.g. (("grpc.keepalive_time_ms", 10000),).
    channel_args: Sequence[Tuple[str, object]] = ()

    def call_metadata(self) -> Tuple[Tuple[str, str], ...]:
        meta = tuple(self.metadata)
        if self.request_id:
            meta += ((REQUEST_ID_KEY, self.request_id),)
        if self.token:
            meta += (("authorization", f"Bearer {self.token}"),)
        return meta
