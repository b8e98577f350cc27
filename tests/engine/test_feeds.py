"""engine/protocol.py check_feeds: the rules of a decode batch, as values and on the fake engine
(tests/engine/test_engine_llama.py checks the same batches on llama.cpp)."""

from __future__ import annotations

import pytest

from ringserve.core.batch import SlotFeed
from ringserve.engine.fake import FakeEngine
from ringserve.engine.protocol import KVCacheFull, check_feeds
from tests.support.feeds import bad_batches, check_bad_batches
from tests.support.helpers import GREEDY

N_SLOTS, N_BATCH, N_CTX = 4, 16, 16
HELD = [5, 0, None, None]  # slot 0 holds 5 cells, slot 1 begun and empty, 2 and 3 not begun


def check(feeds):
    check_feeds(feeds, n_slots=N_SLOTS, n_batch=N_BATCH, n_ctx_seq=N_CTX, held=HELD)


@pytest.mark.parametrize(("words", "batch"), bad_batches(N_SLOTS, N_BATCH, 5, 7))
def test_a_batch_that_breaks_a_rule_is_a_value_error_naming_it(words, batch):
    with pytest.raises(ValueError, match=words):
        check(batch)


def test_a_batch_that_keeps_the_rules_passes():
    check([SlotFeed(0, (1,), 5, True), SlotFeed(1, (1,) * (N_BATCH - 1), 0, False)])
    check([SlotFeed(0, (1,) * (N_CTX - 5), 5, True)])  # exactly n_ctx_seq cells


def test_feeds_past_n_ctx_seq_are_kv_cache_full_naming_their_slots():
    with pytest.raises(KVCacheFull) as exc:
        check([SlotFeed(0, (1,) * (N_CTX - 4), 5, True), SlotFeed(1, (1,) * 3, 0, True)])
    assert exc.value.slots == (0,)


def test_the_fake_engine_keeps_the_rules():
    engine = FakeEngine(n_slots=N_SLOTS, n_batch=N_BATCH, n_ctx=N_SLOTS * N_CTX, n_ctx_seq=N_CTX)
    check_bad_batches(engine, [ord(c) for c in "hello"], ord("x"))


def test_a_slot_released_with_cells_kept_is_not_begun_on_the_fake_engine():
    engine = FakeEngine(n_slots=2)
    engine.begin(0, GREEDY)
    engine.decode([SlotFeed(0, (1, 2, 3), 0, False)])
    engine.release(0, keep=2)
    with pytest.raises(ValueError, match="begin"):
        engine.decode([SlotFeed(0, (4,), 2, False)])
    engine.begin(0, GREEDY, keep=2)
    engine.decode([SlotFeed(0, (4,), 2, False)])
    assert engine.kv_cells_used(0) == 3
