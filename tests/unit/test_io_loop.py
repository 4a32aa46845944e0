"""The I/O loop: one shared by every Actor of a process, and periodic work from one timer."""

from __future__ import annotations

import threading
import time

import pytest

from rlink_ucx.transport.loop import IOThread, release_io, shared_io
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


def test_every_runs_callbacks_of_one_interval_from_one_timer_and_stops_them():
    io = IOThread("test-io")
    try:
        calls: list[tuple[str, float]] = []
        timer_runs = [0]
        real_tick = io._tick

        def counted_tick(interval: float) -> None:
            timer_runs[0] += 1
            real_tick(interval)

        io._tick = counted_tick  # type: ignore[method-assign]

        def count(name: str) -> int:
            return sum(c == name for c, _ in calls)

        def at_most_one_per_interval(name: str, since: float) -> None:
            # Every 0.01 s from one chain: two chains would call twice as often.
            n, ticks = count(name), (time.monotonic() - since) / 0.01
            assert n <= ticks + 2, (name, n, ticks)

        started = time.monotonic()
        stop_a = io.every(0.01, lambda: calls.append(("a", time.monotonic())))
        stop_b = io.every(0.01, lambda: calls.append(("b", time.monotonic())))
        assert wait_until(lambda: count("a") >= 5 and count("b") >= 5, 10)
        a, b = count("a"), count("b")
        assert abs(a - b) <= 1, (a, b)
        at_most_one_per_interval("a", started)
        assert timer_runs[0] <= a + 2  # one timer for both, not one each
        stop_a()
        stop_b()
        time.sleep(0.05)  # a tick already under way may still run
        runs, n = timer_runs[0], len(calls)
        time.sleep(0.2)  # nothing to wait for: this proves that nothing happens
        assert len(calls) == n and timer_runs[0] <= runs + 1  # stopped: nothing wakes any more
        started = time.monotonic()
        stop_c = io.every(0.01, lambda: calls.append(("c", time.monotonic())))  # starts a timer again
        assert wait_until(lambda: count("c") >= 5, 10)
        at_most_one_per_interval("c", started)  # one chain, not two
        stop_c()
        started = time.monotonic()
        stop_d = io.every(0.01, lambda: calls.append(("d", time.monotonic())))  # while c's timer is pending
        assert wait_until(lambda: count("d") >= 5, 10)
        at_most_one_per_interval("d", started)
        stop_d()
    finally:
        io.stop(5)


def io_threads() -> int:
    # Counted by name: other tests' short-lived threads (e.g. a reserve's populator) may end
    # meanwhile and would move threading.active_count().
    return sum(t.name == "rlink-actor-io" and t.is_alive() for t in threading.enumerate())


def test_actors_of_a_process_share_one_io_thread_which_stops_with_the_last(monkeypatch):
    # Start from no shared thread: an earlier test in this process may still hold one.
    from rlink_ucx.transport import loop

    monkeypatch.setattr(loop, "_shared", None)
    monkeypatch.setattr(loop, "_shared_users", 0)
    before = io_threads()
    first, second = shared_io(), shared_io()
    assert first is second and io_threads() == before + 1
    release_io(first, 5)
    assert first.loop.is_running()  # one user left
    release_io(second, 5)
    assert not first._thread.is_alive() and io_threads() == before
    third = shared_io()
    assert third is not first and third.loop.is_running()
    release_io(third, 5)


def test_an_actor_that_fails_to_start_leaves_no_io_thread_behind(monkeypatch):
    """A refused token, or a connection that cannot even be built, must not keep the shared
    I/O thread alive for the rest of the process (it leaked into later tests once)."""
    from rlink_ucx import Actor, ConfigError
    from rlink_ucx.session.actor import link as actor_link
    from rlink_ucx.transport import loop

    monkeypatch.setattr(loop, "_shared", None)
    monkeypatch.setattr(loop, "_shared_users", 0)
    before = io_threads()
    with pytest.raises(ConfigError):
        Actor("127.0.0.1:1", token="short")

    def broken(*args, **kwargs):
        raise ConfigError("cannot build the connection")

    monkeypatch.setattr("rlink_ucx.actor.ActorConnection", broken)
    with pytest.raises(ConfigError, match="cannot build"):
        Actor("127.0.0.1:1", token="x" * 32)
    assert loop._shared is None and loop._shared_users == 0
    assert wait_until(lambda: io_threads() == before, 5)
    assert actor_link.ActorConnection is not broken


def test_soon_from_the_loop_thread_does_not_wake_the_loop_and_keeps_the_order():
    io = IOThread("test-io")
    try:
        wakes = [0]
        real = io.loop._write_to_self  # what call_soon_threadsafe uses to wake the selector

        def counted() -> None:
            wakes[0] += 1
            real()

        io.loop._write_to_self = counted  # type: ignore[method-assign]
        order: list[str] = []
        done = threading.Event()

        def on_loop() -> None:  # already on the loop: its own hand-offs need no wake-up
            io.soon(order.append, "b")
            io.soon(order.append, "c")
            io.soon(done.set)
            order.append("a")

        io.soon(on_loop)
        assert done.wait(5)
        assert order == ["a", "b", "c"]
        assert wakes[0] == 1  # the hand-off from this thread only
    finally:
        io.stop(5)


def test_a_new_io_thread_runs_its_loop_before_it_is_returned():
    # An Actor calls into its I/O thread at once; on a busy machine the thread had not entered
    # run_forever yet, and the call failed with "cannot run connect: the I/O thread has stopped".
    from rlink_ucx.transport.loop import IOThread

    for _ in range(20):
        io = IOThread(name="test-io")
        try:
            assert io.loop.is_running()
        finally:
            io.stop(5)
