"""The message lifecycle table (core/status.py)."""

from __future__ import annotations

import pytest

from ringserve.core.status import FINAL_STATUSES, TRANSITIONS, IllegalTransition, MessageStatus, advance


def test_a_message_generates_then_ends_once():
    status = advance(MessageStatus.QUEUED, MessageStatus.GENERATING)
    assert advance(status, MessageStatus.COMPLETE) is MessageStatus.COMPLETE
    assert advance(MessageStatus.QUEUED, MessageStatus.CANCELLED) is MessageStatus.CANCELLED  # no text yet


@pytest.mark.parametrize("final", sorted(FINAL_STATUSES))
def test_a_final_status_has_no_way_out(final):
    for status in MessageStatus:
        with pytest.raises(IllegalTransition, match=final.value):
            advance(final, status)


def test_no_way_back_to_queued_and_the_stored_spellings_are_stable():
    assert all(MessageStatus.QUEUED not in targets for targets in TRANSITIONS.values())
    assert FINAL_STATUSES == {MessageStatus(s) for s in ("complete", "cancelled", "failed", "interrupted")}
