"""Code that runs in spawned processes for test_onpolicy.py (importable by the children)."""

from __future__ import annotations

import sys
import time

import numpy as np

T = 5  # steps per rollout in these tests


def rollout(actor_id: int, version: int) -> dict[str, np.ndarray]:
    """One rollout as one rlink step, its values encoding (actor, version, t): obs has T + 1
    rows (the last is the bootstrap observation), reward T, ``first`` one value."""
    t = np.arange(T + 1, dtype=np.float32)
    obs = np.stack([np.full(T + 1, actor_id, np.float32), np.full(T + 1, version, np.float32), t], 1)
    return {"obs": obs, "reward": (actor_id * 100 + np.arange(T)).astype(np.float32),
            "first": np.int64(actor_id * 1000 + version)}  # fmt: skip


def lockstep_actor(address: str, actor_id: int, results) -> None:
    """Put one rollout per model version, waiting for the next one with ``newer_than``, until
    the learner closes; report each version acted on, and how it ended."""
    from rlink_ucx import Actor, Closed

    with Actor(address, transport="tcp", actor_id=actor_id) as actor:
        try:
            _, version = actor.get_remote_model(timeout=60, format="numpy")
            while True:
                actor.put(rollout(actor_id, version), version=version)
                results.put((actor_id, "put", version))
                _, version = actor.get_remote_model(timeout=60, format="numpy", newer_than=version)
        except Closed as exc:
            results.put((actor_id, "closed", str(exc)))


def weights_only_actor(address: str, results, reconnect_timeout: float) -> None:
    """Never puts. Reports the first version; the next one, waited for with ``newer_than``;
    then keeps reading with ``latest=False`` (what a weights-only actor's loop does) and
    reports the error that ends either wait (the learner closed, or was lost)."""
    from rlink_ucx import Actor, Config, RLinkError

    config = Config(reconnect_timeout=reconnect_timeout, heartbeat_timeout=3.0)
    with Actor(address, transport="tcp", config=config) as actor:
        _, version = actor.get_remote_model(timeout=60, format="numpy")
        results.put(("first", version))
        started = time.monotonic()
        calls = 0
        try:
            _, version = actor.get_remote_model(timeout=60, format="numpy", newer_than=version)
            results.put(("next", version, time.monotonic() - started))
            while time.monotonic() - started < 120:
                actor.get_remote_model(timeout=60, format="numpy", latest=False)
                calls += 1
                time.sleep(0.05)
            results.put(("never ended", calls))
        except RLinkError as exc:
            results.put(("ended", type(exc).__name__, time.monotonic() - started, calls))


def last_version_reader(address: str, results, go) -> None:
    """Reports the first version; once ``go`` is set (the learner has published version 2 with
    ``wait=True`` and closed), what ``newer_than=1`` returns, then what ``newer_than=2`` raises."""
    from rlink_ucx import Actor, RLinkError

    with Actor(address, transport="tcp") as actor:
        _, version = actor.get_remote_model(timeout=60, format="numpy")
        results.put(("first", version))
        go.wait(60)
        for asked in (version, version + 1):
            try:
                state, got = actor.get_remote_model(timeout=10, format="numpy", newer_than=asked)
                results.put(("got", got, float(state["w"].sum())))
            except RLinkError as exc:
                results.put(("raised", type(exc).__name__))


def killable_learner(results) -> None:
    """A learner that publishes version 1, reports its address, and lives until killed."""
    from rlink_ucx import Learner

    with Learner("127.0.0.1:0", transport="tcp") as learner:
        learner.publish({"w": np.arange(4, dtype=np.float32)})
        results.put(learner.address)
        time.sleep(600)


def early_weights_reader(address: str, results) -> None:
    """In a fresh interpreter (torch not imported yet), before anything is published:
    ``get_remote_model(latest=False)`` and then ``get_remote_model(timeout=3)``, each timed."""
    from rlink_ucx import Actor, TimeoutError

    with Actor(address, transport="tcp") as actor:
        torch_before = "torch" in sys.modules
        started = time.monotonic()
        state, version = actor.get_remote_model(latest=False)
        results.put(("latest=False", state, version, time.monotonic() - started, actor.policy_version))
        started = time.monotonic()
        try:
            actor.get_remote_model(timeout=3)
            results.put(("timeout=3", "returned", time.monotonic() - started, torch_before))
        except TimeoutError:
            results.put(("timeout=3", "TimeoutError", time.monotonic() - started, torch_before))
