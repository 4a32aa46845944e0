"""The one conversion rule of put and put_many (numpy's same_kind casting, ranges checked,
no change of kind), tested on the field checks themselves."""

from __future__ import annotations

import numpy as np
import pytest

from rlink_ucx import SchemaMismatch
from rlink_ucx.session.actor.fields import Field, check_chunk, check_value
from rlink_ucx.wire.codec import Schema

SCHEMA = Schema.from_spec({"obs": ("float32", (3,)), "action": ("int32", ()), "reward": ("float32", ()),
                           "done": ("bool", ())})  # fmt: skip
FIELDS = [Field(i, spec) for i, spec in enumerate(SCHEMA.fields)]
OBS, ACTION, REWARD, DONE = FIELDS


def step(**changes):
    base = {"obs": np.zeros(3, np.float32), "action": 1, "reward": 0.5, "done": False}
    return {**base, **changes}


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        (OBS, [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]),  # a Python list
        (OBS, np.array([1.5, 2.5, 3.5]), [1.5, 2.5, 3.5]),  # float64 -> float32
        (OBS, np.array([1, 2, 3], np.int64), [1.0, 2.0, 3.0]),  # int -> float
        (ACTION, np.int64(7), 7),  # int64 -> int32 in range
        (ACTION, np.array(-(2**31)), -(2**31)),
        (ACTION, 2**31 - 1, 2**31 - 1),
        (REWARD, np.float64(-0.25), -0.25),  # gymnasium's float64 reward
        (REWARD, 3, 3.0),
        (DONE, np.bool_(True), True),
    ],
)
def test_values_of_the_same_kind_are_cast_to_the_negotiated_dtype(field, value, expected):
    out = check_value(field, step(**{field.name: value}))
    arr = np.asarray(out, dtype=field.dtype) if not isinstance(out, np.ndarray) else out
    assert arr.dtype == field.dtype
    assert arr.tolist() == expected


@pytest.mark.parametrize(
    ("field", "value", "given"),
    [
        (ACTION, 1.5, r"a Python float"),  # float -> int changes kind
        (ACTION, np.array(2.0), r"float64\[\]"),
        (ACTION, np.int64(2**31), r"outside int32"),
        (ACTION, 2**40, r"outside int32's range"),
        (ACTION, np.array(-(2**31) - 1), r"outside int32"),
        (DONE, 1, r"a Python int"),  # anything -> bool changes kind
        (DONE, np.float32(0.0), r"float32\[\]"),
        (REWARD, True, r"a Python bool"),  # bool -> anything too
        (OBS, np.array([True, False, True]), r"bool\[3\]"),
        (OBS, [1.0, 2.0], r"float64\[2\]"),  # a shape change
        (OBS, np.zeros((3, 1), np.float32), r"float32\[3, 1\]"),
    ],
)
def test_a_change_of_kind_range_or_shape_names_the_field_and_both_sides(field, value, given):
    with pytest.raises(SchemaMismatch, match=rf"field '{field.name}': the negotiated schema says .*, got .*{given}"):
        check_value(field, step(**{field.name: value}))


def test_put_many_follows_the_same_rule():
    arrays, count = check_chunk(FIELDS, {"obs": np.ones((4, 3)), "action": np.arange(4, dtype=np.int64),
                                         "reward": np.array([0.5, 1.5, 2.5, 3.5]), "done": np.zeros(4, bool)})  # fmt: skip
    assert count == 4
    assert [a.dtype for a in arrays] == [f.dtype for f in FIELDS]
    assert arrays[1].tolist() == [0, 1, 2, 3] and arrays[2].tolist() == [0.5, 1.5, 2.5, 3.5]
    with pytest.raises(SchemaMismatch, match=r"field 'action'.*int32\[\].*float64\[\] per step"):
        check_chunk(FIELDS, {"obs": np.ones((2, 3)), "action": np.array([1.0, 2.0]), "reward": np.zeros(2),
                             "done": np.zeros(2, bool)})  # fmt: skip
    with pytest.raises(SchemaMismatch, match=r"field 'action'.*values in \[0, 4294967296\], outside int32"):
        check_chunk(FIELDS, {"obs": np.ones((2, 3)), "action": np.array([0, 2**32]), "reward": np.zeros(2),
                             "done": np.zeros(2, bool)})  # fmt: skip
