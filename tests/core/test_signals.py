"""core/signals.py: a signal within the window of the last one let through is its echo."""

from __future__ import annotations

import sys

import pytest

from ringserve.core.frozen import FROZEN, SELF
from ringserve.core.signals import ECHO_SECONDS, EchoFilter


def echoes(window: float, times: list[float]) -> list[bool]:
    f = EchoFilter(window)
    return [f.is_echo(t) for t in times]


def test_without_a_window_no_signal_is_an_echo():
    assert echoes(0.0, [5.0, 5.0, 5.001, 9.0]) == [False, False, False, False]


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        ([10.0, 10.002], [False, True]),  # the bootloader's copy, milliseconds later
        ([10.0, 10.002, 10.9], [False, True, True]),
        ([10.0, 11.0], [False, False]),  # a second Ctrl-C a second later counts
        ([10.0, 10.5, 11.2, 11.3], [False, True, False, True]),  # an echo does not extend the window
    ],
)
def test_signals_within_the_window_are_echoes(times, expected):
    assert echoes(1.0, times) == expected


def test_the_package_has_no_window_and_runs_itself_with_python():
    """The tests run from the package (tests/system/test_binary.py runs the one-file executable)."""
    assert FROZEN is False and ECHO_SECONDS == 0.0
    assert SELF == (sys.executable, "-P", "-m", "ringserve")

