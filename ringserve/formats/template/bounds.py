"""Bounds on one render of a chat template: the steps it takes (time) and the memory it holds.

A GGUF's chat template is code the server runs on every request, and at load on llama.cpp's
capability probes. jinja2's sandbox keeps it away from Python's internals, not from loops that do
not end or text that fills the memory (issue 43: a string doubled 40 times, nested
``range(100000)`` loops, ``'x' * 100000000``, 300 MB written for one user message). A render runs
on a worker thread, which cannot be killed, so it stops itself: the sandbox's hooks
(``environment.py``) charge one :class:`Budget` per render, which raises
:class:`RenderBoundError` past either bound.

- **Steps** (time): an iteration of a loop, a call (a macro, a method, a filter, a recursive
  ``loop(...)``), an operator; and the work on text, a step per :data:`BYTES_PER_STEP` bytes that
  an operation makes, copies or scans (about the time of a loop's iteration), and a step per
  member of a container that is written out, compared or searched (``==`` and ``in`` of two
  containers shaped alike compare every member: a list holding itself 40 levels deep is 2**40
  comparisons).
- **Memory** (bytes, as ``sys.getsizeof`` counts them): what the render made and still holds.
  Each string, list, tuple and dict that an operator, a literal, a filter, a method, a macro or a
  block makes is a copy of a type made for the render (:class:`Budget`) that counts its bytes
  while it lives and gives them back when it is freed; the text written so far counts too. An
  operation whose result would not fit is refused before it runs, from a size worked out from
  its operands (``'x' * n``, ``center(n)``, a ``%`` or ``format`` width, ``join``, ``replace``,
  ``indent``, a container written out).

:meth:`RenderBounds.of` sizes the bounds from the request, so that no real template comes near
them. The templates real models ship (the 70 of llama.cpp's ``models/templates``) are quadratic
at worst: Gemma 4 and Command R7B look back over the earlier turns at each turn (half a step per
pair of messages), Reka Edge adds each turn to a text it keeps, LFM2 each tool (each copies the
text so far once per item); on requests of 1 to 400 turns and 0 to 360 tools (Claude Code's,
copied), of up to 1.8 MB, none took more than 22 % of its steps nor held more than 25 % of its
memory (``bench/template_render.py`` times the bounds' cost).
"""

from __future__ import annotations

import re
import string
import sys
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import attrs
import jinja2.utils

from ringserve.formats.template.base import Json

#: Steps every render may take, whatever its request.
STEPS_BASE = 1_000_000
#: Steps more per pair of the request's items (its messages and tools).
STEPS_PER_ITEM_PAIR = 2
#: Steps more per JSON value of the request: each string, number, list, object...
STEPS_PER_VALUE = 16
#: Steps more per item of the request per KiB of the text of its strings.
STEPS_PER_ITEM_KIB = 1
#: Bytes every render may hold, whatever its request.
MEMORY_BASE = 16 * 1024 * 1024
#: Bytes more per character of the request's strings.
MEMORY_PER_CHAR = 16
#: Work on text is a step per this many bytes made, copied or scanned (``2**_STEP_BITS``).
BYTES_PER_STEP = 4096
_STEP_BITS = 12
#: Members of a container a step looks at, in a search or a copy.
MEMBERS_PER_STEP = 64
#: Strings shorter than this the render makes are not copied to count them (:meth:`Budget.made`):
#: the containers and blocks that hold one count it instead.
SHORT = 256
#: The most bits an integer the template computes may have (``**`` and ``*`` on integers are
#: refused beyond: their time grows faster than their size).
INT_BITS = 65_536


class RenderBoundError(Exception):
    """A render went past one of its bounds: ``str(error)`` says which, in one line."""


@attrs.frozen
class RenderBounds:
    """The bounds of one render: ``steps`` (see the module docstring) and ``memory`` in bytes."""

    steps: int
    memory: int

    @classmethod
    def of(cls, values: Iterable[Json], items: int) -> RenderBounds:
        """The bounds of a render of ``values`` (the template's variables from the request: the
        messages, the tools, the kwargs) holding ``items`` messages and tools:
        :data:`STEPS_BASE`, :data:`STEPS_PER_ITEM_PAIR` per pair of items, :data:`STEPS_PER_VALUE`
        per JSON value and :data:`STEPS_PER_ITEM_KIB` per item per KiB of text; :data:`MEMORY_BASE`
        and :data:`MEMORY_PER_CHAR` per character of its strings."""
        count, chars = 0, 0
        stack = list(values)
        while stack:
            value = stack.pop()
            count += 1
            if isinstance(value, str):
                chars += str.__len__(value)
            elif isinstance(value, dict):
                stack.extend(dict.keys(value))
                stack.extend(dict.values(value))
            elif isinstance(value, (list, tuple)):
                stack.extend(value)
        steps = (STEPS_BASE + STEPS_PER_ITEM_PAIR * items * items + STEPS_PER_VALUE * count
                 + STEPS_PER_ITEM_KIB * items * chars // 1024)
        return cls(steps, MEMORY_BASE + MEMORY_PER_CHAR * chars)


_BUDGET: ContextVar[Budget | None] = ContextVar("ringserve_render_budget", default=None)


@contextmanager
def bounded(bounds: RenderBounds) -> Iterator[Budget]:
    """Render under ``bounds`` inside the ``with`` block (on the calling thread): the sandbox's
    hooks charge the budget it yields."""
    budget = Budget(bounds)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def current() -> Budget:
    """The budget of the render running on this thread.

    Raises:
        RenderBoundError: no render is running: jinja2 is folding a constant while it compiles
            the template, which it then leaves to the render.
    """
    budget = _BUDGET.get()
    if budget is None:
        raise RenderBoundError("not inside a bounded render")
    return budget


_getsizeof = sys.getsizeof


class MadeStr(str):
    """A string a render made (:meth:`Budget.made`): it gives its bytes back to its render when freed."""

    __slots__ = ()


class MadeList(list[Any]):
    """A list a render made (:meth:`Budget.made`)."""

    __slots__ = ("held",)
    #: The bytes it counts.
    held: int


class MadeDict(dict[Any, Any]):
    """A dict a render made (:meth:`Budget.made`)."""

    __slots__ = ("held",)
    #: The bytes it counts.
    held: int


class MadeTuple(tuple[Any, ...]):
    """A tuple a render made (:meth:`Budget.made`)."""

    __slots__ = ()


_MADE = (MadeStr, MadeList, MadeDict, MadeTuple)


_MadeTypes = tuple[type[MadeStr], type[MadeList], type[MadeTuple], type[MadeDict], type[MadeList]]


def _made_types(budget: Budget) -> _MadeTypes:
    """The types of what one render makes, each giving its bytes back to ``budget`` when freed."""

    class Str(MadeStr):
        __slots__ = ()

        def __del__(self) -> None:
            budget.live -= _getsizeof(self)

    class Tuple(MadeTuple):
        __slots__ = ()

        def __del__(self) -> None:
            budget.live -= _getsizeof(self)

    class List(MadeList):
        __slots__ = ()

        def __del__(self) -> None:
            budget.live -= self.held

    class Dict(MadeDict):
        __slots__ = ()

        def __del__(self) -> None:
            budget.live -= self.held

    class Buffer(MadeList):
        """A block's output (a macro, ``{% set %}...{% endset %}``, ``{% filter %}``) until it
        is joined: 8 bytes a piece."""

        __slots__ = ()

        def append(self, piece: Any) -> None:
            size = 8 + _getsizeof(piece) if type(piece) is str and len(piece) < SHORT else 8
            self.held += size
            budget.live += size
            if budget.live > budget.memory:
                budget.hold(0)
            list.append(self, piece)

        def extend(self, pieces: Iterable[Any]) -> None:
            pieces = tuple(pieces)
            size = sum(8 + _getsizeof(p) if type(p) is str and len(p) < SHORT else 8 for p in pieces)
            self.held += size
            budget.hold(size)
            list.extend(self, pieces)

        def __del__(self) -> None:
            budget.live -= self.held

    return Str, List, Tuple, Dict, Buffer


class Budget:
    """One render's steps left and bytes held (see the module docstring); made by :func:`bounded`."""

    def __init__(self, bounds: RenderBounds) -> None:
        self.bounds = bounds
        #: Steps left.
        self.steps = bounds.steps
        #: Bytes held, and the most that may be.
        self.live = 0
        self.memory = bounds.memory
        self.Str, self.List, self.Tuple, self.Dict, self.Buffer = _made_types(self)

    def step(self, n: int = 1) -> None:
        """Take ``n`` steps.

        Raises:
            RenderBoundError: the render has taken all its steps.
        """
        self.steps -= n
        if self.steps < 0:
            raise RenderBoundError(
                f"took more than its {self.bounds.steps:,} steps (loop iterations, calls, and work on text)"
            )

    def reserve(self, size: int) -> None:
        """About to make about ``size`` bytes: a step per :data:`BYTES_PER_STEP`.

        Raises:
            RenderBoundError: they would not fit in the memory bound, or out of steps.
        """
        self.steps -= size >> _STEP_BITS
        if self.live + size > self.memory or self.steps < 0:
            self.check(size)
            self.step(0)

    def check(self, size: int) -> None:
        """Whether ``size`` bytes more would fit.

        Raises:
            RenderBoundError: they would not.
        """
        if self.live + size > self.memory:
            self._too_big()

    def hold(self, size: int) -> None:
        """``size`` bytes more are held.

        Raises:
            RenderBoundError: past the memory bound.
        """
        self.live += size
        if self.live > self.memory:
            self._too_big()

    def _too_big(self) -> None:
        raise RenderBoundError(f"would hold more than its {self.bounds.memory / 2**20:,.1f} MiB of memory")

    def buffer(self) -> list[Any]:
        """A new block buffer, counting 8 bytes a piece (and a short string's)."""
        buffer = self.Buffer()
        buffer.held = 0
        return buffer

    def made(self, value: Any) -> Any:
        """``value``, the result of an operation of the template, counted while it lives: a
        string (of :data:`SHORT` characters or more), list, tuple or dict as a copy of the
        render's own type (anything else, and what the render already counts or the request
        holds, as it is).

        Raises:
            RenderBoundError: past the memory bound, or an integer of more than :data:`INT_BITS` bits.
        """
        kind = type(value)
        if kind is str:
            if len(value) < SHORT:
                return value
            value = self.Str(value)
            size = _getsizeof(value)
            self.steps -= size >> _STEP_BITS
            self.live += size
            if self.live > self.memory or self.steps < 0:
                self.step(0)
                self.hold(0)
        elif kind is list:
            value = self.List(value)
            value.held = 0
            self.grew(value, list.__iter__(value))
        elif kind is dict:
            value = self.Dict(value)
            value.held = 0
            self.grew(value, (member for pair in dict.items(value) for member in pair))
        elif kind is tuple:
            value = self.Tuple(value)
            self.step(len(value) // MEMBERS_PER_STEP)
            self.hold(_getsizeof(value))
        elif kind is int and value.bit_length() > INT_BITS:
            raise RenderBoundError(f"made an integer of more than {INT_BITS:,} bits")
        return value

    def grew(self, container: Any, added: Iterable[Any], before: int = 0) -> None:
        """A list or dict the render made (:meth:`made`), of ``before`` bytes, took the members
        ``added`` (keys and values of a dict): count its bytes again, and those of the members
        that nothing else counts (numbers, namespaces...)."""
        size = _getsizeof(container) - before
        count = 0
        for member in added:
            size += self._own(member)
            count += 1
        self.step(count // MEMBERS_PER_STEP)
        container.held += size
        self.hold(size)

    def _own(self, member: Any) -> int:
        """The bytes of a container's member that its container must count: none for the strings
        and containers the render counts, or the request holds, or the template's source (a
        string of :data:`SHORT` characters or more that is no :class:`MadeStr`); a plain
        container's and any other object's."""
        if type(member) is str:
            return 8 + _getsizeof(member) if len(member) < SHORT else 8
        if isinstance(member, (str, *_MADE)):
            return 8
        kind = type(member)
        if kind is tuple:
            return 8 + sum(self._own(m) for m in member)
        if kind in (list, dict):
            members = dict.items(member) if kind is dict else member
            return _getsizeof(member) + sum(self._own(m) for m in members)
        if isinstance(member, (list, dict, tuple)):  # the request's (read-only, or the probe's)
            return 8
        if isinstance(member, jinja2.utils.Namespace):
            return 8 + _getsizeof(member) + _getsizeof(member._Namespace__attrs)
        return 8 + _getsizeof(member)

    def text_size(self, value: Any, indent: int = 0) -> int:
        """About how many characters ``value`` is when written out (``str``, or ``tojson`` with
        ``indent``): strings at their length, containers a step per member.

        Raises:
            RenderBoundError: out of steps, or more characters than the memory bound has bytes left.
        """
        if isinstance(value, str):
            return str.__len__(value)
        return self._walk(value, indent, self.memory - self.live)

    def weigh(self, value: Any) -> None:
        """Take the steps that comparing, hashing or searching ``value`` takes: a step per
        member of a container (each time it is held: shared members as often as they are),
        per :data:`BYTES_PER_STEP` of a string.

        Raises:
            RenderBoundError: out of steps.
        """
        if isinstance(value, _CONTAINERS) or isinstance(value, _WALKED):
            self._walk(value, 0, None)
        else:
            self.step(weight(value))

    def _walk(self, value: Any, indent: int, room: int | None) -> int:
        """The characters of ``value`` written out, walking its members (the way the built-in
        types read them, so that a probe value (``probe.py``) does not count a use), a step each."""
        total = 0
        stack: list[tuple[Any, int]] = [(value, 1)]
        while stack:
            item, depth = stack.pop()
            self.step()
            pad = indent * depth + 1 if indent else 0
            if isinstance(item, str):
                total += str.__len__(item) + 2
            elif isinstance(item, dict):
                total += 2 + dict.__len__(item) * (4 + pad)
                stack.extend((member, depth + 1) for pair in dict.items(item) for member in pair)
            elif isinstance(item, (list, tuple)):
                members = list.__iter__(item) if isinstance(item, list) else tuple.__iter__(item)
                total += 2 + len(item) * (2 + pad)
                stack.extend((member, depth + 1) for member in members)
            elif isinstance(item, (KeysView, ValuesView, ItemsView)):
                total += 16
                stack.extend((member, depth) for member in item)
            elif isinstance(item, jinja2.utils.Namespace):
                total += 16
                stack.append((item._Namespace__attrs, depth))
            elif isinstance(item, int) and not isinstance(item, bool):
                total += item.bit_length() // 3 + 2
            else:
                total += 64
            if room is not None and total > room:
                self._too_big()
        return total


_CONTAINERS = (list, tuple, dict)
_WALKED = (KeysView, ValuesView, ItemsView, jinja2.utils.Namespace)


def weight(value: Any) -> int:
    """The steps of reading ``value`` once: of a text, one per :data:`BYTES_PER_STEP`; of a
    container, one per :data:`MEMBERS_PER_STEP` members (read as the built-in types read them)."""
    if isinstance(value, str):
        return str.__len__(value) // BYTES_PER_STEP
    if isinstance(value, bytes):
        return len(value) // BYTES_PER_STEP
    if isinstance(value, list):
        return list.__len__(value) // MEMBERS_PER_STEP
    if isinstance(value, dict):
        return dict.__len__(value) // MEMBERS_PER_STEP
    if isinstance(value, tuple):
        return len(value) // MEMBERS_PER_STEP
    return 0


class Steps:
    """What a loop goes over, a step per item; its length is the items' (``loop.length``)."""

    __slots__ = ("_budget", "_items")

    def __init__(self, items: Any, budget: Budget) -> None:
        self._items = items
        self._budget = budget

    def __iter__(self) -> Iterator[Any]:
        budget = self._budget
        for item in self._items:
            budget.steps -= 1
            if budget.steps < 0:
                budget.step(0)
            yield item

    def __len__(self) -> int:
        return len(self._items)


# -- what an operation will make, in bytes (a character counts one; Budget.made counts what was made) --


def _count(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _bytes(value: Any) -> int:
    """The bytes of a string, or of the references a list or tuple holds (each member it holds)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    return 64 + 8 * len(value)


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def binop_size(budget: Budget, operator: str, left: Any, right: Any) -> int:
    """The bytes ``left <operator> right`` makes (a jinja2 binary operator).

    Raises:
        RenderBoundError: an integer of more than :data:`INT_BITS` bits.
    """
    sequences = (str, bytes, list, tuple)
    if operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        return _bytes(left) + _bytes(right)
    if operator == "*":
        if isinstance(left, sequences) and isinstance(right, int):
            return _bytes(left) * max(right, 0)
        if isinstance(right, sequences) and isinstance(left, int):
            return _bytes(right) * max(left, 0)
        if isinstance(left, int) and isinstance(right, int):
            return _int_size(left.bit_length() + right.bit_length())
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return _int_size(max(left.bit_length() - 1, 1) * right)
    if operator == "%" and isinstance(left, (str, bytes)):
        return percent_size(budget, left, right)
    return 0


def _int_size(bits: int) -> int:
    if bits > INT_BITS:
        raise RenderBoundError(f"would make an integer of more than {INT_BITS:,} bits")
    return bits // 8


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_DIGITS = re.compile(r"\d+")


def percent_size(budget: Budget, fmt: str | bytes, args: Any) -> int:
    """The characters ``fmt % args`` makes, at most: the format, and for each conversion its
    width and precision (a ``*`` taking the largest integer argument) and the longest argument."""
    if isinstance(args, Mapping):
        values = list(args.values())
    else:
        values = list(args) if isinstance(args, tuple) else [args]
    longest = max((budget.text_size(v) for v in values), default=0)
    star = max((v for v in values if isinstance(v, int)), default=0)
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    size = len(text)
    for match in _PERCENT_SPEC.finditer(text):
        for number in match.group(1, 2):
            size += star if number == "*" else int(number or 0)
        size += longest
    return size


def format_size(budget: Budget, fmt: str, args: Iterable[Any], kwargs: Mapping[str, Any]) -> int:
    """The characters ``fmt.format(*args, **kwargs)`` makes, at most: the format, and for each
    field the numbers in its format spec (its width and precision; a nested field the largest
    integer argument) and the longest argument."""
    values = [*args, *kwargs.values()]
    longest = max((budget.text_size(v) for v in values), default=0)
    star = max((v for v in values if isinstance(v, int)), default=0)
    size = len(fmt)
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is not None:
            spec = spec or ""
            size += longest + sum(int(d) for d in _DIGITS.findall(spec)) + star * spec.count("{")
    return size


# The filters whose result can be far larger than their operands (jinja2 3.1's signatures, less
# the context, eval context or environment some take first).


def _center(budget: Budget, value: Any, width: int = 80) -> int:
    return max(budget.text_size(value), _int(width))


def _indent(budget: Budget, s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> int:
    size = budget.text_size(s)
    lines = s.count("\n") + 1 if isinstance(s, str) else size + 1
    return size + lines * (len(width) if isinstance(width, str) else _int(width))


def _wordwrap(budget: Budget, s: Any, width: int = 79, break_long_words: bool = True,
              wrapstring: str | None = None, break_on_hyphens: bool = True) -> int:
    size = budget.text_size(s)
    lines = 2 * size // max(_int(width), 1) + (s.count("\n") if isinstance(s, str) else 0) + 2
    return size + lines * len(wrapstring or "\n")


def _replace(budget: Budget, s: Any, old: Any, new: Any, count: int | None = None) -> int:
    size = budget.text_size(s)
    old_size, new_size = budget.text_size(old), budget.text_size(new)
    if old_size == 0:
        found = size + 1
    else:
        found = s.count(old) if isinstance(s, str) and isinstance(old, str) else size
    if count is not None and _int(count) >= 0:
        found = min(found, _int(count))
    return size + found * max(new_size - old_size, 0)


def _join(budget: Budget, value: Any, d: Any = "", attribute: Any = None) -> int:
    items = list(value) if isinstance(value, Iterable) else []
    return sum(budget.text_size(item) for item in items) + max(len(items) - 1, 0) * budget.text_size(d)


def _format(budget: Budget, value: Any, *args: Any, **kwargs: Any) -> int:
    return percent_size(budget, str(value) if not isinstance(value, str) else value, kwargs or args)


def _batch(budget: Budget, value: Any, linecount: int, fill_with: Any = None) -> int:
    return 64 + 8 * (_count(value) + (_int(linecount) if fill_with is not None else 0))


def _slice(budget: Budget, value: Any, slices: int, fill_with: Any = None) -> int:
    return 64 * _int(slices) + 8 * _count(value)


def _sum(budget: Budget, iterable: Any, attribute: Any = None, start: Any = 0) -> int:
    items = list(iterable) if isinstance(iterable, Iterable) else []
    if not isinstance(start, (list, tuple)) and not any(isinstance(i, (list, tuple)) for i in items):
        return 0
    total = _bytes(start) if isinstance(start, (list, tuple)) else 0
    for item in items:  # each + copies what came before
        total += _bytes(item) if isinstance(item, (list, tuple)) else 0
        budget.step(total // BYTES_PER_STEP)
    return total


def _tojson(budget: Budget, value: Any, ensure_ascii: bool = False, indent: Any = None,
            separators: Any = None, sort_keys: bool = False) -> int:
    pad = len(indent) if isinstance(indent, str) else _int(indent)
    return budget.text_size(value, pad) * (6 if ensure_ascii else 1)


def _pprint(budget: Budget, value: Any) -> int:
    return 2 * budget.text_size(value, 1)


def _urlize(budget: Budget, value: Any, trim_url_limit: Any = None, nofollow: bool = False,
            target: Any = None, rel: Any = None, extra_schemes: Any = None) -> int:
    size = budget.text_size(value)
    return 2 * size + (size // 4 + 1) * (48 + budget.text_size(target or "") + budget.text_size(rel or ""))


def _list(budget: Budget, value: Any) -> int:
    return 80 * len(value) if isinstance(value, str) else 40 * _count(value)


def _growing(factor: int) -> Callable[..., int]:
    def size(budget: Budget, value: Any, *args: Any, **kwargs: Any) -> int:
        return factor * budget.text_size(value)

    return size


#: The bytes a filter makes, at most, by its name, where it can make more than a few times its operands.
FILTER_SIZES: dict[str, Callable[..., int]] = {
    "center": _center, "indent": _indent, "wordwrap": _wordwrap, "replace": _replace, "join": _join,
    "format": _format, "batch": _batch, "slice": _slice, "sum": _sum, "tojson": _tojson, "pprint": _pprint,
    "urlize": _urlize, "list": _list, "xmlattr": _growing(6), "escape": _growing(5), "e": _growing(5),
    "forceescape": _growing(5), "urlencode": _growing(12), "upper": _growing(3), "lower": _growing(3),
    "title": _growing(3), "capitalize": _growing(3), "string": _growing(1), "safe": _growing(1),
    "trim": _growing(1), "striptags": _growing(1), "truncate": _growing(1), "wordcount": _growing(1),
}


def _dictsort(budget: Budget, value: Any, case_sensitive: bool = False, by: str = "key",
              reverse: bool = False) -> None:
    if by == "value":
        budget.weigh(value)
    else:
        for key in dict.keys(value) if isinstance(value, dict) else ():
            budget.weigh(key)


def _compared(budget: Budget, value: Any, *args: Any, **kwargs: Any) -> None:
    budget.weigh(value)


#: The filters that compare or hash the members of their operand, by their name: each takes the
#: steps of what it compares (``weigh(budget, value, *args, **kwargs)``).
COMPARING_FILTERS: dict[str, Callable[..., None]] = {
    "unique": _compared, "sort": _compared, "min": _compared, "max": _compared, "groupby": _compared,
    "dictsort": _dictsort,
}
#: The tests that compare their operands.
COMPARING_TESTS = frozenset({"==", "eq", "equalto", "!=", "ne", "<", "lt", "lessthan", "<=", "le", ">", "gt",
                             "greaterthan", ">=", "ge", "in"})


# The methods of strings, bytes and integers whose result can be far larger than their operands.


def _padded(budget: Budget, text: Any, width: int, *fill: Any) -> int:
    return max(len(text), _int(width))


def _expandtabs(budget: Budget, text: Any, tabsize: int = 8) -> int:
    tabs: int = text.count("\t" if isinstance(text, str) else b"\t")
    return len(text) + tabs * max(_int(tabsize), 0)


def _text_replace(budget: Budget, text: Any, old: Any, new: Any, count: int = -1) -> int:
    found = len(text) + 1 if not old else text.count(old)
    if _int(count) >= 0:
        found = min(found, _int(count))
    return len(text) + found * max(len(new) - len(old), 0)


def _text_join(budget: Budget, text: Any, items: Any) -> int:
    items = list(items)
    return sum(_count(item) for item in items) + max(len(items) - 1, 0) * len(text)


def _translate(budget: Budget, text: Any, table: Any) -> int:
    longest = max((_count(v) for v in table.values()), default=1) if isinstance(table, Mapping) else 1
    return len(text) * max(longest, 1)


def _split(budget: Budget, text: Any, sep: Any = None, maxsplit: int = -1) -> int:
    pieces = (len(text) + 1) // 2 + 1 if sep is None else text.count(sep) + 1 if sep else 1
    return len(text) + 64 * pieces


def _splitlines(budget: Budget, text: Any, keepends: bool = False) -> int:
    breaks = ("\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")
    if isinstance(text, str):
        lines: int = sum(text.count(c) for c in breaks)
    else:
        lines = text.count(b"\n") + text.count(b"\r")
    return len(text) + 64 * (1 + lines)


def _to_bytes(budget: Budget, number: int, length: int = 1, *args: Any, **kwargs: Any) -> int:
    return _int(length)


#: The bytes a method of a string or bytes (or an integer's ``to_bytes``) makes, at most, by its
#: name: ``size(budget, self, *args, **kwargs)``.
METHOD_SIZES: dict[str, Callable[..., int]] = {
    "center": _padded, "ljust": _padded, "rjust": _padded, "zfill": _padded, "expandtabs": _expandtabs,
    "replace": _text_replace, "join": _text_join, "translate": _translate, "split": _split, "rsplit": _split,
    "splitlines": _splitlines, "encode": lambda budget, text, *a, **k: 4 * len(text), "to_bytes": _to_bytes,
}
