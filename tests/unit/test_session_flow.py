"""A session's credit accounting (``SessionFlow``): the revoke debt and when it is settled,
the low-water mark, idleness."""

from __future__ import annotations

import pytest

from rlink_ucx.session.learner.flow import IDLE_SECONDS, SessionFlow

pytestmark = pytest.mark.timeout(60)


def test_a_revoke_debt_lasts_until_returned_and_down_to_what_it_may_keep():
    flow = SessionFlow()
    assert not flow.owes()
    flow.credit, flow.revoking, flow.owed_since, flow.owed_keep = 100, True, 5.0, 20
    assert flow.owes()  # no Returned yet
    flow.revoking, flow.credit = False, 30  # returned, but frames sent before it still count
    assert flow.owes() and flow.owed_since == 5.0
    flow.credit = 20  # they landed
    assert not flow.owes() and flow.owed_since is None


def test_low_water_and_idleness():
    flow = SessionFlow()
    flow.credit, flow.low_water = 8, 7
    assert not flow.low
    flow.credit = 7
    assert flow.low
    assert not flow.idle(flow.last_frame + IDLE_SECONDS)
    assert flow.idle(flow.last_frame + IDLE_SECONDS + 0.01)
