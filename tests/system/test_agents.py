"""The pinned agents against ringserve, started with ``ringserve launch``, run their own tools for
real in a scratch folder and finish with text (issue 33, "Proof (CI)"; issue 36, item 7).

The model is the fake engine playing a script of model text, a turn per generation, its calls
in the generic ``<tool_call>`` syntax, which the runner's real parsers read: Codex CLI runs
``exec_command`` (a function), then its freeform ``apply_patch`` (a ``custom`` tool, which Codex
offers because ``ringserve launch`` gives it a model catalog; its call comes back as a
``custom_tool_call``), then says it is done; Claude Code runs ``Bash``, then ``Write``, then says
it is done. The files the tools wrote are checked.

Each first prompt takes 9 s to prefill, three times Codex's idle timer set here to 3 s (its
default is 300 s; it counts data events only, not SSE comments) with its stream retries off, so
that the turn fails unless the stream's keepalive events (``response.in_progress`` again, every
``heartbeat_interval`` = 1 s) keep it waiting; Claude Code (whose timer cannot go under 300 s:
docs/agents.md) reads the same silence broken by ``event: ping`` with its own parser.
``tests/live/test_hub.py`` plays a 400 s silence on the autojump clock.

Reasoning (issue 34, "the agents of the agents issue show thinking"): the model is then of the
Hermes family, its turns opening with a ``<think>`` block that the runner's real parser reads as
reasoning, a call, then text. Claude Code (``--output-format stream-json --verbose``) prints
both thinking blocks and Codex (``exec --json``) both ``reasoning`` items, with their text; the
second turn of each hands the first turn's reasoning back (a signed thinking block; a reasoning
item's ``encrypted_content``) and the engine gets it as that turn's reasoning, no request
answered an error and none had a block or item dropped (the fields reported ignored, logged by
the server).

Issue 43: Claude Code under ``--bare`` with a Claude model name (set up by hand, not launched),
whose per-turn control message has no content; and Codex through a response that fails in the
middle of its message once, which its retry answers whole.

Then one plain turn per agent on the real bundled model (SmolLM2-135M, 8,192 tokens of context per
slot), their prompts shrunk by their own options to fit it (:data:`CLAUDE_SMALL`,
:func:`codex_small`; docs/agents.md, "On the bundled model"). Neither agent sends a temperature,
so the defaults sample (llama-server's); at temperature 1 the 135M model rambled on in one reply of
five or more (to Claude Code's output cap, or for minutes to the end of the context for Codex,
which has no cap), and any sampling varies the reply, so the model's sampling defaults make them
greedy (``[model.sampling] temperature = 0``, :func:`model_server`): the same short reply every run.

Skipped where the agents are not installed (``npm ci --prefix .ci/agents``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from bench.common import metric_totals
from ringserve.core.events import Effort, GenerationRequest, Role
from ringserve.core.toolcalls import format_call
from ringserve.engine.fake import FakeEngine
from ringserve.engine.llama import LlamaLoader
from ringserve.engine.protocol import ChatPrompt, EngineError, Sampled, SlotFeed
from tests.support.capture_agents import BIN
from tests.support.server import fake_config, running_server

pytestmark = pytest.mark.skipif(not (BIN / "claude").exists() or not (BIN / "codex").exists(),
                                reason="the agents are not installed: npm ci --prefix .ci/agents")

PROMPT = "Write hi to f.txt with the shell, then create g.txt, then say done."
PATCH = "*** Begin Patch\n*** Add File: g.txt\n+written by apply_patch\n*** End Patch\n"
#: Per slot: Claude Code's first prompt is about 50,000 fake tokens (a byte each), Codex's 45,000.
CTX = 131072
#: Seconds the first prompt of each run takes to prefill (the turns after it come from the cache).
PREFILL_SECONDS = 9.0
CODEX_IDLE_MS = 3000


#: The bundled model's context per slot: all it was trained on (``n_ctx_train``).
MODEL_CTX = 8192
#: The system prompt both agents get on the bundled model, instead of their own (thousands of tokens).
SMALL_SYSTEM = "You are a helpful assistant. Answer in one short sentence."
#: Claude Code's options that shrink its first request from about 13,000 tokens to about 300: this
#: system prompt, no built-in tools, no MCP servers.
CLAUDE_SMALL = ("--system-prompt", SMALL_SYSTEM, "--tools", "", "--strict-mcp-config")
#: Claude Code's output cap (``max_tokens``; its default is 32,000): a reply that reaches it is
#: continued up to three times, then the turn fails.
CLAUDE_MAX_OUTPUT = 256


#: Where the Codex turn on the bundled model runs (see its test).
CODEX_SCRATCH = Path("/var/tmp/ringserve-codex-bundled-model")


def codex_small(instructions: Path) -> list[str]:
    """Codex's ``-c`` overrides that shrink its first request from about 7,900 tokens to about 2,500:
    ``instructions`` (a file) as its base instructions, no permissions or environment messages, no
    web search, and no goal, unified-exec or tool-search tools (its shell, ``apply_patch`` and
    others stay)."""
    return ["-c", f"model_instructions_file={json.dumps(str(instructions))}",
            "-c", "include_permissions_instructions=false", "-c", "include_environment_context=false",
            "-c", 'web_search="disabled"', "-c", "features.goals=false", "-c", "features.unified_exec=false",
            "-c", "features.tool_search=false"]


def script(*turns: str) -> Callable[[str], str]:
    """The model's turns in order, one per generation (the last one again past the end)."""
    played = iter(turns)
    last = turns[-1]

    def reply(_last_user_text: str) -> str:
        return next(played, last)

    return reply


class RecordingEngine(FakeEngine):
    """The fake engine, keeping every request whose prompt it renders (what each turn sent)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.requests: list[GenerationRequest] = []

    def tokenize_chat(self, request: GenerationRequest) -> ChatPrompt:
        self.requests.append(request)
        return super().tokenize_chat(request)


class FailingOnceEngine(RecordingEngine):
    """The recording engine whose first generation to reach ``fail_after_tokens`` tokens fails
    there (an engine error: a retryable ``response.failed`` mid-message, as a drain's); the
    generations after it do not."""

    def decode(self, feeds: Sequence[SlotFeed]) -> list[Sampled]:
        try:
            return super().decode(feeds)
        except EngineError:
            self.fail_after_tokens = None
            raise


def scripted_server(tmp_path: Path, reply: Callable[[str], str], *, prefill_seconds: float = PREFILL_SECONDS,
                    chat_format: str | None = None, engine: type[RecordingEngine] = RecordingEngine,
                    **engine_kwargs: Any) -> tuple[object, list[RecordingEngine]]:
    """An in-process server whose fake engine (an ``engine``, with ``engine_kwargs``) plays ``reply``
    (its calls as written, also under a lazy grammar; read with ``chat_format``'s parser), each first
    prompt prefilled for ``prefill_seconds``, a keepalive every second of silence; and the list that
    will hold its engine."""
    engines: list[RecordingEngine] = []

    def factory(_config: object) -> RecordingEngine:
        engines.append(engine(n_slots=2, n_ctx=2 * CTX, piece_bytes=8, reply=reply,
                              prefill_seconds=prefill_seconds, grammar_examples=False,
                              chat_format=chat_format, **engine_kwargs))
        return engines[0]

    config = fake_config(tmp_path, engine={"ctx_per_slot": CTX, "slots": 2}, server={"heartbeat_interval": 1.0})
    return running_server(config, engine_factory=factory), engines


async def launch(agent: str, url: str, scratch: Path, agent_args: list[str],
                 extra_env: dict[str, str] | None = None) -> trio.CompletedProcess[bytes]:
    """``ringserve launch AGENT --url URL -- AGENT_ARGS`` in ``scratch/work``, with its own HOME."""
    argv = [sys.executable, "-m", "ringserve", "launch", agent, "--url", url, "--", *agent_args]
    return await run_in(scratch, argv, extra_env)


async def run_in(scratch: Path, argv: list[str], extra_env: dict[str, str] | None = None) -> trio.CompletedProcess[bytes]:
    """``argv`` in ``scratch/work``, with its own HOME (and CODEX_HOME under it)."""
    home, work = scratch / "home", scratch / "work"
    home.mkdir()
    work.mkdir()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "HOME": str(home),
           "TERM": "dumb", "LANG": "C.UTF-8",
           "CODEX_HOME": str(home / ".codex"), **(extra_env or {})}
    (home / ".codex").mkdir()
    with trio.fail_after(240):
        return await trio.run_process(argv, cwd=work, env=env, capture_stdout=True, capture_stderr=True,
                                      check=False, stdin=b"")


async def test_codex_runs_exec_command_and_apply_patch_through_a_silence_then_says_done(tmp_path):
    """Codex through ``ringserve launch`` (its catalog makes it offer apply_patch): three turns,
    one generation each, the first after 9 s of prefill that its 3 s idle timer (no stream
    retries) sits through on keepalives; both files written by its tools."""
    reply = script(format_call("exec_command", json.dumps({"cmd": "echo hi > f.txt"})),
                   format_call("apply_patch", json.dumps({"input": PATCH})),
                   "Done: f.txt and g.txt are written.")
    server, engines = scripted_server(tmp_path, reply)
    # Codex refuses helpers under /tmp. The folder's name is fixed: Codex writes its skills' root (a
    # path under HOME) into the prompt, and the greedy reply to another name can run to the end of
    # the context (with a random name, one CI run in several did).
    scratch = CODEX_SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        async with server as state:
            done = await launch("codex", state.urls[0], scratch, [
                "-c", f"model_providers.ringserve.stream_idle_timeout_ms={CODEX_IDLE_MS}",
                "-c", "model_providers.ringserve.stream_max_retries=0",
                "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", PROMPT])
        out, err = done.stdout.decode(), done.stderr.decode()
        assert done.returncode == 0, (out[-2000:], err[-3000:])
        files = {p.name: p.read_text() for p in (scratch / "work").iterdir() if p.is_file()}
        assert files == {"f.txt": "hi\n", "g.txt": "written by apply_patch\n"}, (files, err[-3000:])
        assert "Done" in out and "idle timeout" not in err, (out, err[-3000:])
        assert len(engines[0].begins) == 3
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def test_claude_code_runs_bash_and_write_through_a_silence_then_says_done(tmp_path):
    """Claude Code through ``ringserve launch``: three turns, one generation each (no retry, no
    non-streaming fallback), the first after 9 s of prefill broken by ``event: ping``."""
    scratch = tmp_path / "claude"
    scratch.mkdir()
    work = scratch / "work"
    reply = script(format_call("Bash", json.dumps({"command": "echo hi > f.txt", "description": "Write hi"})),
                   format_call("Write", json.dumps({"file_path": str(work / "g.txt"), "content": "written by Write\n"})),
                   "Done: f.txt and g.txt are written.")
    server, engines = scripted_server(tmp_path, reply)
    async with server as state:
        done = await launch("claude", state.urls[0], scratch, ["-p", PROMPT, "--allowedTools", "Bash", "Write"],
                            {"CLAUDE_CODE_MAX_RETRIES": "0"})
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, (out[-2000:], err[-3000:])
    files = {p.name: p.read_text() for p in work.iterdir() if p.is_file()}
    assert files == {"f.txt": "hi\n", "g.txt": "written by Write\n"}, (files, out[-2000:])
    assert "Done" in out, out
    assert len(engines[0].begins) == 3


@pytest.mark.parametrize("model_args", [(), ("--model", "sonnet")], ids=["default", "sonnet"])
async def test_claude_code_bare_on_a_claude_model_name_runs_bash_and_read_then_says_done(tmp_path, caplog, model_args):
    """``claude --bare -p`` set up by hand (``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``; no
    launcher, so the model name is Claude Code's: its default or ``sonnet``), whose per-turn
    control message after the user turn has no content (``{"role": "system", "content": [],
    "output_config": {"effort": "medium"}}``; issue 43, item 0): three turns, every request a 200,
    each generation with the message's effort and no turn of its own."""
    record_the_servers_log(caplog)
    scratch = tmp_path / "claude"
    scratch.mkdir()
    work = scratch / "work"
    reply = script(format_call("Bash", json.dumps({"command": "echo hi > f.txt", "description": "Write hi"})),
                   format_call("Read", json.dumps({"file_path": str(work / "f.txt")})),
                   "Done: f.txt is written.")
    server, engines = scripted_server(tmp_path, reply, prefill_seconds=0.0)
    async with server as state:
        done = await run_in(scratch, [str(BIN / "claude"), "--bare", *model_args, "-p", PROMPT,
                                      "--allowedTools", "Bash", "Read"],
                            {"ANTHROPIC_BASE_URL": state.urls[0], "ANTHROPIC_API_KEY": "x", "DISABLE_TELEMETRY": "1",
                             "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_MAX_RETRIES": "0"})
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, (out[-2000:], err[-3000:])
    assert (work / "f.txt").read_text() == "hi\n" and "Done" in out, out
    statuses = [r.access["status"] for r in caplog.records if hasattr(r, "access") and r.access["method"] == "POST"]
    assert statuses == [200, 200, 200], statuses
    requests = engines[0].requests
    assert [r.reasoning.effort for r in requests] == [Effort.MEDIUM] * 3
    assert [[m.role for m in r.messages][:2] for r in requests] == [[Role.SYSTEM, Role.USER]] * 3
    assert all(m.content for r in requests for m in r.messages if m.role is Role.SYSTEM)


async def test_codex_retries_a_response_that_failed_mid_message_into_one_answer(tmp_path, caplog):
    """A response that fails in the middle of its message (``response.failed``, retryable: the
    engine's error here, a drain's alike) leaves Codex no message to keep: the message item gets no
    ``response.output_item.done``, from which Codex builds its history. Its stream retry sends the
    turn again as it was, and it shows one answer (issue 43, item 12: it showed the partial text as
    an agent message and sent it back, so the answer came in two)."""
    record_the_servers_log(caplog)
    answer = "Hello! This answer streams in several pieces and comes whole."
    server, engines = scripted_server(tmp_path, lambda _text: answer, prefill_seconds=0.0,
                                      engine=FailingOnceEngine, fail_after_tokens=3)
    # Codex refuses helpers under /tmp (see CODEX_SCRATCH)
    scratch = CODEX_SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        async with server as state:
            done = await launch("codex", state.urls[0], scratch, [
                "exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "Say hello."])
        out, err = done.stdout.decode(), done.stderr.decode()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert done.returncode == 0, (out[-2000:], err[-3000:])
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    items = [e["item"] for e in events if e["type"] == "item.completed"]
    assert [(i["type"], i["text"]) for i in items] == [("agent_message", answer)], events
    first, retry = engines[0].requests
    assert retry.messages == first.messages  # nothing of the failed attempt came back
    statuses = [r.access["status"] for r in caplog.records if hasattr(r, "access") and r.access["method"] == "POST"]
    assert statuses == [200, 200], statuses


# -- reasoning: the agents show it and hand it back ----------------------------------------------

#: The thinking of each turn (the model writes ``<think>`` blocks: the Hermes family's markers).
THINKING = ("First I write the file with the shell.", "The file is written, so I say so.")
#: A block or item the server dropped whole from a request (a thinking block or reasoning item
#: that did not verify is reported so: tests/http/test_reasoning.py).
DROPPED = re.compile(r"messages\[\d+\]\.content\[\d+\]|input\[\d+\]")


def thinking_script(call: str) -> Callable[[str], str]:
    """Two turns of a reasoning model: thinking then ``call``; thinking then text."""
    return script(f"<think>{THINKING[0]}</think>\n{call}", f"<think>{THINKING[1]}</think>Done: f.txt is written.")


def check_reasoning_went_back(engine: RecordingEngine, caplog: pytest.LogCaptureFixture) -> None:
    """Two generations, the second's assistant turn carrying the first turn's thinking; every
    request answered without an error and none had a block or item dropped."""
    assert len(engine.requests) == 2
    assistant = [m for m in engine.requests[1].messages if m.role is Role.ASSISTANT]
    assert [m.reasoning for m in assistant] == [THINKING[0]]
    statuses = [r.access["status"] for r in caplog.records if hasattr(r, "access")
                and r.access["method"] == "POST"]
    assert statuses == [200, 200], statuses
    ignored = [r.getMessage().partition("fields ignored: ")[2] for r in caplog.records
               if "fields ignored: " in r.getMessage()]
    assert len(ignored) == 2 and not [p for line in ignored for p in line.split(", ") if DROPPED.fullmatch(p)], ignored


def record_the_servers_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ringserve.access")
    caplog.set_level(logging.DEBUG, logger="ringserve")  # the fields reported ignored


async def test_claude_code_shows_the_models_thinking_and_sends_it_back_signed(tmp_path, caplog):
    """``-p --output-format stream-json --verbose``: the assistant events hold each turn's thinking
    block, its text and a signature (the stream's ``thinking.display`` is Claude Code's ``updates``)."""
    record_the_servers_log(caplog)
    scratch = tmp_path / "claude"
    scratch.mkdir()
    call = format_call("Bash", json.dumps({"command": "echo hi > f.txt", "description": "Write hi"}))
    server, engines = scripted_server(tmp_path, thinking_script(call), prefill_seconds=0.0, chat_format="hermes")
    async with server as state:
        done = await launch("claude", state.urls[0], scratch, [
            "-p", "Write hi to f.txt with the shell, then say done.", "--allowedTools", "Bash",
            "--output-format", "stream-json", "--verbose"], {"CLAUDE_CODE_MAX_RETRIES": "0"})
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, (out[-2000:], err[-3000:])
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    blocks = [b for e in events if e["type"] == "assistant" for b in e["message"]["content"]]
    thinking = [b for b in blocks if b["type"] == "thinking"]
    assert [b["thinking"] for b in thinking] == list(THINKING), blocks
    assert all(b["signature"] for b in thinking)
    assert [b["type"] for b in blocks] == ["thinking", "tool_use", "thinking", "text"], blocks
    assert events[-1]["type"] == "result" and events[-1]["result"] == "Done: f.txt is written."
    assert (scratch / "work" / "f.txt").read_text() == "hi\n"
    check_reasoning_went_back(engines[0], caplog)


async def test_codex_shows_the_models_reasoning_and_sends_it_back_encrypted(tmp_path, caplog):
    """``exec --json``: a ``reasoning`` item per turn with its text (Codex asks for summaries: the
    launcher's catalog entry; it sends the item back with the ``encrypted_content`` it asked for)."""
    record_the_servers_log(caplog)
    call = format_call("exec_command", json.dumps({"cmd": "echo hi > f.txt"}))
    server, engines = scripted_server(tmp_path, thinking_script(call), prefill_seconds=0.0, chat_format="hermes")
    # Codex refuses helpers under /tmp. The folder's name is fixed: Codex writes its skills' root (a
    # path under HOME) into the prompt, and the greedy reply to another name can run to the end of
    # the context (with a random name, one CI run in several did).
    scratch = CODEX_SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        async with server as state:
            done = await launch("codex", state.urls[0], scratch, [
                "exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                "Write hi to f.txt with the shell, then say done."])
        out, err = done.stdout.decode(), done.stderr.decode()
        assert done.returncode == 0, (out[-2000:], err[-3000:])
        items = [e["item"] for e in map(json.loads, out.splitlines()) if e["type"] == "item.completed"]
        assert [i["text"] for i in items if i["type"] == "reasoning"] == list(THINKING), items
        assert [i["type"] for i in items] == ["reasoning", "command_execution", "reasoning", "agent_message"], items
        assert items[-1]["text"] == "Done: f.txt is written."
        assert (scratch / "work" / "f.txt").read_text() == "hi\n"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    check_reasoning_went_back(engines[0], caplog)


# -- a plain turn on the real bundled model --------------------------------------------------

def model_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An in-process server on the real bundled model, greedy by its sampling defaults
    (``[model.sampling] temperature = 0``: the agents send no temperature): one slot of
    :data:`MODEL_CTX` tokens."""
    config = fake_config(tmp_path, engine={"slots": 1, "ctx_per_slot": MODEL_CTX}).replace(
        "model.sampling", temperature=0.0)
    return running_server(config, engine_factory=LlamaLoader())


def generations(caplog: pytest.LogCaptureFixture, route: str) -> list[str]:
    """The message ids of the access log's 200s on ``route``, in order."""
    fields = [getattr(r, "access", None) for r in caplog.records if r.name == "ringserve.access"]
    return [f["message_id"] for f in fields if f and f["route"] == route and f["status"] == 200]


@pytest.mark.model
async def test_claude_code_says_hi_on_the_bundled_model(tmp_path, caplog, monkeypatch):
    """``claude -p "Say hi"`` with :data:`CLAUDE_SMALL` on the real model: exit 0, one generation,
    and what it prints is the text the model wrote, as the server stored it."""
    record_the_servers_log(caplog)
    scratch = tmp_path / "claude"
    scratch.mkdir()
    async with model_server(tmp_path, monkeypatch) as state:
        done = await launch("claude", state.urls[0], scratch, ["-p", "Say hi", *CLAUDE_SMALL],
                            {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(CLAUDE_MAX_OUTPUT), "CLAUDE_CODE_MAX_RETRIES": "0"})
        out, err = done.stdout.decode(), done.stderr.decode()
        assert done.returncode == 0, (out[-2000:], err[-3000:])
        ids = generations(caplog, "/v1/messages")
        assert len(ids) == 1, ids  # one generation: a reply cut at the cap would be continued
        async with httpx.AsyncClient(base_url=state.urls[0]) as client:
            stored = [(await client.get(f"/v1/messages/{i}")).json() for i in ids]
    [message] = stored
    assert message["model"] == "fake" and message["status"] == "complete", message  # fake_config's name for it
    assert 0 < message["usage"]["input_tokens"] < 1000, message["usage"]
    assert message["stop_reason"] == "end_turn" and message["text"].strip(), message
    assert out.strip() == message["text"].strip(), (out, message["text"])


@pytest.mark.model
async def test_codex_says_hi_on_the_bundled_model(tmp_path, caplog, monkeypatch):
    """``codex exec --json "Say hi"`` with :func:`codex_small` on the real model: exit 0, one
    generation, and the agent's message and token counts are those the server's engine produced
    (Codex sends ``store: false``, so nothing is stored: its counts are compared with /metrics)."""
    record_the_servers_log(caplog)
    # Codex refuses helpers under /tmp. The folder's name is fixed: Codex writes its skills' root (a
    # path under HOME) into the prompt, and the greedy reply to another name can run to the end of
    # the context (with a random name, one CI run in several did).
    scratch = CODEX_SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    instructions = scratch / "instructions.md"
    instructions.write_text(SMALL_SYSTEM + "\n")
    try:
        async with model_server(tmp_path, monkeypatch) as state:
            done = await launch("codex", state.urls[0], scratch, [
                *codex_small(instructions), "-c", "model_providers.ringserve.stream_max_retries=0",
                "exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "Say hi"])
            out, err = done.stdout.decode(), done.stderr.decode()
            assert done.returncode == 0, (out[-2000:], err[-3000:])
            assert len(generations(caplog, "/v1/responses")) == 1
            async with httpx.AsyncClient(base_url=state.urls[0]) as client:
                metrics = (await client.get("/metrics")).text
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    said = [e["item"]["text"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
    usage = next(e["usage"] for e in events if e["type"] == "turn.completed")
    counted = metric_totals(metrics)
    assert len(said) == 1 and said[0].strip(), events
    assert usage["input_tokens"] == counted["ringserve_prompt_tokens_total"] < MODEL_CTX, (usage, metrics)
    assert usage["output_tokens"] == counted["ringserve_generated_tokens_total"] > 0, (usage, metrics)
