"""The learner's heartbeat round: each session once per interval, lateness owed to every slice."""

import pytest

from rlink_ucx.session.learner.liveness import SLICES, HeartbeatRounds

pytestmark = pytest.mark.timeout(10)


def test_every_session_is_looked_at_exactly_once_per_round():
    rounds = HeartbeatRounds()
    sessions = [(sid, f"s{sid}") for sid in range(1, 1025)]
    seen: list[str] = []
    turns = []
    for _ in range(SLICES):
        turn, owed = rounds.tick(0.0)
        turns.append(turn)
        assert owed == 0.0
        members = rounds.members(turn, sessions)
        assert len(members) == 1024 // SLICES  # the slices are even: no tick sends them all
        seen += members
    assert turns == list(range(SLICES))
    assert sorted(seen) == sorted(s for _, s in sessions)
    # the next round starts over with the same slices
    turn, _ = rounds.tick(0.0)
    assert turn == 0 and rounds.members(turn, sessions) == [s for sid, s in sessions if sid % SLICES == 0]


def test_a_late_tick_is_owed_to_every_slice_once():
    rounds = HeartbeatRounds(slices=4)
    assert rounds.tick(0.0) == (0, 0.0)
    # the learner was paused 3 s before tick 1: every slice's sessions are credited 3 s, once
    paid = dict([rounds.tick(3.0), rounds.tick(0.0), rounds.tick(0.0), rounds.tick(0.5)])
    assert paid == {1: 3.0, 2: 3.0, 3: 3.0, 0: 3.5}
    assert rounds.tick(0.0) == (1, 0.5)  # tick 4's lateness reaches slice 1 on its next turn
