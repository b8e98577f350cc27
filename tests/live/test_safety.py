"""The output safety stage (issue 9): hold-back window, checkers, and what readers see.

Sans-I/O: :class:`HoldBack` and :class:`PatternChecker` fed by hand, one
token at a time, with random splits. Shell: :class:`SafetyGate` on hand-made
events, then behind the runner on the fake engine (split UTF-8 and stop
sequences). Over HTTP on the fake engine: a pattern in the middle of a
stream reaches no reader, live or resumed, nor the stored text; the stop
reason on both surfaces; a slow threaded classifier never stalls decoding;
window 0 streams byte for byte as without the stage; the hold-back shows in
the TTFT metric. No test sleeps: they wait on events, ``Runner.wait_idle()``
or the checker's own signals.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from ringserve.config import Config, EngineConfig, SafetyConfig
from ringserve.core.errors import ErrorKind
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    ChatMessage,
    Failure,
    Finish,
    GenerationRequest,
    SamplingParams,
    StopReason,
    Usage,
)
from ringserve.core.producer import Producer, Step
from ringserve.core.safety import Check, HoldBack, PatternChecker, Verdict, compile_patterns, load_checker
from ringserve.core.sse import SSEParser
from ringserve.engine.fake import DEFAULT_REPLY, FakeEngine
from ringserve.engine.runner import Runner
from ringserve.live.safety import InlineChecker, SafetySetupError, SafetyStage, ThreadedChecker
from tests.support import safety_checkers
from tests.support.server import fake_config, running_server
from tests.support.helpers import RecordingRenderer, anthropic_text, openai_text, sse_events
from bench.common import default_runner

GUARD = 20  # seconds: no test comes near this
ALLOW = Verdict.allow()
ASYNC = {"Prefer": "respond-async"}


# -- HoldBack: the window ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_each_token_leaves_once_n_more_arrived(n):
    tokens = list("abcdef")
    hb = HoldBack(n)
    for i, token in enumerate(tokens):
        check = hb.push(token, 1)
        if i < n:
            assert check is None
            continue
        assert check == Check(
            released="".join(tokens[: i - n]),
            window="".join(tokens[i - n : i + 1]),
            release=tokens[i - n],
            entries=1,
        )
        assert hb.resolve(check, ALLOW) == tokens[i - n]
        assert hb.held == "".join(tokens[i - n + 1 : i + 1])
    last = hb.end()
    rest = "".join(tokens[-n:])
    assert (last.released, last.window, last.release) == ("".join(tokens[:-n]), rest, rest)
    assert hb.resolve(last, ALLOW) == rest
    assert hb.released == "abcdef" and hb.held == ""


def test_tokens_not_deltas_fill_the_window():
    hb = HoldBack(2)
    assert hb.push("", 1) is None  # a token whose text an earlier stage holds back
    assert hb.push("ab", 2) is None  # the empty delta fell out: nothing to check
    check = hb.push("c", 1)
    assert (check.released, check.window, check.release) == ("", "abc", "ab")
    assert hb.resolve(check, ALLOW) == "ab"
    assert hb.push("d", 0) is None  # text released late carries no token
    assert hb.push("e", 1) is None
    check = hb.push("f", 1)
    assert (check.released, check.window, check.release) == ("ab", "cdef", "c")
    assert hb.resolve(check, ALLOW) == "c"
    assert hb.held == "def"


def test_end_with_only_empty_text_needs_no_check():
    hb = HoldBack(3)
    hb.push("", 1)
    hb.push("", 1)
    assert hb.end() is None
    assert hb.released == ""


def test_block_in_the_middle_releases_nothing_more():
    hb = HoldBack(2)
    released = []
    for token in "abc":
        check = hb.push(token, 1)
        if check is not None:
            released.append(hb.resolve(check, ALLOW))
    check = hb.push("d", 1)
    assert check.window == "bcd"
    assert hb.resolve(check, Verdict.block("rule 7")) == ""
    assert released == ["a"] and hb.released == "a" and hb.held == ""
    assert hb.blocked == Verdict(False, "rule 7")
    with pytest.raises(RuntimeError, match="rule 7"):
        hb.push("e", 1)
    with pytest.raises(RuntimeError):
        hb.end()


def test_block_at_the_end_releases_nothing_of_the_window():
    hb = HoldBack(3)
    for token in "abc":
        assert hb.push(token, 1) is None
    check = hb.end()
    assert check.window == check.release == "abc"
    assert hb.resolve(check, Verdict.block("no")) == ""
    assert hb.released == ""


def test_moves_out_of_order_are_errors():
    with pytest.raises(ValueError):
        HoldBack(0)
    hb = HoldBack(1)
    hb.push("a", 1)
    check = hb.push("b", 1)
    with pytest.raises(RuntimeError, match="resolve"):
        hb.push("c", 1)
    with pytest.raises(RuntimeError, match="resolve"):
        hb.end()
    with pytest.raises(ValueError):
        HoldBack(1).push("x", -1)
    stale = Check("", "b", "b", entries=1)
    with pytest.raises(RuntimeError, match="not the one"):
        hb.resolve(stale, ALLOW)
    hb.resolve(check, ALLOW)
    with pytest.raises(RuntimeError, match="not the one"):
        hb.resolve(check, ALLOW)  # a verdict counts once


def _split(rng: random.Random, text: str) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        k = rng.choice([0, 0, 1, 1, 2, 3, 4])
        pieces.append(text[i : i + k])
        i += k
    return pieces


def test_random_splits_release_the_text_and_never_a_match():
    rng = random.Random(9)
    checker = PatternChecker(["XYZ"])
    for _ in range(400):
        n = rng.randint(1, 6)
        filler = "".join(rng.choice("abcXY é😀") for _ in range(rng.randint(0, 40)))
        text = filler.replace("XYZ", "") + ("XYZ" + "tail" if rng.random() < 0.7 else "")
        pieces = _split(rng, text)
        hb = HoldBack(n)
        out = []
        for piece in pieces:
            check = hb.push(piece, 1)
            if check is not None:
                out.append(hb.resolve(check, checker.check(check.released, check.window)))
            if hb.blocked:
                break
        else:
            check = hb.end()
            if check is not None:
                out.append(hb.resolve(check, checker.check(check.released, check.window)))
        released = "".join(out)
        assert released == hb.released and text.startswith(released)
        at = text.find("XYZ")
        if at < 0:
            assert released == text and hb.blocked is None
            continue
        assert hb.blocked is not None and "XYZ" not in released
        # tokens (one per piece) that hold the match's first and last characters
        ends = [sum(len(p) for p in pieces[: j + 1]) for j in range(len(pieces))]
        first = next(j for j, end in enumerate(ends) if end > at)
        last = next(j for j, end in enumerate(ends) if end >= at + 3)
        if last - first + 1 <= n + 1:
            assert len(released) <= at  # withheld whole


# -- PatternChecker -------------------------------------------------------------------------------


def test_pattern_checker_sees_across_the_window_edge_and_names_no_text():
    checker = PatternChecker(["never", "sec\\s*ret"])
    assert checker.check("", "all fine") == ALLOW
    verdict = checker.check("the sec", "ret is out")
    assert verdict == Verdict.block("matched safety pattern 1")
    assert "sec" not in verdict.reason
    assert PatternChecker([]).check("anything", "at all") == ALLOW


def test_pattern_checker_lookback_and_anchors():
    long_match = PatternChecker(["abc.*xyz"], lookback=5)
    assert long_match.check("abc" + "-" * 10, "xyz") == ALLOW  # began before the lookback
    assert PatternChecker(["abc.*xyz"], lookback=100).check("abc" + "-" * 10, "xyz").allowed is False
    anchored = PatternChecker(["^bad"])
    assert anchored.check("not ", "bad") == ALLOW  # ^ is the real start, not the window's
    assert anchored.check("", "bad ones").allowed is False
    assert PatternChecker(["(?i)forbidden"]).check("", "ForBidden").allowed is False


@pytest.mark.parametrize(
    "patterns, fragment",
    [
        (["("], "patterns[0] is not a valid"),
        (["ok", "a*"], "patterns[1] matches the empty string"),
        ([3], "patterns[0] must be a string"),
    ],
)
def test_bad_patterns_are_named(patterns, fragment):
    with pytest.raises((ValueError, TypeError), match=re.escape(fragment)):
        compile_patterns(patterns)


def test_load_checker_takes_functions_and_checker_objects():
    assert load_checker("tests.support.safety_checkers:recording") is safety_checkers.recording
    fn = load_checker("ringserve.core.safety:Verdict.allow")
    assert fn() == ALLOW
    for path, fragment in [
        ("tests.support.safety_checkers", "package.module:callable"),
        ("no_such_module_xyz:fn", "no_such_module_xyz"),
        ("tests.support.safety_checkers:nothing_here", "nothing_here"),
        ("tests.support.safety_checkers:GATE_GUARD", "neither"),
    ]:
        with pytest.raises((ValueError, TypeError), match=re.escape(fragment)):
            load_checker(path)


# -- config ---------------------------------------------------------------------------------------


def test_safety_table_from_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[safety]\nwindow_tokens = 4\npatterns = ["(?i)forbidden", "x\\\\d+"]\n'
        'checker = "tests.support.safety_checkers:recording"\n'
    )
    expected = SafetyConfig(4, ("(?i)forbidden", "x\\d+"), "tests.support.safety_checkers:recording")
    assert Config.from_toml(path).safety == expected
    assert Config().safety == SafetyConfig(0, (), "")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('[safety]\npatterns = ["("]\n', "patterns[0]"),
        ('[safety]\npatterns = "abc"\n', "patterns must be a list"),
        ("[safety]\nwindow_tokens = -1\n", "window_tokens"),
        ('[safety]\nchecker = "not a path"\n', "checker must look like"),
        ("[safety]\nwindow = 3\n", "window"),
    ],
)
def test_bad_safety_config_names_the_key(tmp_path, text, fragment):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        Config.from_toml(path)
    assert "[safety]" in str(info.value) and fragment in str(info.value)


def test_a_checker_is_imported_where_the_stage_is_built_not_by_the_config():
    config = SafetyConfig(2, (), "no_such_module_xyz:fn")  # only the name's shape is checked here
    with pytest.raises(SafetySetupError) as info:
        SafetyStage.from_config(config, max_threads=1)
    assert str(info.value) == "[safety] checker 'no_such_module_xyz:fn' cannot be loaded: No module named 'no_such_module_xyz'"


def test_stage_from_config(caplog):
    off = SafetyConfig(0, ("fox",), "tests.support.safety_checkers:recording")
    with caplog.at_level(logging.WARNING, logger="ringserve.safety"):
        assert SafetyStage.from_config(off, max_threads=2) is None
    assert "the safety stage is off" in caplog.text
    stage = SafetyStage.from_config(SafetyConfig(3, ("fox",), "tests.support.safety_checkers:recording"), max_threads=2)
    assert stage.window_tokens == 3
    assert [type(c) for c in stage.checkers] == [InlineChecker, ThreadedChecker]
    assert SafetyStage.from_config(SafetyConfig(2), max_threads=1).checkers == ()


# -- the hold-back in the producer, checkers asked as the hub asks them -------------------------

USAGE = Usage(5, 7)
TEXT = BlockStart(0, BlockKind.TEXT)


def pattern_stage(window: int, *patterns: str) -> SafetyStage:
    return SafetyStage(window, [InlineChecker(PatternChecker(patterns))])


def producer_for(stage: SafetyStage) -> Producer:
    return Producer("m", RecordingRenderer(), USAGE, flush_seconds=0, flush_tokens=1, persist_seconds=1e9,
                    window_tokens=stage.window_tokens)


async def screen(producer: Producer, stage: SafetyStage, event) -> Step:
    """One event through the producer, its checks awaited as ``Hub._pump`` does."""
    step = producer.event(event, USAGE, 0.0)
    while step.check is not None:
        try:
            verdict = await stage.judge(step.check)
        except Exception as exc:
            return producer.check_failed(type(exc).__name__, 0.0)
        step = producer.verdict(verdict, 0.0)
    return step


def released(producer: Producer) -> str:
    return producer.content[0].text if producer.content else ""


async def test_gate_releases_what_leaves_the_window_and_the_rest_at_the_block_stop():
    stage = pattern_stage(2, "bad")
    p = producer_for(stage)
    p.start(0.0)
    await screen(p, stage, TEXT)
    for text, tokens, out in [("a", 1, ""), ("b", 1, ""), ("cd", 1, "a"), ("e", 2, "abcd")]:  # two tokens push two out
        await screen(p, stage, BlockDelta(0, text, tokens))
        assert released(p) == out
    await screen(p, stage, BlockStop(0))
    assert released(p) == "abcde"
    finish = Finish(StopReason.STOP_SEQUENCE, Usage(5, 9), "STOP")
    step = await screen(p, stage, finish)
    assert step.end is not None and step.end.terminal == finish


async def test_gate_refuses_mid_stream_and_at_the_block_stop():
    stage = pattern_stage(2, "bad")
    p = producer_for(stage)
    p.start(0.0)
    for event in (TEXT, BlockDelta(0, "x", 1), BlockDelta(0, "b", 1), BlockDelta(0, "a", 1)):
        await screen(p, stage, event)
    assert released(p) == "x"
    step = await screen(p, stage, BlockDelta(0, "d", 1))
    assert step.end is not None and step.end.terminal == Finish(StopReason.REFUSAL, USAGE)

    stage = pattern_stage(4, "bad")
    p = producer_for(stage)
    p.start(0.0)
    for event in (TEXT, BlockDelta(0, "b", 1), BlockDelta(0, "a", 1), BlockDelta(0, "d", 1)):
        await screen(p, stage, event)
    step = await screen(p, stage, BlockStop(0))
    assert step.end is not None and step.end.terminal == Finish(StopReason.REFUSAL, USAGE) and released(p) == ""


async def test_gate_passes_failures_and_drops_the_unchecked_window():
    stage = pattern_stage(3, "bad")
    p = producer_for(stage)
    p.start(0.0)
    await screen(p, stage, TEXT)
    await screen(p, stage, BlockDelta(0, "held", 1))
    failure = Failure(ErrorKind.API_ERROR, "boom", USAGE, True)
    step = await screen(p, stage, failure)
    assert step.end is not None and step.end.terminal == failure and released(p) == ""


@pytest.mark.parametrize("fn", [safety_checkers.broken, safety_checkers.not_a_verdict])
async def test_a_failing_checker_fails_closed(fn):
    stage = SafetyStage(1, [ThreadedChecker(fn, max_threads=1)])
    p = producer_for(stage)
    p.start(0.0)
    await screen(p, stage, TEXT)
    await screen(p, stage, BlockDelta(0, "a", 1))
    step = await screen(p, stage, BlockDelta(0, "b", 1))
    assert step.end is not None
    failure = step.end.terminal
    assert isinstance(failure, Failure) and failure.kind is ErrorKind.API_ERROR and failure.retryable
    assert "safety check failed" in failure.message and released(p) == ""


async def test_threaded_checker_runs_off_the_trio_thread():
    safety_checkers.reset()
    stage = SafetyStage(1, [ThreadedChecker(safety_checkers.recording, max_threads=1)])
    p = producer_for(stage)
    p.start(0.0)
    await screen(p, stage, TEXT)
    await screen(p, stage, BlockDelta(0, "a", 1))
    await screen(p, stage, BlockDelta(0, "b", 1))
    assert released(p) == "a"
    [(released_before, window, thread)] = safety_checkers.CALLS
    assert (released_before, window) == ("", "ab") and thread != threading.get_ident()


# -- behind the runner: UTF-8 and stop-sequence hold-backs first -----------------------------------


class Recorder:
    """A Checker that records what it was shown and asks a PatternChecker."""

    def __init__(self, *patterns: str) -> None:
        self.inner = PatternChecker(patterns)
        self.seen: list[tuple[str, str]] = []

    def check(self, released: str, window: str) -> Verdict:
        self.seen.append((released, window))
        return self.inner.check(released, window)


@asynccontextmanager
async def runner_on(engine: FakeEngine):
    runner = Runner(engine, EngineConfig(slots=2))
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        with trio.fail_after(GUARD):
            yield runner
        nursery.cancel_scope.cancel()


async def through_gate(runner: Runner, stage: SafetyStage, text: str, stop: tuple[str, ...]):
    """One request's events through a producer as the hub does it: (released text, terminal)."""
    request = GenerationRequest((ChatMessage("user", "echo:" + text),), 200, SamplingParams(temperature=0), stop)
    p = producer_for(stage)
    p.start(0.0)
    async with runner.submit(await runner.prepare(request)) as gen:
        async for event in gen:
            step = await screen(p, stage, event)
            if step.end is not None:
                break  # a refusal: leaving the block cancels the generation
    assert step.end is not None
    return released(p), step.end.terminal


REPLY = "héllo 😀 wörld 👍🏽 ok STOP after"


async def test_composes_with_split_utf8_and_stop_sequences():
    recorder = Recorder("never")
    async with runner_on(FakeEngine(piece_bytes=1)) as runner:
        text, last = await through_gate(runner, SafetyStage(3, [InlineChecker(recorder)]), REPLY, ("STOP",))
    assert text == "héllo 😀 wörld 👍🏽 ok "
    assert isinstance(last, Finish) and (last.stop_reason, last.stop_sequence) == (StopReason.STOP_SEQUENCE, "STOP")
    assert recorder.seen
    for released, window in recorder.seen:  # whole characters, never the stop string
        assert "\ufffd" not in window and "STOP" not in released + window
        assert text.startswith(released + window)


async def test_a_multibyte_pattern_split_across_tokens_is_refused_and_the_slot_freed():
    async with runner_on(FakeEngine(piece_bytes=1)) as runner:
        text, last = await through_gate(runner, SafetyStage(6, [InlineChecker(Recorder("😀 w"))]), REPLY, ("STOP",))
        await runner.wait_idle()
        stats = runner.statistics()
    assert isinstance(last, Finish) and last.stop_reason is StopReason.REFUSAL
    assert "héllo ".startswith(text)  # nothing of the match, nor after it
    assert stats.cancels == 1 and stats.slots_busy == 0 and stats.kv_cells_used == 0


# -- over HTTP on the fake engine -------------------------------------------------------------------

PIECE = 3
PREFIX = " ".join(f"w{i}é" for i in range(40)) + " "
SUFFIX = " unsent" * 150
SECRET_REPLY = PREFIX + "FORBIDDEN" + SUFFIX


def safety_config(tmp_path, **safety):
    return fake_config(tmp_path, stream={"flush_ms": 0.0}, safety=safety)


def body(path: str, content: str, **extra) -> dict:
    messages = [{"role": "user", "content": content}]
    return {"model": "any", "max_tokens": 1000, "messages": messages, **extra}


def text_of(path: str, events) -> str:
    return anthropic_text(events) if path == "/v1/messages" else openai_text(events)


def stop_of(path: str, events) -> str:
    datas = [json.loads(e.data) for e in events if e.data != "[DONE]"]
    if path == "/v1/messages":
        assert events[-1].event == "message_stop"
        return next(d["delta"]["stop_reason"] for d in datas if d["type"] == "message_delta")
    assert events[-1].data == "[DONE]"
    return next(c["finish_reason"] for d in datas for c in d["choices"] if c["finish_reason"])


@pytest.mark.parametrize(
    "path, reason", [("/v1/messages", "refusal"), ("/v1/chat/completions", "content_filter")]
)
async def test_a_pattern_mid_stream_reaches_no_reader_and_is_never_stored(tmp_path, path, reason):
    window = 6
    config = safety_config(tmp_path, window_tokens=window, patterns=["FORBIDDEN"])
    async with running_server(config, piece_bytes=PIECE, step_seconds=0.002) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=GUARD) as client:
        live_resp, live, live_raw = await sse_events(
            client, "POST", path, json=body(path, "echo:" + SECRET_REPLY, stream=True)
        )
        assert live_resp.status_code == 200
        message_id = live_resp.headers["x-message-id"]
        resumed_resp, resumed, resumed_raw = await sse_events(
            client, "GET", f"/v1/messages/{message_id}/stream", headers={"Last-Event-ID": live[2].id}
        )
        _, replay, replay_raw = await sse_events(client, "GET", f"/v1/messages/{message_id}/stream")
        stored = (await client.get(f"/v1/messages/{message_id}")).json()
        whole = (await client.post(path, json=body(path, "echo:" + SECRET_REPLY))).json()
        await default_runner(state.hub).wait_idle()
        stats = default_runner(state.hub).statistics()

    text = text_of(path, live)
    # released: a prefix of the reply that stops before the match, and not much before it
    assert SECRET_REPLY.startswith(text) and len(text) <= len(PREFIX)
    assert len(text.encode()) >= len((PREFIX + "FORBIDDEN").encode()) - (window + 2) * PIECE
    for raw in (live_raw, resumed_raw, replay_raw):
        assert b"FORBIDDEN" not in raw and b"unsent" not in raw
    assert resumed_resp.status_code == 200 and resumed == live[3:]
    assert replay == live
    assert stop_of(path, live) == reason
    assert (stored["status"], stored["stop_reason"], stored["text"]) == ("complete", reason, text)
    reply_tokens = -(-len(SECRET_REPLY.encode()) // PIECE) + 1
    assert 0 < stored["usage"]["output_tokens"] < reply_tokens  # cancelled once refused
    if path == "/v1/messages":
        assert (whole["stop_reason"], whole["content"][0]["text"]) == (reason, text)
    else:
        choice = whole["choices"][0]
        assert (choice["finish_reason"], choice["message"]["content"]) == (reason, text)
    assert stats.cancels == 2 and stats.slots_busy == 0 and stats.kv_cells_used == 0


def normalised(raw: bytes, message_id: str) -> bytes:
    return re.sub(rb'"created":\d+', b'"created":0', raw.replace(message_id.encode(), b"ID"))


async def stream_bytes(config, path: str) -> tuple[bytes, object]:
    async with running_server(config, piece_bytes=PIECE) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=GUARD) as client:
        resp, _, raw = await sse_events(client, "POST", path, json=body(path, "hello", stream=True))
        return normalised(raw, resp.headers["x-message-id"]), state.hub.safety


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
async def test_window_zero_streams_byte_for_byte_as_without_the_stage(tmp_path, path):
    safety_checkers.reset()
    for name in "abc":
        (tmp_path / name).mkdir()
    without, _ = await stream_bytes(fake_config(tmp_path / "a", stream={"flush_ms": 0.0}), path)
    off = safety_config(tmp_path / "b", window_tokens=0, patterns=["fox"], checker="tests.support.safety_checkers:recording")
    with_zero, stage = await stream_bytes(off, path)
    assert stage is None and safety_checkers.CALLS == []
    assert "fox" in text_of(path, SSEParser().feed(with_zero))  # the pattern would have blocked
    assert with_zero == without
    # the comparison is sharp: holding text back changes the bytes
    held, stage = await stream_bytes(safety_config(tmp_path / "c", window_tokens=4), path)
    assert stage is not None and held != without
    assert text_of(path, SSEParser().feed(held)) == DEFAULT_REPLY


async def test_hold_back_shows_in_time_to_first_token(tmp_path):
    window, step = 8, 0.01
    config = safety_config(tmp_path, window_tokens=window)
    async with running_server(config, piece_bytes=PIECE, step_seconds=step) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=GUARD) as client:
        _, events, _ = await sse_events(client, "POST", "/v1/messages", json=body("/v1/messages", "hi", stream=True))
        ttft = state.metrics.registry.get_sample_value("ringserve_time_to_first_token_seconds_sum")
    assert anthropic_text(events) == DEFAULT_REPLY
    # the first text leaves with token window + 1: at least that many decode steps after the request
    assert ttft >= (window + 1) * step


async def test_a_slow_threaded_classifier_never_stalls_decoding(tmp_path):
    safety_checkers.reset()
    config = safety_config(tmp_path, window_tokens=2, checker="tests.support.safety_checkers:gated")
    try:
        async with running_server(config, piece_bytes=4) as state, \
                httpx.AsyncClient(base_url=state.urls[0], timeout=GUARD) as client:
            created = (await client.post("/v1/messages", json=body("/v1/messages", "hi"), headers=ASYNC)).json()
            await trio.to_thread.run_sync(safety_checkers.WAITING.wait, GUARD)  # the first check hangs
            await default_runner(state.hub).wait_idle()  # meanwhile the whole reply was decoded
            stats = default_runner(state.hub).statistics()
            assert stats.generated_tokens_total == FakeEngine(piece_bytes=4).reply_tokens("hi")
            status = (await client.get(f"/v1/messages/{created['id']}")).json()
            assert (status["status"], status["text"]) == ("generating", "")
            safety_checkers.GATE.set()
            _, events, _ = await sse_events(client, "GET", created["stream_url"])
        assert anthropic_text(events) == DEFAULT_REPLY and stop_of("/v1/messages", events) == "end_turn"
        assert all(thread != threading.get_ident() for *_, thread in safety_checkers.CALLS)
    finally:
        safety_checkers.GATE.set()


async def test_cancel_does_not_wait_for_a_hung_classifier(tmp_path):
    safety_checkers.reset()
    config = safety_config(tmp_path, window_tokens=2, checker="tests.support.safety_checkers:gated")
    try:
        async with running_server(config, piece_bytes=4) as state, \
                httpx.AsyncClient(base_url=state.urls[0], timeout=GUARD) as client:
            created = (await client.post("/v1/messages", json=body("/v1/messages", "hi"), headers=ASYNC)).json()
            await trio.to_thread.run_sync(safety_checkers.WAITING.wait, GUARD)
            with trio.fail_after(safety_checkers.GATE_GUARD / 2):
                cancelled = (await client.post(f"/v1/messages/{created['id']}/cancel")).json()
            assert (cancelled["status"], cancelled["stop_reason"], cancelled["text"]) == ("cancelled", "end_turn", "")
            assert not safety_checkers.GATE.is_set()  # the check is still hanging: it was abandoned
    finally:
        safety_checkers.GATE.set()


async def test_a_broken_classifier_ends_the_stream_with_an_in_band_error(tmp_path):
    config = safety_config(tmp_path, window_tokens=2, checker="tests.support.safety_checkers:broken")
    async with running_server(config, piece_bytes=4) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=GUARD) as client:
        resp, events, _ = await sse_events(client, "POST", "/v1/messages", json=body("/v1/messages", "hi", stream=True))
        stored = (await client.get(f"/v1/messages/{resp.headers['x-message-id']}")).json()
    assert events[-1].event == "error" and '"api_error"' in events[-1].data
    assert anthropic_text(events) == "" and (stored["status"], stored["text"]) == ("failed", "")


# -- the real model, through the official SDKs ------------------------------------------------------


@pytest.mark.model
async def test_real_model_refusal_through_the_official_sdks(tmp_path):
    """Greedy text without the stage; then a word from its middle as the pattern: refused before it."""
    import anthropic
    import openai

    from ringserve.engine.llama import LlamaLoader

    prompt = [{"role": "user", "content": "Name three colours."}]
    for name in "ab":
        (tmp_path / name).mkdir()
    small = {"engine": {"slots": 1, "ctx_per_slot": 512}, "stream": {"flush_ms": 0.0}}

    def sdk_texts(url: str) -> tuple[tuple[str, str | None], tuple[str, str | None]]:
        a = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        o = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with a.messages.stream(model="m", max_tokens=32, extra_body={"temperature": 0}, messages=prompt) as stream:
            a_text = "".join(stream.text_stream)
            a_stop = stream.get_final_message().stop_reason
        chunks = list(o.chat.completions.create(model="m", max_tokens=32, temperature=0, messages=prompt, stream=True))
        o_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        o_stop = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        return (a_text, a_stop), (o_text, o_stop)

    async with running_server(fake_config(tmp_path / "a", **small), engine_factory=LlamaLoader()) as state:
        (plain, _), (plain_openai, _) = await trio.to_thread.run_sync(sdk_texts, state.urls[0])
    assert plain == plain_openai
    words = [m for m in re.finditer(r"[A-Za-z]{4,}", plain) if m.start() > len(plain) // 3]
    assert words, plain
    word = words[0]
    config = fake_config(tmp_path / "b", **small, safety={"window_tokens": 4, "patterns": [re.escape(word.group())]})
    async with running_server(config, engine_factory=LlamaLoader()) as state:
        (a_text, a_stop), (o_text, o_stop) = await trio.to_thread.run_sync(sdk_texts, state.urls[0])
    assert (a_stop, o_stop) == ("refusal", "content_filter")
    assert a_text == o_text and plain.startswith(a_text) and len(a_text) <= word.start()
