"""Nested (pytree) weight names: one key, one wire name, and back. A name that is not the one
flatten makes is refused on the way in; keys that share a name are refused on publish."""

from __future__ import annotations

import numpy as np
import pytest

from rlink_ucx import Config, ConfigError, Learner, ProtocolError
from rlink_ucx.wire.manifest import KEYED, Entry, Manifest, flatten, unflatten

AWKWARD = ["~", "/", "~0", "~1", "~~", "//", "~/~", "a~01", "~~01", "", "x/~1/y", "0", "1"]


@pytest.mark.parametrize("key", AWKWARD)
def test_every_key_round_trips_through_its_canonical_name(key: str) -> None:
    tree = {key: {key + "k": 1, "leaf": 2}, "other": 3}
    flat = flatten(tree)
    assert unflatten(flat) == tree
    # the names are canonical: escaping the decoded keys again gives the same names
    assert flatten(unflatten(flat)) == flat


@pytest.mark.parametrize("name", ["~~01", "a~2", "~", "a~", "~~", "x/~01~/y", "~a"])
def test_a_non_canonical_escape_is_refused(name: str) -> None:
    with pytest.raises(ProtocolError, match="bad escape"):
        unflatten({name: 1})


def test_two_names_for_one_key_are_refused() -> None:
    # "~~01" decoded by replacing escapes in order gives "~~1", the key whose own name is "~0~01":
    # accepted, two wire names would have meant one key and one tensor would silently go.
    assert flatten({"~~1": 1}) == {"~0~01": 1}
    with pytest.raises(ProtocolError, match="bad escape"):
        unflatten({"~0~01": 1, "~~01": 2})


def test_a_manifest_with_a_non_canonical_name_is_refused_before_anything_is_allocated() -> None:
    def manifest(name: str) -> Manifest:
        return Manifest(version=1, entries=[Entry(name, "float32", [2], 0)], total_bytes=8, bucket_bytes=64, checksums=[],
                        checksum=KEYED)  # fmt: skip

    manifest("a/~0~01").validate(max_bytes=1 << 20, max_entries=10)
    with pytest.raises(ProtocolError, match="bad escape"):
        manifest("a/~~01").validate(max_bytes=1 << 20, max_entries=10)


@pytest.mark.parametrize("tree", [
    {1: 0.0, "1": 1.0},
    {"p": {2: 0.0, "2": 1.0}},
    {1: {"w": 0.0}, "1": {"b": 1.0}},  # two subtrees would merge into one on the other side
    {True: 0.0, "True": 1.0},
])  # fmt: skip
def test_keys_with_one_name_are_refused(tree: dict) -> None:
    with pytest.raises(ConfigError, match="have one name"):
        flatten(tree)


@pytest.mark.timeout(60)
def test_publish_refuses_colliding_keys_and_changes_nothing(tmp_path) -> None:
    a, b = np.zeros(4, np.float32), np.ones(4, np.float32)
    with Learner("127.0.0.1:0", config=Config(token_dir=str(tmp_path))) as learner:
        with pytest.raises(ConfigError, match=r"params keys 1 and '1' of 'the top level' have one name, '1'"):
            learner.publish({1: a, "1": b})
        assert learner.version == 0
        assert learner.publish({1: a, "2": b}) == 1  # distinct names: published
