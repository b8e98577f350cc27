"""EngineThread: calls in order on one thread at a time, results and errors back, never abandoned on cancel;
an idle thread ends, and with it llama.cpp's spinning OpenMP team."""

from __future__ import annotations

import os
import subprocess
import sys
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


async def test_an_idle_thread_ends_and_the_next_call_starts_one_never_two_at_once():
    """With ``idle_seconds`` the thread ends when idle (its OpenMP team with it) and comes back on a call."""
    t = EngineThread("retiring", idle_seconds=0.02)
    t.start()
    running = 0
    overlap: list[int] = []
    threads: list[threading.Thread] = []

    def job() -> None:
        nonlocal running
        running += 1
        overlap.append(running)
        threads.append(threading.current_thread())
        running -= 1

    with trio.fail_after(GUARD):
        await t.run(job)
        while t.ident is not None:  # retired after 20 ms without a call
            await trio.sleep(0.01)
        await t.run(job)
        assert t.ident is not None and threads[1] is not threads[0]  # (idents of ended threads are reused)
        # calls that race the retirement (submitted around the 20 ms mark) are never lost
        for i in range(60):
            await trio.sleep(0.02 * (i % 3) / 2)
            await t.run(job)
    assert len(threads) == 62 and max(overlap) == 1
    t.stop()
    t.join(GUARD)


@pytest.mark.model
def test_the_engine_s_openmp_threads_spin_while_the_decoding_thread_lives_and_stop_when_it_ends(tmp_path):
    """``ringserve.engine._native``'s spin count takes effect, and a thread's exit frees its team (why the thread retires).

    In a fresh process (so that ``ringserve.engine._native`` loads libgomp): one decode
    with 2 threads from a thread that then waits; the team's second thread
    spins (it never sleeps: runnable at every look, ``R`` in ``/proc/self/task/*/stat``)
    until the decoding thread exits, and then is gone or asleep. The states are sampled,
    not CPU time: on a loaded machine a spinning thread gets little CPU, but it stays runnable.
    """
    script = tmp_path / "spin.py"
    script.write_text(
        "import os, threading, time\n"
        "from ringserve.engine.llama import LlamaEngine\n"
        "from ringserve.engine.modelfile import default_model_path\n"
        "from ringserve.core.batch import SlotFeed\n"
        "from ringserve.core.events import SamplingParams\n"
        "from ringserve.core.sampling import LLAMA_SERVER_DEFAULTS, resolve_sampling\n"
        "assert 'GOMP_SPINCOUNT' not in os.environ  # set for the import only\n"
        "e = LlamaEngine(default_model_path(), n_slots=1, n_ctx=64, n_threads=2)\n"
        "done, leave = threading.Event(), threading.Event()\n"
        "ours = {threading.get_native_id()}\n"
        "def decode():\n"
        "    ours.add(threading.get_native_id())\n"
        "    e.begin(0, resolve_sampling(SamplingParams(temperature=0), LLAMA_SERVER_DEFAULTS))\n"
        "    e.decode([SlotFeed(0, tuple(e.tokenize('hi')), 0, True)])\n"
        "    done.set(); leave.wait()\n"
        "def states():  # each other thread's state letters, 20 looks over a second\n"
        "    seen = {}\n"
        "    for _ in range(20):\n"
        "        for tid in os.listdir('/proc/self/task'):\n"
        "            if int(tid) not in ours:\n"
        "                try:\n"
        "                    stat = open(f'/proc/self/task/{tid}/stat').read()\n"
        "                except FileNotFoundError:\n"
        "                    continue\n"
        "                seen[tid] = seen.get(tid, '') + stat.rsplit(')', 1)[1].split()[0]\n"
        "        time.sleep(0.05)\n"
        "    return ','.join(seen.values()) or '-'\n"
        "t = threading.Thread(target=decode); t.start(); done.wait()\n"
        "alive = states()\n"
        "leave.set(); t.join(); time.sleep(0.2)\n"
        "print(alive, states())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    alive, ended = out.stdout.split()
    # spinning: a thread of the team is runnable at every look; after the exit: none is ever running
    assert any(set(looks) == {"R"} for looks in alive.split(",")), alive
    assert "R" not in ended, ended


async def test_meanwhile_runs_on_the_trio_thread_while_the_call_runs(thread):
    started, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def call() -> str:
        started.set()
        release.wait(GUARD)
        return "done"

    def meanwhile() -> None:
        assert started.wait(GUARD)  # the call runs on its thread already
        seen.append(threading.get_ident() != thread.ident)
        release.set()

    with trio.fail_after(GUARD):
        assert await thread.run(call, meanwhile=meanwhile) == "done"
    assert seen == [True]


async def test_meanwhile_s_exception_is_raised_after_the_call_returned(thread):
    finished: list[str] = []

    def meanwhile() -> None:
        raise RuntimeError("from meanwhile")

    with trio.fail_after(GUARD), pytest.raises(RuntimeError, match="from meanwhile"):
        await thread.run(lambda: finished.append("call"), meanwhile=meanwhile)
    assert finished == ["call"]
