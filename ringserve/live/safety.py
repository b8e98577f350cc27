"""The output safety stage's Trio shell: checkers for each message's hold-back window.

The producer (``core/producer.py``) holds every text block's deltas back in
its :class:`~ringserve.core.safety.HoldBack` before the coalescer and asks
for a check as text falls out of the window; the hub awaits
:meth:`SafetyStage.judge` and hands the verdict back. So a checker sees text
before it reaches the stream log, and the metrics, which time text as it
enters the log, count the hold-back in time to first token and in the gaps
between tokens. This module only awaits checkers.

Two kinds of checker, both built from the ``[safety]`` table:

* ``patterns``: a :class:`~ringserve.core.safety.PatternChecker`, called on
  the Trio thread (:class:`InlineChecker`; microseconds per check).
* ``checker = "module:callable"``: any blocking function, an external
  classifier say, run on a worker thread by :class:`ThreadedChecker` under
  its own ``CapacityLimiter``. The decode loop never waits for it: the
  runner hands events over with ``send_nowait``, and only this message's
  stream waits. Checks of one message run one at a time, one per release,
  so a classifier slower than a token makes that stream fall behind
  decoding (the text is never lost; it waits in the runner's channel).

A block ends the stream with ``Finish(StopReason.REFUSAL)`` (Anthropic
``stop_reason: "refusal"``, OpenAI ``finish_reason: "content_filter"``);
the producer then leaves the runner's ``submit`` block, which cancels the
generation and frees its slot. A checker that raises, or returns something
other than a :class:`~ringserve.core.safety.Verdict`, fails the stream with
a retryable in-band ``api_error``; in both cases no unchecked text is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import attrs
import trio

from ringserve.core.safety import Check, Checker, CheckFunction, PatternChecker, Verdict, load_checker

if TYPE_CHECKING:
    from ringserve.config import SafetyConfig

__all__ = ["AsyncChecker", "InlineChecker", "SafetySetupError", "SafetyStage", "ThreadedChecker"]

log = logging.getLogger("ringserve.safety")


class SafetySetupError(ValueError):
    """A ``[safety] checker`` the server cannot start with: one line, as a bad config value's."""


class AsyncChecker(Protocol):
    """What the stage awaits: a :class:`~ringserve.core.safety.Checker` made awaitable."""

    async def check(self, released: str, window: str) -> Verdict: ...


@attrs.frozen
class InlineChecker:
    """A fast :class:`~ringserve.core.safety.Checker` called on the Trio thread, with no checkpoint."""

    checker: Checker

    async def check(self, released: str, window: str) -> Verdict:
        return self.checker.check(released, window)


class ThreadedChecker:
    """A blocking check function run on a worker thread, never on the Trio thread.

    Each call goes through ``trio.to_thread.run_sync`` under this checker's
    own ``CapacityLimiter``, so a slow classifier holds neither the decode
    loop nor Trio's default thread pool. ``abandon_on_cancel=True``: a
    cancelled, aborted or drained generation does not wait for the call; the
    call runs on to its end on its thread and its answer is dropped.

    Args:
        fn: ``fn(released, window) -> Verdict``; it must be thread-safe when
            ``max_threads`` > 1.
        max_threads: calls in flight at once over all messages (>= 1).
    """

    def __init__(self, fn: CheckFunction, *, max_threads: int) -> None:
        self._fn = fn
        self._limiter = trio.CapacityLimiter(max_threads)

    async def check(self, released: str, window: str) -> Verdict:
        return await trio.to_thread.run_sync(
            self._fn, released, window, limiter=self._limiter, abandon_on_cancel=True
        )


def _checkers(checkers: Iterable[AsyncChecker]) -> tuple[AsyncChecker, ...]:
    return tuple(checkers)


@attrs.frozen
class SafetyStage:
    """The server's safety stage: the window size and the checkers, shared by every message.

    Args:
        window_tokens: sampled tokens held back per message (>= 1).
        checkers: asked in order; the first block wins. None at all allows
            everything (and still holds text back, which shows the cost).
    """

    window_tokens: int = attrs.field(validator=attrs.validators.ge(1))
    checkers: tuple[AsyncChecker, ...] = attrs.field(converter=_checkers)

    @classmethod
    def from_config(cls, config: SafetyConfig, *, max_threads: int) -> SafetyStage | None:
        """The stage for a ``[safety]`` table, or None when ``window_tokens`` is 0.

        With ``window_tokens = 0`` nothing is built, so no checker is ever
        called and streams are exactly as without the stage; configured
        patterns or a checker are then only warned about.

        Args:
            config: the ``[safety]`` table (already validated).
            max_threads: the threaded checker's thread limit (the number of
                slots: one check in flight per generation).

        Raises:
            SafetySetupError: the checker cannot be loaded (as
                :func:`~ringserve.core.safety.load_checker`, after ``[safety]``).
        """
        if config.window_tokens == 0:
            if config.patterns or config.checker:
                log.warning("[safety] window_tokens is 0: the safety stage is off; patterns and checker are not used")
            return None
        checkers: list[AsyncChecker] = []
        if config.patterns:
            checkers.append(InlineChecker(PatternChecker(config.patterns)))
        if config.checker:
            try:
                check = load_checker(config.checker)
            except (TypeError, ValueError) as exc:
                raise SafetySetupError(f"[safety] {exc}") from None
            checkers.append(ThreadedChecker(check, max_threads=max_threads))
        return cls(config.window_tokens, checkers)

    async def judge(self, check: Check) -> Verdict:
        """Ask every checker about ``check``; the first block wins.

        Raises:
            TypeError: a checker returned something other than a Verdict.
            Exception: whatever a checker raised.
        """
        for checker in self.checkers:
            verdict = await checker.check(check.released, check.window)
            if not isinstance(verdict, Verdict):
                raise TypeError(f"a safety checker returned {type(verdict).__name__}, not a Verdict")
            if not verdict.allowed:
                return verdict
        return Verdict.allow()
