"""The output safety stage's sans-I/O core: a hold-back window and the checker protocol.

Text that has been sent cannot be unsent, so a checker has to see text
before any client does (seed "Speculative Safety Checking": hold N tokens,
check them, release them if safe, else truncate and stop). :class:`HoldBack`
keeps the text of the last ``window_tokens`` sampled tokens; text that falls
out of the window leaves only after a :class:`Checker` allowed it together
with everything still held behind it. At the end of the generation the whole
remaining window is checked once more and leaves. When the checker blocks,
nothing it was shown is released, ever: the stream ends with what left
before (Anthropic ``stop_reason: "refusal"``, OpenAI
``finish_reason: "content_filter"``).

The stage sits after the UTF-8 hold-back (``core/detokenizer.py``) and the
stop-sequence hold-back (``core/stop.py``), so a checker only ever sees
whole characters and never a stop string; the caller (``live/safety.py``)
awaits the checker, which may run on a worker thread.

A match is withheld completely when it spans at most ``window_tokens + 1``
tokens: its last token enters the window while its first is still held, and
the check before the next release sees all of it. A longer match is still
stopped, but the part of it that left earlier has been sent.

Nothing here reads a clock or does I/O, except :func:`load_checker`, which
imports the configured module; every step returns a value.
"""

from __future__ import annotations

import importlib
import re
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

import attrs

__all__ = [
    "Check",
    "CheckFunction",
    "Checker",
    "HoldBack",
    "PatternChecker",
    "Verdict",
    "check_checker_path",
    "compile_patterns",
    "load_checker",
]


@attrs.frozen
class Verdict:
    """A checker's answer: allow, or block with a reason.

    Build with :meth:`allow` or :meth:`block`. The reason is logged by the
    server, never sent to clients; it should name the rule, not quote the
    text.
    """

    allowed: bool
    reason: str = ""

    @classmethod
    def allow(cls) -> Verdict:
        return _ALLOW

    @classmethod
    def block(cls, reason: str) -> Verdict:
        return cls(False, reason)


_ALLOW = Verdict(True)


class Checker(Protocol):
    """Decides whether held-back text may be released.

    ``check`` must be a pure decision: it is called once per release, and
    its answer applies to ``window`` as a whole.
    """

    def check(self, released: str, window: str) -> Verdict:
        """Judge ``window`` in the context of ``released``.

        Args:
            released: all text of this generation already sent to clients.
            window: the text about to be sent followed by the text still
                held behind it (whole characters, no stop strings).

        Returns:
            ``Verdict.allow()``, or ``Verdict.block(reason)`` to refuse the
            whole window and end the generation.
        """
        ...


CheckFunction = Callable[[str, str], Verdict]
"""A checker as a plain function: ``fn(released, window) -> Verdict``."""

_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def check_checker_path(path: str) -> None:
    """Check that ``path`` names a checker as :func:`load_checker` takes it, without importing it.

    Raises:
        ValueError: it does not look like ``"package.module:name"``.
    """
    if not _IMPORT_PATH.fullmatch(path):
        raise ValueError(f"checker must look like 'package.module:callable', got {path!r}")


def load_checker(path: str) -> CheckFunction:
    """Import a checker named ``"package.module:name"`` (``name`` may be dotted).

    The object named is either a :class:`Checker` (its ``check`` method is
    used) or a callable ``fn(released, window) -> Verdict``. Importing runs
    the module's top level, so a module that loads a classifier does it here,
    once.

    Raises:
        ValueError: the path is malformed, or the import fails (the message
            carries the import error).
        TypeError: the object is neither.
    """
    check_checker_path(path)
    module_name, _, attr_path = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"checker {path!r} cannot be loaded: {exc}") from None
    check = getattr(obj, "check", obj)
    if not callable(check):
        raise TypeError(f"checker {path!r} is neither a callable nor an object with a check() method")
    loaded: CheckFunction = check  # the user's code: its signature is checked when it is called
    return loaded


def compile_patterns(patterns: Iterable[str]) -> tuple[re.Pattern[str], ...]:
    """Compile safety patterns (Python ``re`` syntax; ``(?i)`` for case-insensitive).

    Raises:
        TypeError: a pattern is not a string.
        ValueError: a pattern does not compile, or matches the empty string
            (it would block every stream).

    Both messages name the pattern's index.
    """
    compiled = []
    for i, pattern in enumerate(patterns):
        if not isinstance(pattern, str):
            raise TypeError(f"patterns[{i}] must be a string, got {type(pattern).__name__}")
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"patterns[{i}] is not a valid regular expression: {exc}") from None
        if regex.search("") is not None:
            raise ValueError(f"patterns[{i}] matches the empty string, so it would block every stream")
        compiled.append(regex)
    return tuple(compiled)


@attrs.frozen
class PatternChecker:
    """Blocks text in which any of a list of regular expressions matches.

    The text searched is ``released + window``, from ``lookback`` characters
    before the window onwards (anchors and look-behinds still see the real
    start, as with ``Pattern.search(text, pos)``). Released text was searched
    when it was held, so a match that ends inside it was refused then; the
    lookback only serves matches that began before the window and end in it.
    ``$`` and ``\\b`` at the window's end see the end of the text so far, so
    they may match a word that the next token would continue (a block, on
    the safe side). An empty list allows everything.

    Cost per check: one copy of the text so far and, per pattern, one search
    over at most ``lookback + len(window)`` characters.

    Args:
        patterns: regular expressions, as :func:`compile_patterns` takes them.
        lookback: characters of released text searched before the window.

    Raises:
        TypeError, ValueError: as :func:`compile_patterns`.
    """

    patterns: tuple[re.Pattern[str], ...] = attrs.field(converter=compile_patterns)
    lookback: int = attrs.field(default=1024, validator=attrs.validators.ge(0))

    def check(self, released: str, window: str) -> Verdict:
        """Block when a pattern matches; the reason names its index, not the text."""
        text = released + window
        start = max(0, len(released) - self.lookback)
        for i, regex in enumerate(self.patterns):
            if regex.search(text, start) is not None:
                return Verdict.block(f"matched safety pattern {i}")
        return Verdict.allow()


@attrs.frozen
class Check:
    """A question for the checker, from :meth:`HoldBack.push` or :meth:`HoldBack.end`.

    Attributes:
        released: text already released (the checker's ``released``).
        window: the text to release followed by the text still held (the
            checker's ``window``).
        release: the text that leaves if the checker allows (a prefix of
            ``window``; all of it at the end).
    """

    released: str
    window: str
    release: str
    _entries: int = attrs.field(repr=False)


@attrs.define(eq=False)
class HoldBack:
    """Holds the text of the last ``window_tokens`` sampled tokens until a checker allows it.

    Feed it every delta of the generation with :meth:`push` (its text and
    the tokens sampled for it; text may be empty while an earlier stage holds
    it, tokens may be 0 for text released late). Whenever the held deltas
    count more than ``window_tokens`` tokens, the oldest fall out: ``push``
    returns a :class:`Check` for them, and :meth:`resolve` with the
    checker's verdict releases them (or blocks). At the end, :meth:`end`
    returns the check for everything still held. Deltas with no text fall
    out without a check.

    Moves, in order: ``push`` and ``flush`` (any number of times) then ``end``; after a
    ``Check`` is returned, ``resolve`` must come before the next move; after
    a block, or once the end is resolved, nothing more.

    Args:
        window_tokens: tokens held back (>= 1; 0 means no stage at all and
            is the caller's business).

    Raises:
        ValueError: ``window_tokens`` < 1.
    """

    window_tokens: int = attrs.field(validator=attrs.validators.ge(1))
    _held: deque[tuple[str, int]] = attrs.field(init=False, factory=deque)
    _held_tokens: int = attrs.field(init=False, default=0)
    _released: str = attrs.field(init=False, default="")
    _pending: Check | None = attrs.field(init=False, default=None)
    _ended: bool = attrs.field(init=False, default=False)
    _blocked: Verdict | None = attrs.field(init=False, default=None)

    @property
    def released(self) -> str:
        """All text released so far."""
        return self._released

    @property
    def held(self) -> str:
        """Text held back, not yet released."""
        return "".join(text for text, _ in self._held)

    @property
    def blocked(self) -> Verdict | None:
        """The blocking verdict, or None while nothing was blocked."""
        return self._blocked

    def push(self, text: str, tokens: int) -> Check | None:
        """Add one delta (``tokens`` >= 0 sampled tokens gave ``text``).

        Returns:
            The check that must pass before the text that fell out of the
            window may leave, or None when no text fell out.

        Raises:
            RuntimeError: a check is unresolved, or after the end or a block.
        """
        self._require_open("push")
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self._held.append((text, tokens))
        self._held_tokens += tokens
        out = 0
        over = self._held_tokens - self.window_tokens
        while over > 0:
            over -= self._held[out][1]
            out += 1
        if not any(self._held[i][0] for i in range(out)):
            for _ in range(out):
                self._held_tokens -= self._held.popleft()[1]
            return None
        return self._ask(out)

    def end(self) -> Check | None:
        """The generation ended: everything held must be checked before it leaves.

        Returns:
            The check for the whole window, or None when no text is held.

        Raises:
            RuntimeError: a check is unresolved, or after the end or a block.
        """
        check = self.flush()
        self._ended = True
        return check

    def flush(self) -> Check | None:
        """A text block ends: everything held must be checked before the block's stop. Unlike
        :meth:`end`, pushing may go on afterwards (the next text block's deltas).

        Returns:
            The check for the whole window, or None when no text is held.

        Raises:
            RuntimeError: a check is unresolved, or after the end or a block.
        """
        self._require_open("flush")
        if not any(text for text, _ in self._held):
            self._held.clear()
            self._held_tokens = 0
            return None
        return self._ask(len(self._held))

    def resolve(self, check: Check, verdict: Verdict) -> str:
        """Apply the checker's verdict on ``check``.

        Returns:
            ``check.release`` when allowed (it is released now), else ``""``:
            the held text is dropped and will never be released.

        Raises:
            RuntimeError: ``check`` is not the one awaiting a verdict.
        """
        if check is not self._pending:
            raise RuntimeError("HoldBack.resolve: this check is not the one awaiting a verdict")
        self._pending = None
        if not verdict.allowed:
            self._blocked = verdict
            self._held.clear()
            self._held_tokens = 0
            return ""
        for _ in range(check._entries):
            self._held_tokens -= self._held.popleft()[1]
        self._released += check.release
        return check.release

    def _ask(self, entries: int) -> Check:
        window = self.held
        release = "".join(self._held[i][0] for i in range(entries))
        self._pending = Check(self._released, window, release, entries=entries)
        return self._pending

    def _require_open(self, move: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"HoldBack.{move}: the last check awaits its verdict (call resolve)")
        if self._blocked is not None:
            raise RuntimeError(f"HoldBack.{move} after a block ({self._blocked.reason})")
        if self._ended:
            raise RuntimeError(f"HoldBack.{move} after end()")
