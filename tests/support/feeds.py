"""The batches that break a rule of ``engine/protocol.py``'s ``check_feeds``, for every engine's tests.

Each test sets an engine up the same way (:func:`set_up`: slot 0 begun and holding a prompt,
slot 1 begun and empty, slot 2 not begun) and checks that each batch of :func:`bad_batches`
raises ``ValueError`` naming its rule and decodes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from ringserve.core.batch import SlotFeed
from tests.support.helpers import GREEDY


def set_up(engine: Any, prompt: Sequence[int]) -> None:
    """Slot 0 begun and fed ``prompt``, slot 1 begun, slot 2 not begun (left released)."""
    engine.begin(0, GREEDY)
    engine.decode([SlotFeed(0, tuple(prompt), 0, False)])
    engine.begin(1, GREEDY)


def bad_batches(n_slots: int, n_batch: int, held: int, token: int) -> list[tuple[str, list[SlotFeed]]]:
    """(what the error says, batch) for each rule, on an engine :func:`set_up` with a prompt of
    ``held`` tokens."""
    t = (token,)
    return [
        ("n_batch", [SlotFeed(1, t * n_batch, 0, False), SlotFeed(0, t, held, True)]),
        ("slot must be", [SlotFeed(n_slots, t, 0, False)]),
        ("empty", [SlotFeed(1, (), 0, True)]),
        ("twice", [SlotFeed(1, t, 0, False), SlotFeed(1, t, 1, True)]),
        ("begin", [SlotFeed(2, t, 0, True)]),
        ("begin", [SlotFeed(1, t, 0, False), SlotFeed(2, t, 0, False)]),  # a prefill chunk too
        ("position", [SlotFeed(0, t, held + 5, True)]),  # a gap
        ("position", [SlotFeed(0, t, held - 1, True)]),  # over its own cells
        ("position", [SlotFeed(1, t, 0, False), SlotFeed(0, t, 0, True)]),  # from the start again
    ]


def check_bad_batches(engine: Any, prompt: Sequence[int], token: int) -> None:
    """Every batch of :func:`bad_batches` raises ``ValueError`` naming its rule, and nothing is decoded."""
    set_up(engine, prompt)
    cells = [engine.kv_cells_used(slot) for slot in range(engine.n_slots)]
    for words, batch in bad_batches(engine.n_slots, engine.n_batch, len(prompt), token):
        with pytest.raises(ValueError, match=words):
            engine.decode(batch)
        assert [engine.kv_cells_used(slot) for slot in range(engine.n_slots)] == cells, batch
    assert engine.decode([]) == []
