"""Check functions that tests name in ``[safety] checker = "tests.support.safety_checkers:..."``.

They run on the safety stage's worker threads, so they share state through
thread-safe objects only. Each test resets what it uses with :func:`reset`.
"""

from __future__ import annotations

import threading
import time

from ringserve.core.safety import Verdict

#: (released, window, thread id) of every call of :func:`recording`, :func:`gated`.
CALLS: list[tuple[str, str, int]] = []
#: :func:`gated` waits for this before answering.
GATE = threading.Event()
#: Set by :func:`gated` when it starts waiting.
WAITING = threading.Event()

GATE_GUARD = 20.0  # seconds: a gated call never waits longer, so no thread outlives a failed test for long


def reset() -> None:
    CALLS.clear()
    GATE.clear()
    WAITING.clear()


def recording(released: str, window: str) -> Verdict:
    """Allows everything and records the call."""
    CALLS.append((released, window, threading.get_ident()))
    return Verdict.allow()


def gated(released: str, window: str) -> Verdict:
    """A slow classifier: allows, but only once :data:`GATE` is set."""
    CALLS.append((released, window, threading.get_ident()))
    WAITING.set()
    GATE.wait(GATE_GUARD)
    return Verdict.allow()


def broken(released: str, window: str) -> Verdict:
    """A classifier that fails."""
    raise ConnectionError("classifier unreachable")


def not_a_verdict(released: str, window: str) -> bool:
    """A classifier that answers in the wrong type."""
    return True


#: Seconds :func:`slow_first` takes on a message's first check (longer than a 1 s heartbeat interval).
SLOW_SECONDS = 1.3


def slow_first(released: str, window: str) -> Verdict:
    """A slow classifier: allows, after :data:`SLOW_SECONDS` on each message's first check (nothing released yet)."""
    if not released:
        time.sleep(SLOW_SECONDS)
    return Verdict.allow()
