"""The field table of tests/support/agent_fields.py against the captured agent requests.

Re-capturing after an agent upgrade (tests/support/capture_agents.py) makes these fail on each
field the new version sends that the table does not cover, and on each row no capture uses any more.
"""

from __future__ import annotations

from tests.support.agent_fields import FIELDS, Policy, captured_fields


def test_every_captured_field_has_a_policy():
    missing = sorted(key for key in captured_fields() if key not in FIELDS)
    assert not missing, missing


def test_every_policy_row_is_a_captured_field():
    stale = sorted(key for key in FIELDS if key not in captured_fields())
    assert not stale, stale


def test_no_field_an_agent_sends_by_default_is_refused():
    refused = sorted(key for key in captured_fields() if FIELDS[key][0] is Policy.REFUSE)
    assert not refused, refused
