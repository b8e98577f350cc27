"""EngineThread: calls in order on one thread, results and errors back, never abandoned on cancel."""

from __future__ import annotations

import threading

import pytest
import trio

from ringserve.engine.thread import EngineThread

GUARD = 10


@pytest.fixture
def thread():
    t = EngineThread("test engine")
    t.start()
    yield t
    t.stop()
    t.join(GUARD)
    assert t._thread is not None and not t._thread.is_alive()


async def test_calls_run_in_order_on_one_thread_that_is_not_the_trio_thread(thread):
    seen: list[tuple[int, int]] = []

    def record(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * 10

    results: list[int] = []

    async def call(i: int) -> None:
        results.append(await thread.run(record, i))

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(call, i)
                await trio.testing.wait_all_tasks_blocked()  # call i has queued its job
    assert [i for i, _ in seen] == list(range(50))
    assert {ident for _, ident in seen} == {thread.ident} != {threading.get_ident()}
    assert sorted(results) == [i * 10 for i in range(50)]


async def test_the_call_s_exception_is_raised_in_the_caller(thread):
    def boom() -> None:
        raise ValueError("from the engine")

    with trio.fail_after(GUARD), pytest.raises(ValueError, match="from the engine"):
        await thread.run(boom)
    assert await thread.run(lambda: "still serving") == "still serving"


async def test_a_cancelled_caller_waits_for_its_call_which_is_never_abandoned(thread):
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []

    def blocking() -> str:
        entered.set()
        release.wait(GUARD)
        order.append("call ended")
        return "done"

    scope = trio.CancelScope()

    async def cancel_once_inside() -> None:
        await trio.to_thread.run_sync(entered.wait, GUARD)
        scope.cancel()
        await trio.sleep(0.05)  # the caller stays parked although cancelled
        order.append("released")
        release.set()

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_once_inside)
            with scope:
                await thread.run(blocking)
                order.append("caller went on")  # the result came back; the cancel lands at the next checkpoint
                await trio.lowlevel.checkpoint()
                order.append("unreachable")
    assert scope.cancelled_caught
    assert order == ["released", "call ended", "caller went on"]


async def test_a_caller_cancelled_before_submitting_submits_nothing(thread):
    ran: list[int] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        await thread.run(ran.append, 1)
    assert scope.cancelled_caught
    assert await thread.run(lambda: ran) == []


async def test_run_before_start_or_after_stop_is_an_error():
    t = EngineThread("never started")
    with pytest.raises(RuntimeError, match="never started is not running"):
        await t.run(print)
    t.start()
    with pytest.raises(RuntimeError, match="was started before"):
        t.start()
    t.stop()
    with pytest.raises(RuntimeError, match="is not running"):
        await t.run(print)
    t.stop()  # idempotent
    t.join(GUARD)
    assert t._thread is not None and not t._thread.is_alive()
