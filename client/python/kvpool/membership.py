"""The membership of a scale-out deployment, as the C++ library computes it (docs/scale-out.md;
common/membership_target.h, proto/member_probe.h).

A target names the daemons:

    "10.0.0.1:50051,10.0.0.2:50051"                    a static list (all weights equal)
    "10.0.0.1:50051=8589934592,10.0.0.2:50051=4294967296"   with weights
    "dns:///kvpool-headless.ns.svc:50051"              every IPv4 address of the name

The candidates it resolves to are asked grpc.health.v1 (overall service) in parallel; those that
answer SERVING within the probe timeout are the members.

    target = parse_target("dns:///kvpool-headless:50051")
    live = MemberProber(target, probe_timeout_s=1.0).probe()   # Membership
    live.owner_of(key), live.epoch_hex
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import socket
import string
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import grpc

from kvpool.client import Client
from kvpool.errors import KvpoolError
from kvpool.options import ClientOptions
from kvpool.placement import epoch_of, owner_of

MAX_ENDPOINT_BYTES = 255
MAX_MEMBERS = 4096
_DNS_SCHEME = "dns:///"
_HOST_CHARS = frozenset(string.ascii_letters + string.digits + ".-_")

# Member connections retry often (at most a second apart), so a daemon that comes back or joins
# is seen at the next probe; as the C++ MemberChannelArguments.
MEMBER_CHANNEL_ARGS: Tuple[Tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.use_local_subchannel_pool", 1),
)


@dataclasses.dataclass(frozen=True)
class Target:
    """A static list (entries: endpoint and weight or None) or a DNS name (dns_host, dns_port)."""

    entries: Tuple[Tuple[str, Optional[int]], ...] = ()
    dns_host: str = ""
    dns_port: int = 0

    @property
    def is_dns(self) -> bool:
        return bool(self.dns_host)


def _split_host_port(text: str) -> Tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon or not host:
        raise KvpoolError.invalid_argument(f"membership target: expected host:port, got {text!r}")
    if len(host) > MAX_ENDPOINT_BYTES - 6 or not set(host) <= _HOST_CHARS:
        raise KvpoolError.invalid_argument(f"membership target: bad host in {text!r}")
    if not port.isascii() or not port.isdigit() or len(port) > 5 or not 1 <= int(port) <= 65535:
        raise KvpoolError.invalid_argument(f"membership target: bad port in {text!r}")
    return host, int(port)


def parse_target(text: str) -> Target:
    """Parses a membership target; KvpoolError INVALID_ARGUMENT when malformed (as the C++
    ParseMembershipTarget, but without the DNS-server form: ports 1..65535, positive integer
    weights)."""
    if text.startswith("dns:"):
        if not text.startswith(_DNS_SCHEME):
            raise KvpoolError.invalid_argument(
                f"membership target {text!r}: the Python package takes only dns:///NAME:PORT "
                "(the system resolver); a DNS server (dns://SERVER/NAME:PORT) is taken by the "
                "C++ client, the CLI and the daemon")
        host, port = _split_host_port(text[len(_DNS_SCHEME):])
        return Target(dns_host=host, dns_port=port)
    entries: List[Tuple[str, Optional[int]]] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        endpoint, eq, w = item.partition("=")
        weight = None
        if eq:
            if not w.isascii() or not w.isdigit() or int(w) == 0 or int(w) >= 1 << 64:
                raise KvpoolError.invalid_argument(f"membership target: bad weight in {item!r}")
            weight = int(w)
        host, port = _split_host_port(endpoint)
        entries.append((f"{host}:{port}", weight))
        if len(entries) > MAX_MEMBERS:
            raise KvpoolError.invalid_argument("membership target: too many endpoints")
    if not entries:
        raise KvpoolError.invalid_argument(f"membership target {text!r} names no endpoint")
    return Target(entries=tuple(entries))


def resolve_target(target: Target, default_weight: int = 1) -> List[Tuple[str, int]]:
    """The candidate (endpoint, weight) pairs `target` names now; a DNS name is looked up with
    the system resolver (IPv4). KvpoolError UNAVAILABLE when it does not resolve."""
    if not target.is_dns:
        return [(e, w if w is not None else default_weight) for e, w in target.entries]
    try:
        infos = socket.getaddrinfo(target.dns_host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise KvpoolError(grpc.StatusCode.UNAVAILABLE,
                          f"resolving {target.dns_host!r}: {e}") from None
    addresses = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET})
    return [(f"{ip}:{target.dns_port}", default_weight) for ip in addresses[:MAX_MEMBERS]]


class Membership:
    """The live members (endpoint, weight) and their epoch."""

    def __init__(self, members: Sequence[Tuple[str, int]]) -> None:
        by_endpoint: Dict[str, int] = {}
        for endpoint, weight in members:
            by_endpoint.setdefault(endpoint, int(weight))
        self.members: List[Tuple[str, int]] = sorted(by_endpoint.items(),
                                                     key=lambda m: m[0].encode())
        self.epoch = epoch_of(e for e, _ in self.members)
        self.epoch_hex = self.epoch.hex()

    @property
    def endpoints(self) -> List[str]:
        return [e for e, _ in self.members]

    def __len__(self) -> int:
        return len(self.members)

    def owner_of(self, key: bytes) -> str:
        return owner_of(key, self.members)


class MemberProber:
    """Resolves a target and asks every candidate's health in parallel. Thread-safe."""

    def __init__(self, target: Target, default_weight: int = 1,
                 probe_timeout_s: float = 1.0) -> None:
        self.target = target
        self.default_weight = default_weight
        self.probe_timeout_s = probe_timeout_s
        self._lock = threading.Lock()
        self._clients: Dict[str, Client] = {}

    def _client(self, endpoint: str) -> Client:
        with self._lock:
            client = self._clients.get(endpoint)
            if client is None:
                client = Client(endpoint, ClientOptions(channel_args=MEMBER_CHANNEL_ARGS))
                self._clients[endpoint] = client
            return client

    def _serving(self, endpoint: str) -> bool:
        try:
            # Not wait-for-ready: a refused connection answers at once.
            return self._client(endpoint).health_probe(self.probe_timeout_s) == "SERVING"
        except KvpoolError:
            return False

    def probe(self) -> Membership:
        """The members now (possibly none); KvpoolError UNAVAILABLE when the target does not
        resolve."""
        candidates = resolve_target(self.target, self.default_weight)
        if not candidates:
            return Membership([])
        workers = min(32, len(candidates))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            answers = list(pool.map(self._serving, [e for e, _ in candidates]))
        return Membership([m for m, ok in zip(candidates, answers) if ok])

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


__all__ = ["MEMBER_CHANNEL_ARGS", "MemberProber", "Membership", "Target", "parse_target",
           "resolve_target"]
