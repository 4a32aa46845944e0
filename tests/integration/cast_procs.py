"""Actor processes of test_schema_cast.py (importable by the spawned children)."""

from __future__ import annotations

import numpy as np


def float32_actor(address: str, n: int) -> None:
    """The first actor: its float32 / int32 steps set the learner's schema."""
    from rlink_ucx import Actor

    with Actor(address, transport="tcp", actor_id=1) as a:
        for i in range(n):
            a.put({"obs": np.full(4, i, np.float32), "action": np.int32(i), "reward": np.float32(i / 2)})
        a.flush(60)


def float64_actor(address: str, n: int, results) -> None:
    """The second actor: puts Python lists and ints, float64 arrays and int64 (what envs return);
    reports the errors of what cannot be cast."""
    from rlink_ucx import Actor, SchemaMismatch

    errors = []
    with Actor(address, transport="tcp", actor_id=2) as a:
        for bad in ({"obs": np.zeros(4, bool), "action": 1, "reward": 0.0},  # a change of kind
                    {"obs": [0.1, 0.2, 0.3, 0.4], "action": 1.5, "reward": 0.0},  # float -> int
                    {"obs": [0.1, 0.2, 0.3], "action": 1, "reward": 0.0},  # a change of shape
                    {"obs": [0.1, 0.2, 0.3, 0.4], "action": 1, "reward": 0.0, "info": "hello"}):  # fmt: skip
            try:
                a.put(bad)
            except SchemaMismatch as exc:
                errors.append(str(exc))
        for i in range(n):
            if i % 2:
                a.put({"obs": [0.1 * i, 0.2, 0.3, 0.4], "action": i, "reward": 0.25 * i})  # lists, Python numbers
            else:
                a.put({"obs": np.array([0.1 * i, 0.2, 0.3, 0.4]), "action": np.int64(i),
                       "reward": np.array(0.25 * i)})  # float64 and int64 arrays  # fmt: skip
        try:
            a.put({"obs": "hello", "action": 1, "reward": 0.0})
        except SchemaMismatch as exc:
            errors.append(str(exc))
        a.flush(60)
    results.put(errors)
