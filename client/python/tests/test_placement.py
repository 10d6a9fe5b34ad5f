"""kvpool.placement against the fixed vectors that common/placement_test.cc also checks."""

import json
import os
import struct

import pytest

from kvpool import placement

VECTORS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "fixtures",
                       "placement_vectors.json")


@pytest.fixture(scope="module")
def vectors():
    with open(VECTORS) as f:
        return json.load(f)


def test_epochs_match_the_fixed_vectors(vectors):
    assert len(vectors["epochs"]) >= 4
    for e in vectors["epochs"]:
        assert placement.epoch_of(e["endpoints"]).hex() == e["epoch"]


def test_keys_match_the_fixed_vectors(vectors):
    assert len(vectors["keys"]) >= 7
    for k in vectors["keys"]:
        if k["kind"] == "tokens":
            key = placement.placement_key_of_tokens(k["tenant"], k["model"], k["tokens"])
        else:
            key = placement.placement_key_of_sequence(k["tenant"], k["model"], k["sequence_id"])
        assert key.hex() == k["key"]


def test_scores_and_owners_match_the_fixed_vectors(vectors):
    assert len(vectors["owners"]) >= 24
    for o in vectors["owners"]:
        members = [tuple(m) for m in vectors["memberships"][o["membership"]]]
        key = bytes.fromhex(o["key"])
        for (endpoint, weight), score in zip(members, o["scores"]):
            assert placement.rendezvous_score(key, endpoint, weight) == float(score)
        assert placement.owner_of(key, members) == o["owner"]


def test_adding_a_fourth_endpoint_moves_a_quarter_of_the_keys():
    three = [("127.0.0.%d:7000" % i, 1) for i in (2, 3, 4)]
    four = three + [("127.0.0.5:7000", 1)]
    keys = [placement.placement_key_of_sequence("t", "m", "s%d" % i) for i in range(2000)]
    moved = [k for k in keys if placement.owner_of(k, three) != placement.owner_of(k, four)]
    assert all(placement.owner_of(k, four) == "127.0.0.5:7000" for k in moved)
    assert abs(len(moved) / len(keys) - 0.25) <= 0.05


def test_tokens_are_encoded_as_u32():
    with pytest.raises(struct.error):
        placement.placement_key_of_tokens("t", "m", [1 << 32])
