"""Casting to the learner's schema: which dtypes are cast (the kind is kept), the schema an actor
adopts from the learner's Accept, and errors that name the field and both specs."""

from __future__ import annotations

import re

import numpy as np
import pytest

from rlink_ucx import ProtocolError, SchemaMismatch
from rlink_ucx.session.actor.fields import Field, accepted_schema, check_chunk, check_value
from rlink_ucx.wire import messages as _wire
from rlink_ucx.wire.codec import Schema, castable, infer_schema

LEARNER = Schema.from_spec({"obs": ("float32", (4,)), "action": ("int32", ()), "small": ("uint8", ()),
                            "done": ("bool", ())})  # fmt: skip


@pytest.mark.parametrize(("src", "dst", "ok"), [
    ("float64", "float32", True), ("float16", "float64", True), ("float32", "float32", True),
    ("int64", "int32", True), ("int64", "uint8", True), ("uint64", "int8", True),  # values checked per put
    ("int64", "float32", True),
    ("float32", "int64", False), ("float64", "uint8", False),  # float -> int changes kind
    ("bool", "int8", False), ("int8", "bool", False), ("float32", "bool", False),
    ("float32", "bfloat16", False), ("bfloat16", "float32", False), ("uint16", "bfloat16", False),
])  # fmt: skip
def test_castable_keeps_the_kind(src: str, dst: str, ok: bool) -> None:
    assert castable(src, dst) is ok


def test_a_list_and_float64_proposal_casts_to_the_learners_float32_schema() -> None:
    step = {"obs": [0.1, 0.2, 0.3, 0.4], "action": 3, "small": 7, "done": False}
    proposed = infer_schema(step)
    assert proposed.describe() == "{obs: float64[4], action: int64[], small: int64[], done: bool[]}"
    assert proposed != LEARNER and proposed.casts_to(LEARNER)
    reordered = infer_schema({"done": True, "small": 1, "obs": np.zeros(4), "action": np.int64(1)})
    assert reordered.casts_to(LEARNER)  # fields are matched by name


@pytest.mark.parametrize(("change", "named"), [
    ({"obs": np.zeros(4, np.int64)}, None),  # int -> float is cast: no error
    ({"action": 0.5}, r"field 'action': learner has int32\[\], actor sent float32\[\]"),
    ({"done": 1}, r"field 'done': learner has bool\[\], actor sent int64\[\]"),
    ({"obs": np.zeros(5)}, r"field 'obs': learner has float32\[4\], actor sent float64\[5\]"),
    ({"obs": np.zeros(4, bool)}, r"field 'obs': learner has float32\[4\], actor sent bool\[4\]"),
])  # fmt: skip
def test_what_cannot_be_cast_is_named_with_both_specs(change: dict, named: str | None) -> None:
    # float64 obs (castable) comes first in the step: the message names the field that is not
    proposed = infer_schema({"obs": np.zeros(4), "action": np.int64(1), "small": 1, "done": False, **change})
    assert proposed.casts_to(LEARNER) is (named is None)
    if named is not None:
        assert re.fullmatch(named, LEARNER.compare(proposed))


def test_the_actor_adopts_the_learners_schema_from_accept_and_casts_to_it() -> None:
    proposed = infer_schema({"obs": [0.1, 0.2, 0.3, 0.4], "action": 3, "small": 7, "done": False})
    assert accepted_schema(proposed, _wire.Accept(1, 64), 256) is proposed
    adopted = accepted_schema(proposed, _wire.Accept(1, 64, LEARNER.to_wire()), 256)
    assert adopted == LEARNER
    fields = [Field(i, spec) for i, spec in enumerate(adopted.fields)]
    _, action, small, _ = fields
    values = [check_value(f, {"obs": [0.1, 0.2, 0.3, 0.4], "action": 3, "small": 200, "done": True})
              for f in fields]  # fmt: skip
    arr = values[0]
    assert arr.dtype == np.float32 and arr.tolist() == np.array([0.1, 0.2, 0.3, 0.4], np.float32).tolist()
    assert values[1:] == [3, 200, True]
    arrays, n = check_chunk(fields, {"obs": np.full((2, 4), 0.25), "action": np.array([1, 2]),
                                     "small": np.array([0, 255]), "done": np.zeros(2, bool)})  # fmt: skip
    assert n == 2 and [a.dtype for a in arrays] == [np.float32, np.int32, np.uint8, np.bool_]
    assert arrays[2].tolist() == [0, 255]
    with pytest.raises(SchemaMismatch, match=r"field 'small'.*uint8.*outside"):
        check_value(small, {"small": 256})
    with pytest.raises(SchemaMismatch, match=r"field 'small'.*values in \[-1, 0\], outside uint8"):
        check_chunk(fields, {"obs": np.zeros((2, 4)), "action": np.zeros(2, np.int64), "small": np.array([-1, 0]),
                             "done": np.zeros(2, bool)})  # fmt: skip
    with pytest.raises(SchemaMismatch, match=r"field 'action'.*int32.*float64"):
        check_value(action, {"action": np.array(1.0)})


def test_an_accept_the_proposal_cannot_be_cast_to_is_a_protocol_error() -> None:
    proposed = infer_schema({"obs": np.zeros(4, np.float32), "action": 1, "small": 1, "done": False})
    other = Schema.from_spec({"obs": ("int32", (4,)), "action": ("int32", ()), "small": ("uint8", ()),
                              "done": ("bool", ())})  # fmt: skip
    with pytest.raises(ProtocolError, match="cannot be cast"):
        accepted_schema(proposed, _wire.Accept(1, 64, other.to_wire()), 256)


def test_a_value_that_is_no_array_names_its_field() -> None:
    with pytest.raises(SchemaMismatch, match=r"field 'info': unsupported dtype"):
        infer_schema({"obs": np.zeros(4), "info": "hello"})
    with pytest.raises(SchemaMismatch, match=r"field 'info'"):
        infer_schema({"info": [[1.0], [1.0, 2.0]]})  # ragged
    obs = Field(0, LEARNER.fields[0])
    with pytest.raises(SchemaMismatch, match=r"field 'obs': unsupported dtype"):
        check_value(obs, {"obs": "hello"})
    with pytest.raises(SchemaMismatch, match=r"field 'obs'"):
        check_chunk([obs], {"obs": object()})
