"""RoutingClient: one client over many kvpoold (docs/scale-out.md), as the C++
kvpool::client::RoutingClient (client/routing_client.h).

The target names the daemons (a static list, or dns:///NAME:PORT resolved to every address);
each sequence goes to its owner by weighted rendezvous hashing of its placement key
(kvpool.placement), which the client remembers per sequence from create_sequence on. Every
routed call carries the client's membership epoch and the key; a WRONG_OWNER answer makes the
client refresh its membership and retry once. A dead or unreachable daemon fails the call fast
with UNAVAILABLE (the engine re-prefills) and drops out of the membership at the refresh that
follows. attend over sequences on several daemons is fanned out in parallel and merged in the
caller's order, one Attention or KvpoolError per query.

    with RoutingClient("dns:///kvpool-headless:50051") as pool:
        pool.for_each_member(lambda c: c.register_model("m", ..., data_free="hadamard"))
        pool.create_sequence("m", "req-1", prefix_token_ids=prompt)
        pool.append_kv("req-1", k, v, end_of_prefill=True)
        results = pool.attend("m", 0, [("req-1", q1), ("req-2", q2)])

Thread-safe.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import (Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, TypeVar,
                    Union)

import grpc

from kvpool.client import Attention, Client
from kvpool.errors import KvpoolError
from kvpool.membership import MEMBER_CHANNEL_ARGS, MemberProber, Membership, parse_target
from kvpool.options import ClientOptions
from kvpool.placement import placement_key_of_sequence, placement_key_of_tokens
from kvpool.tensors import DType

# Call metadata a routing client sends with every sequence-scoped call, and the ErrorInfo
# reason and metadata of a redirect (proto/member_probe.h).
EPOCH_METADATA = "kvpool-epoch"
PLACEMENT_KEY_METADATA = "kvpool-placement-key"
WRONG_OWNER = "WRONG_OWNER"

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RoutingOptions:
    """How a RoutingClient places sequences and watches the membership."""

    client: ClientOptions = ClientOptions()  # options of each daemon's client
    # The tenant name in placement keys; clients of one tenant must agree on it.
    tenant: str = "default"
    # Tokens of prefix_token_ids that make the key when no first block is given (the model's
    # first prefix unit: the sink, 64 tokens by default).
    placement_prefix_tokens: int = 64
    # How long a call waits for a connection to its daemon before failing with UNAVAILABLE.
    connect_timeout_s: float = 2.0
    # Membership refresh period (also refreshed on WRONG_OWNER and UNAVAILABLE).
    refresh_interval_s: float = 5.0
    probe_timeout_s: float = 1.0


class RoutingClient:
    """Connects to `target`: parses it, probes the members once and starts the periodic
    refresh. KvpoolError INVALID_ARGUMENT for a malformed target, UNAVAILABLE when no member
    answers."""

    def __init__(self, target: str, options: Optional[RoutingOptions] = None) -> None:
        self.target = target
        self.options = options or RoutingOptions()
        self._prober = MemberProber(parse_target(target), default_weight=1,
                                    probe_timeout_s=self.options.probe_timeout_s)
        self._lock = threading.Lock()
        self._membership = Membership([])
        self._clients: Dict[str, Client] = {}
        self._placements: Dict[str, bytes] = {}
        self._reachable: Set[str] = set()
        self._redirects = 0
        self._stop = threading.Event()
        self._refresher: Optional[threading.Thread] = None
        try:
            self.refresh()
            if not len(self.membership):
                raise KvpoolError(grpc.StatusCode.UNAVAILABLE,
                                  f"no daemon of {target!r} answers")
        except BaseException:
            self.close()
            raise
        self._refresher = threading.Thread(target=self._refresh_loop, name="kvpool-membership",
                                           daemon=True)
        self._refresher.start()

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        if self._refresher is not None and self._refresher is not threading.current_thread():
            self._refresher.join()
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
        self._prober.close()

    def __enter__(self) -> "RoutingClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- membership -----------------------------------------------------------------------------

    def refresh(self) -> Membership:
        """Resolves and probes the target now; KvpoolError UNAVAILABLE when it does not
        resolve (the last membership stays)."""
        live = self._prober.probe()
        with self._lock:
            self._membership = live
        return live

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.options.refresh_interval_s):
            try:
                self.refresh()
            except KvpoolError:
                pass  # a failed refresh keeps the last membership

    @property
    def membership(self) -> Membership:
        with self._lock:
            return self._membership

    @property
    def redirects(self) -> int:
        """Calls answered WRONG_OWNER and retried, since the start."""
        with self._lock:
            return self._redirects

    def client_for(self, endpoint: str) -> Client:
        """The client of one member (cached; connects on first use)."""
        with self._lock:
            client = self._clients.get(endpoint)
            if client is None:
                opts = self.options.client
                client = Client(endpoint, dataclasses.replace(
                    opts, channel_args=tuple(MEMBER_CHANNEL_ARGS) + tuple(opts.channel_args)))
                self._clients[endpoint] = client
            return client

    def _connected(self, endpoint: str, rpc: str) -> Client:
        """The client of `endpoint` once it answered: the first call to a daemon, and the
        first after a failure, asks its health first (no wait for ready, connect_timeout_s),
        so a dead daemon fails fast with UNAVAILABLE instead of holding the call."""
        client = self.client_for(endpoint)
        with self._lock:
            if endpoint in self._reachable:
                return client
        try:
            client.health_probe(self.options.connect_timeout_s)
        except KvpoolError as e:
            if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise KvpoolError(grpc.StatusCode.UNAVAILABLE,
                                  f"daemon {endpoint} is unreachable (its sequences are lost: "
                                  f"re-prefill): {e.message}", rpc) from None
            # Any other answer came from the daemon: it is reachable.
        with self._lock:
            self._reachable.add(endpoint)
        return client

    def _failed(self, endpoint: str, error: KvpoolError) -> None:
        """After a call to `endpoint` failed: an unreachable daemon is probed again before the
        next call and the membership is refreshed (a dead daemon leaves it)."""
        if error.code == grpc.StatusCode.UNAVAILABLE:
            with self._lock:
                self._reachable.discard(endpoint)
            self._try_refresh()

    def for_each_member(self, call: Callable[[Client], Any]) -> List[Any]:
        """Runs `call` on every member in turn (model registration: every daemon serves every
        model); the first error stops it. Returns the answers in member order."""
        return [call(self._connected(e, "")) for e in self.membership.endpoints]

    # -- placement ------------------------------------------------------------------------------

    def key_of_tokens(self, model_id: str, first_block_tokens: Sequence[int]) -> bytes:
        return placement_key_of_tokens(self.options.tenant, model_id,
                                       [int(t) for t in first_block_tokens])

    def key_of_sequence(self, model_id: str, sequence_id: str) -> bytes:
        return placement_key_of_sequence(self.options.tenant, model_id, sequence_id)

    def place(self, sequence_id: str, key: bytes) -> None:
        """Remembers where `sequence_id` lives (for sequences this client did not create)."""
        with self._lock:
            self._placements[sequence_id] = bytes(key)

    def _key_of(self, sequence_id: str, rpc: str) -> bytes:
        with self._lock:
            key = self._placements.get(sequence_id)
        if key is None:
            raise KvpoolError(grpc.StatusCode.NOT_FOUND,
                              f"sequence {sequence_id!r} was not placed by this client "
                              "(create_sequence or place first)", rpc)
        return key

    def owner_of(self, sequence_id: str) -> str:
        """The owner of `sequence_id` under the current membership."""
        key = self._key_of(sequence_id, "")
        members = self.membership
        if not len(members):
            raise KvpoolError(grpc.StatusCode.UNAVAILABLE, "no live daemon")
        return members.owner_of(key)

    def _try_refresh(self) -> None:
        try:
            self.refresh()
        except KvpoolError:
            pass

    def _routed(self, rpc: str, key: bytes, call: Callable[[Client], T]) -> T:
        for attempt in range(2):
            members = self.membership
            if not len(members):
                self._try_refresh()
                members = self.membership
                if not len(members):
                    raise KvpoolError(grpc.StatusCode.UNAVAILABLE, "no live daemon", rpc)
            owner = members.owner_of(key)
            try:
                placed = self._connected(owner, rpc).with_call_metadata(
                    ((EPOCH_METADATA, members.epoch_hex), (PLACEMENT_KEY_METADATA, key.hex())))
                return call(placed)
            except KvpoolError as e:
                if e.reason == WRONG_OWNER and attempt == 0:
                    with self._lock:
                        self._redirects += 1
                    self.refresh()
                    continue
                self._failed(owner, e)
                raise
        raise AssertionError("unreachable")

    # -- routed calls (as Client's, on the sequence's owner) ------------------------------------

    def create_sequence(self, model_id: str, sequence_id: str = "",
                        prefix_token_ids: Optional[Sequence[int]] = None,
                        first_block_tokens: Optional[Sequence[int]] = None) -> Any:
        """Places the sequence by `first_block_tokens`, else by the first
        placement_prefix_tokens of `prefix_token_ids`, else by its id; then creates it on the
        owner (Client.create_sequence)."""
        if first_block_tokens:
            key = self.key_of_tokens(model_id, first_block_tokens)
        elif prefix_token_ids:
            key = self.key_of_tokens(
                model_id, list(prefix_token_ids)[:self.options.placement_prefix_tokens])
        else:
            key = self.key_of_sequence(model_id, sequence_id)
        response = self._routed("CreateSequence", key, lambda c: c.create_sequence(
            model_id, sequence_id, prefix_token_ids))
        self.place(response.sequence.sequence_id, key)
        return response

    def open_append(self, sequence_id: str, num_tokens: int, **kwargs: Any) -> Any:
        """A layer-wise push on the owner (Client.open_append). A stream is not retried: a
        WRONG_OWNER is raised by its writes or finish(), after the membership was refreshed."""
        key = self._key_of(sequence_id, "AppendKv")
        members = self.membership
        if not len(members):
            raise KvpoolError(grpc.StatusCode.UNAVAILABLE, "no live daemon", "AppendKv")
        owner = members.owner_of(key)
        try:
            client = self._connected(owner, "AppendKv")
        except KvpoolError as e:
            self._failed(owner, e)
            raise
        placed = client.with_call_metadata(
            ((EPOCH_METADATA, members.epoch_hex), (PLACEMENT_KEY_METADATA, key.hex())))
        return placed.open_append(sequence_id, num_tokens, **kwargs)

    def append_kv(self, sequence_id: str, k: Any, v: Any, **kwargs: Any) -> Any:
        return self._routed("AppendKv", self._key_of(sequence_id, "AppendKv"),
                            lambda c: c.append_kv(sequence_id, k, v, **kwargs))

    def append_decode(self, sequence_id: str, k: Any, v: Any, **kwargs: Any) -> Any:
        return self._routed("AppendDecode", self._key_of(sequence_id, "AppendDecode"),
                            lambda c: c.append_decode(sequence_id, k, v, **kwargs))

    def seal_sequence(self, sequence_id: str) -> Any:
        return self._routed("SealSequence", self._key_of(sequence_id, "SealSequence"),
                            lambda c: c.seal_sequence(sequence_id))

    def release_sequence(self, sequence_id: str) -> Any:
        response = self._routed("ReleaseSequence", self._key_of(sequence_id, "ReleaseSequence"),
                                lambda c: c.release_sequence(sequence_id))
        with self._lock:
            self._placements.pop(sequence_id, None)
        return response

    def describe_sequence(self, sequence_id: str) -> Any:
        return self._routed("DescribeSequence", self._key_of(sequence_id, "DescribeSequence"),
                            lambda c: c.describe_sequence(sequence_id))

    def read_kv(self, sequence_id: str, **kwargs: Any) -> Any:
        return self._routed("ReadKv", self._key_of(sequence_id, "ReadKv"),
                            lambda c: c.read_kv(sequence_id, **kwargs))

    def read_blocks(self, sequence_id: str, **kwargs: Any) -> Any:
        return self._routed("ReadBlocks", self._key_of(sequence_id, "ReadBlocks"),
                            lambda c: c.read_blocks(sequence_id, **kwargs))

    def lookup_prefix(self, model_id: str, token_ids: Sequence[int]) -> Any:
        """Asks the owner of the prefix's first block (its first placement_prefix_tokens)."""
        ids = [int(t) for t in token_ids]
        key = self.key_of_tokens(model_id, ids[:self.options.placement_prefix_tokens])
        return self._routed("LookupPrefix", key, lambda c: c.lookup_prefix(model_id, ids))

    def attend(self, model_id: str, layer: int, queries: Sequence[Tuple[str, Any]],
               dtype: DType = DType.FP32) -> List[Union[Attention, KvpoolError]]:
        """Remote attention over sequences on any daemons: one result per (sequence id, q) in
        the order given, the Attention or the KvpoolError of its part (UNAVAILABLE for a dead
        daemon, NOT_FOUND for an unknown sequence, ...). The batch is split by owner and the
        parts run in parallel; a part answered WRONG_OWNER is retried once after a refresh."""
        items = list(queries)
        results: List[Union[Attention, KvpoolError]] = [
            KvpoolError(grpc.StatusCode.INTERNAL, "not attempted", "Attend")] * len(items)
        pending = list(range(len(items)))
        for attempt in range(2):
            if not pending:
                break
            members = self.membership
            groups: Dict[str, List[int]] = {}
            for i in pending:
                try:
                    key = self._key_of(items[i][0], "Attend")
                except KvpoolError as e:
                    results[i] = e
                    continue
                if not len(members):
                    results[i] = KvpoolError(grpc.StatusCode.UNAVAILABLE, "no live daemon",
                                             "Attend")
                    continue
                groups.setdefault(members.owner_of(key), []).append(i)

            def part(endpoint: str, indices: List[int]) -> List[Attention]:
                client = self._connected(endpoint, "Attend").with_call_metadata(
                    ((EPOCH_METADATA, members.epoch_hex),))
                return client.attend_in_order(model_id, layer, [items[i] for i in indices],
                                              dtype)

            retry: List[int] = []
            refresh = False
            if groups:
                with concurrent.futures.ThreadPoolExecutor(max_workers=len(groups)) as pool:
                    futures = {owner: pool.submit(part, owner, idx)
                               for owner, idx in groups.items()}
                    for owner, future in futures.items():
                        idx = groups[owner]
                        try:
                            for i, answer in zip(idx, future.result()):
                                results[i] = answer
                        except KvpoolError as e:
                            for i in idx:
                                results[i] = e
                            wrong_owner = e.reason == WRONG_OWNER
                            if wrong_owner and attempt == 0:
                                retry.extend(idx)
                            if e.code == grpc.StatusCode.UNAVAILABLE:
                                with self._lock:
                                    self._reachable.discard(owner)
                            refresh |= wrong_owner or e.code == grpc.StatusCode.UNAVAILABLE
            if refresh:
                self._try_refresh()
            if retry:
                with self._lock:
                    self._redirects += 1
            pending = sorted(retry)
        return results


__all__ = ["EPOCH_METADATA", "PLACEMENT_KEY_METADATA", "RoutingClient", "RoutingOptions",
           "WRONG_OWNER"]
