"""Values that count how a template reads them, for the capability probes
(:mod:`~ringserve.formats.template.caps`). llama.cpp renders a template on canned requests with
every input value counting its uses (a lookup, a filter, a test, a loop over it:
``value_t::stats_t``) and reads the template's capabilities off those counts (``jinja::caps_get``).
The probe values below count the same uses under jinja2: lookups through the environment's
getattr/getitem, filters and tests through wrappers, and the uses of a value held in a local
variable through its own methods."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

from ringserve.formats.template.base import Json


@attrs.define
class Uses:
    """The uses of one probe value: ``used``, and llama.cpp's names of some operations."""

    used: bool = False
    ops: set[str] = attrs.Factory(set)


@attrs.define
class ProbeRun:
    """Shared by one probe's values: inside a filter, a loop over a value is the filter's."""

    in_filter: int = 0


class ProbeStr(str):
    uses: Uses
    run: ProbeRun

    def __new__(cls, value: str, run: ProbeRun) -> ProbeStr:
        self = super().__new__(cls, value)
        self.uses = Uses()
        self.run = run
        return self

    def _use(self) -> str:
        self.uses.used = True
        return str.__str__(self)

    def __str__(self) -> str:
        return self._use()

    def __add__(self, other: str) -> str:
        return self._use() + other

    def __radd__(self, other: str) -> str:
        return other + self._use()

    def __eq__(self, other: object) -> bool:
        return self._use() == other

    def __ne__(self, other: object) -> bool:
        return self._use() != other

    __hash__ = str.__hash__

    def __len__(self) -> int:
        return len(self._use())

    def __contains__(self, item: object) -> bool:
        return item in self._use()  # type: ignore[operator]

    def __iter__(self) -> Iterator[str]:
        text = self._use()
        if not self.run.in_filter:  # a for loop over a string, which fails in llama.cpp
            self.uses.ops.add("array_access")
            raise TypeError("Expected iterable or object type in for loop: got String")
        return iter(text)

    def __getitem__(self, key: Any) -> str:
        return self._use()[key]


class ProbeList(list[Any]):
    uses: Uses
    run: ProbeRun

    def __init__(self, items: Iterable[Any], run: ProbeRun) -> None:
        super().__init__(items)
        self.uses = Uses()
        self.run = run

    def __iter__(self) -> Iterator[Any]:
        self.uses.used = True
        if not self.run.in_filter:
            self.uses.ops.add("array_access")
        return super().__iter__()

    def __len__(self) -> int:
        self.uses.used = True
        return super().__len__()


class ProbeDict(dict[str, Any]):
    uses: Uses
    run: ProbeRun

    def __init__(self, items: Mapping[str, Any], run: ProbeRun) -> None:
        super().__init__(items)
        self.uses = Uses()
        self.run = run

    def __iter__(self) -> Iterator[str]:
        self.uses.used = True
        return super().__iter__()

    def __len__(self) -> int:
        self.uses.used = True
        return super().__len__()


Probe = ProbeStr | ProbeList | ProbeDict


def probe_value(value: Json, run: ProbeRun) -> Json:
    if isinstance(value, str):
        return ProbeStr(value, run)
    if isinstance(value, list):
        return ProbeList((probe_value(v, run) for v in value), run)
    if isinstance(value, dict):
        return ProbeDict({k: probe_value(v, run) for k, v in value.items()}, run)
    return value


def use(value: object, op: str | None = None, deep: bool = False) -> None:
    if isinstance(value, Probe):
        value.uses.used = True
        if op:
            value.uses.ops.add(op)
        if deep and isinstance(value, (ProbeList, ProbeDict)):
            for item in list.__iter__(value) if isinstance(value, list) else dict.values(value):
                use(item, deep=True)
