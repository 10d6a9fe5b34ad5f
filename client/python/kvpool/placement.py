"""Placement of sequences on the daemons of a scale-out deployment (docs/scale-out.md).

The same functions, byte for byte, as the C++ library (common/placement.h): the membership
epoch, the placement key of a sequence and its owner by weighted rendezvous hashing. The fixed
vectors in tests/fixtures/placement_vectors.json hold both implementations to it.

    members = [("10.0.0.1:50051", 1), ("10.0.0.2:50051", 1)]
    key = placement_key_of_tokens("tenant-a", "llama", first_block_token_ids)
    owner_of(key, members)          # -> "10.0.0.1:50051" or "10.0.0.2:50051"
    epoch_of([e for e, _ in members]).hex()

Encodings (integers little-endian; str(x) = u32 length of x, then the bytes of x):
    epoch          = SHA-256(str(e) for each endpoint e, sorted bytewise, duplicates removed)
    key (tokens)   = SHA-256(0x01 str(tenant) str(model) u32(n) u32(token_0) ... u32(token_n-1))
    key (sequence) = SHA-256(0x02 str(tenant) str(model) str(sequence_id))
    h(key, e)      = first 8 bytes of SHA-256(key e) as a u64
    u              = (2 * (h >> 12) + 1) / 2**53
    score(key, e)  = -weight(e) / ln(u); the owner has the highest score, ties to the smaller e.
"""

import hashlib
import math
import struct
from typing import Iterable, Sequence, Tuple


def _str(value) -> bytes:
    data = value.encode() if isinstance(value, str) else bytes(value)
    return struct.pack("<I", len(data)) + data


def epoch_of(endpoints: Iterable[str]) -> bytes:
    """The membership epoch: SHA-256 over the sorted, deduplicated endpoints."""
    data = b"".join(_str(e) for e in sorted({e.encode() for e in endpoints}))
    return hashlib.sha256(data).digest()


def placement_key_of_tokens(tenant: str, model_id: str, first_block_tokens: Sequence[int]) -> bytes:
    """The key of a sequence whose first block holds these token ids."""
    data = b"\x01" + _str(tenant) + _str(model_id) + struct.pack("<I", len(first_block_tokens))
    data += struct.pack("<%dI" % len(first_block_tokens), *first_block_tokens)
    return hashlib.sha256(data).digest()


def placement_key_of_sequence(tenant: str, model_id: str, sequence_id: str) -> bytes:
    """The key of a sequence created without tokens."""
    data = b"\x02" + _str(tenant) + _str(model_id) + _str(sequence_id)
    return hashlib.sha256(data).digest()


def rendezvous_score(key: bytes, endpoint: str, weight: int) -> float:
    h = struct.unpack("<Q", hashlib.sha256(key + endpoint.encode()).digest()[:8])[0]
    u = float(2 * (h >> 12) + 1) / 9007199254740992.0
    return -float(weight) / math.log(u)


def owner_of(key: bytes, members: Iterable[Tuple[str, int]]) -> str:
    """The endpoint that owns `key` among (endpoint, weight) pairs."""
    best, best_score = None, None
    for endpoint, weight in sorted(set(members), key=lambda m: m[0].encode()):
        score = rendezvous_score(key, endpoint, weight)
        if best_score is None or score > best_score:
            best, best_score = endpoint, score
    if best is None:
        raise ValueError("owner_of: empty membership")
    return best
