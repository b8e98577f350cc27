"""A recording stub of the Anthropic Messages and OpenAI Responses APIs, for driving real agents.

It records every request (method, path, query, headers, body) and answers with minimal but valid
responses in each API's shape, following a script, so that Claude Code and Codex CLI run whole
turns against it, their tools included, without a model. ``tests/support/capture_agents.py`` drives
the agents against it and writes ``tests/data/agents/``; the keepalive checks in ``docs/agents.md``
use its :class:`Silence`.

Routes (anything else is recorded and answered 404 in the Anthropic error shape):

* ``POST /v1/messages``: Anthropic Messages; SSE when ``stream`` is true (``message_start``,
  ``content_block_start`` / ``_delta`` / ``_stop`` per block, ``message_delta``,
  ``message_stop``), a JSON ``message`` otherwise. Shapes: https://docs.anthropic.com/en/api/messages-streaming
* ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, N = the body's JSON length / 4.
* ``GET /v1/models``: Anthropic's list shape when the request carries ``anthropic-version``,
  OpenAI's otherwise.
* ``POST /v1/responses``: OpenAI Responses SSE (``response.created``, ``response.in_progress``,
  per item ``response.output_item.added`` ... ``response.output_item.done``,
  ``response.completed`` with the id and usage). Shapes:
  https://platform.openai.com/docs/api-reference/responses-streaming

Every SSE byte is made by ``ringserve.core.sse``. The stub is plain threads (``http.server``),
so an agent process and a test can share it without an event loop.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

import attrs

from ringserve.core.sse import encode_comment, encode_event

Api = Literal["anthropic", "responses"]


@attrs.frozen
class Text:
    """The model answers with this text (one text block / one assistant message item)."""

    text: str


@attrs.frozen
class Call:
    """The model calls a function tool: an Anthropic ``tool_use`` block or a Responses ``function_call``."""

    name: str
    arguments: dict[str, Any]


@attrs.frozen
class Custom:
    """The model calls a Responses ``custom`` (freeform) tool with this raw input."""

    name: str
    input: str


Step = Text | Call | Custom
#: What the model says to one request: the API it came on and its parsed body give the blocks.
Script = Callable[[Api, dict[str, Any]], Sequence[Step]]

Keepalive = Literal["comment", "ping", "in_progress", "in_progress_empty", "unknown", "none"]


@attrs.frozen
class Silence:
    """A silent phase in the next model stream (one stream only), ``seconds`` long, after its first
    ``after`` events (0: before the opening event, a long queue wait; 1: right after it, a long
    prefill; more: in the middle of the output).

    During it the stub writes ``keepalive`` every ``every`` seconds: ``comment`` (an SSE comment
    line), ``ping`` (Anthropic's ``event: ping``), ``in_progress`` (a repeated
    ``response.in_progress`` event carrying the response as streamed so far), ``in_progress_empty``
    (the same with an empty ``output``), ``unknown`` (an event of a type no API defines:
    ``event: keepalive`` with ``{"type": "keepalive"}``), or ``none`` (nothing at all).
    """

    seconds: float
    keepalive: Keepalive = "none"
    every: float = 1.0
    after: int = 1


@attrs.frozen
class Recorded:
    """One request as it arrived; ``body`` is the parsed JSON, or the text when it is not JSON."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any
    at: float

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "path": self.path, "query": self.query, "headers": self.headers, "body": self.body}


def count_outputs(api: Api, body: dict[str, Any]) -> int:
    """How many tool results the conversation in ``body`` already holds (the turn's step number)."""
    if api == "anthropic":
        return sum(
            1
            for message in body.get("messages", [])
            if isinstance(message.get("content"), list)
            for block in message["content"]
            if block.get("type") == "tool_result"
        )
    return sum(1 for item in body.get("input", []) if item.get("type") in ("function_call_output", "custom_tool_call_output"))


def tool_names(api: Api, body: dict[str, Any]) -> list[str]:
    """The names of the tools the request offers (Responses ``namespace`` tools count by their own name)."""
    return [tool.get("name", tool.get("type", "")) for tool in body.get("tools") or []]


def stepped(steps: Sequence[Step], *, side: str = "OK") -> Script:
    """A script that plays ``steps`` one per tool result: step i answers a conversation holding i results.

    A request that offers none of the tools a step calls (a side request: a title, a summary, a
    quota probe) gets ``Text(side)``; past the last step it gets the last step.
    """

    def script(api: Api, body: dict[str, Any]) -> Sequence[Step]:
        names = tool_names(api, body)
        wanted = [step.name for step in steps if not isinstance(step, Text)]
        if not any(name in names for name in wanted):
            return [Text(side)]
        return [steps[min(count_outputs(api, body), len(steps) - 1)]]

    return script


@attrs.define(eq=False)
class AgentStub:
    """The stub's state: its script, its recording, and what it does to streams.

    Attributes:
        script: answers each model request.
        silence: a silent phase in the next model stream (taken by that stream; None: none).
        fail_first: statuses to answer the first model requests with, one each, in the API's error
            shape (a 429 gets ``retry-after: 0``), before scripted answers start.
        drop_streams: this many model streams end early, after their first ``drop_after`` events
            (1: right after the opening event; -1: all but the last, the final event missing).
        requests: every request so far, in arrival order.
    """

    script: Script
    silence: Silence | None = None
    fail_first: list[int] = attrs.Factory(list)
    drop_streams: int = 0
    drop_after: int = 1
    model: str = "stub-model"
    requests: list[Recorded] = attrs.Factory(list)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _ids: Iterator[int] = attrs.field(factory=lambda: itertools.count(1), init=False)

    def record(self, entry: Recorded) -> None:
        with self._lock:
            self.requests.append(entry)

    def next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def take_failure(self) -> int | None:
        with self._lock:
            return self.fail_first.pop(0) if self.fail_first else None

    def take_silence(self) -> Silence | None:
        with self._lock:
            silence, self.silence = self.silence, None
            return silence

    def take_drop(self) -> bool:
        with self._lock:
            if self.drop_streams > 0:
                self.drop_streams -= 1
                return True
            return False


# -- Anthropic Messages ------------------------------------------------------------------------


def anthropic_events(stub: AgentStub, body: dict[str, Any], steps: Sequence[Step]) -> Iterator[dict[str, Any]]:
    """The Messages stream's events (payloads; their ``type`` is also the SSE event name)."""
    n = stub.next_id()
    yield {
        "type": "message_start",
        "message": {
            "id": f"msg_stub{n:04d}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", stub.model),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(json.dumps(body)) // 4, "output_tokens": 1,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        },
    }
    stop_reason = "end_turn"
    for index, step in enumerate(steps):
        match step:
            case Text(text):
                yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
                for piece in _pieces(text):
                    yield {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": piece}}
            case Call(name, arguments):
                stop_reason = "tool_use"
                block = {"type": "tool_use", "id": f"toolu_stub{n:04d}_{index}", "name": name, "input": {}}
                yield {"type": "content_block_start", "index": index, "content_block": block}
                for piece in _pieces(json.dumps(arguments)):
                    yield {"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": piece}}
            case Custom():
                raise ValueError("Anthropic has no custom tools")
        yield {"type": "content_block_stop", "index": index}
    yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
           "usage": {"output_tokens": 5}}
    yield {"type": "message_stop"}


def anthropic_message(stub: AgentStub, body: dict[str, Any], steps: Sequence[Step]) -> dict[str, Any]:
    """The non-streaming ``message`` the same events build."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for event in anthropic_events(stub, body, steps):
        match event["type"]:
            case "message_start":
                message = event["message"]
            case "content_block_start":
                message["content"].append(event["content_block"])
            case "content_block_delta":
                block = message["content"][event["index"]]
                if event["delta"]["type"] == "text_delta":
                    block["text"] += event["delta"]["text"]
                else:
                    partial[event["index"]] = partial.get(event["index"], "") + event["delta"]["partial_json"]
            case "content_block_stop":
                if event["index"] in partial:
                    message["content"][event["index"]]["input"] = json.loads(partial[event["index"]])
            case "message_delta":
                message.update(event["delta"])
                message["usage"]["output_tokens"] = event["usage"]["output_tokens"]
    return message


# -- OpenAI Responses --------------------------------------------------------------------------


def responses_events(stub: AgentStub, body: dict[str, Any], steps: Sequence[Step]) -> Iterator[dict[str, Any]]:
    """The Responses stream's events (payloads; their ``type`` is also the SSE event name), without
    ``sequence_number`` (the writer numbers them)."""
    n = stub.next_id()
    response: dict[str, Any] = {
        "id": f"resp_stub{n:04d}", "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": body.get("model", stub.model), "output": [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"), "tools": [], "usage": None, "error": None,
        "incomplete_details": None, "instructions": None, "metadata": {}, "temperature": None, "top_p": None,
    }
    yield {"type": "response.created", "response": dict(response)}
    yield {"type": "response.in_progress", "response": dict(response)}
    output: list[dict[str, Any]] = []
    for index, step in enumerate(steps):
        match step:
            case Text(text):
                item_id = f"msg_stub{n:04d}_{index}"
                item: dict[str, Any] = {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
                yield {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
                part = {"type": "output_text", "text": "", "annotations": []}
                yield {"type": "response.content_part.added", "item_id": item_id, "output_index": index, "content_index": 0, "part": part}
                for piece in _pieces(text):
                    yield {"type": "response.output_text.delta", "item_id": item_id, "output_index": index, "content_index": 0,
                           "delta": piece, "logprobs": []}
                yield {"type": "response.output_text.done", "item_id": item_id, "output_index": index, "content_index": 0,
                       "text": text, "logprobs": []}
                part = {"type": "output_text", "text": text, "annotations": []}
                yield {"type": "response.content_part.done", "item_id": item_id, "output_index": index, "content_index": 0, "part": part}
                item = {**item, "status": "completed", "content": [part]}
            case Call(name, arguments):
                item_id = f"fc_stub{n:04d}_{index}"
                text = json.dumps(arguments)
                item = {"id": item_id, "type": "function_call", "status": "in_progress", "call_id": f"call_stub{n:04d}_{index}",
                        "name": name, "arguments": ""}
                yield {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
                for piece in _pieces(text):
                    yield {"type": "response.function_call_arguments.delta", "item_id": item_id, "output_index": index, "delta": piece}
                yield {"type": "response.function_call_arguments.done", "item_id": item_id, "output_index": index,
                       "name": name, "arguments": text}
                item = {**item, "status": "completed", "arguments": text}
            case Custom(name, raw):
                item_id = f"ctc_stub{n:04d}_{index}"
                item = {"id": item_id, "type": "custom_tool_call", "status": "in_progress", "call_id": f"call_stub{n:04d}_{index}",
                        "name": name, "input": ""}
                yield {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
                for piece in _pieces(raw):
                    yield {"type": "response.custom_tool_call_input.delta", "item_id": item_id, "output_index": index, "delta": piece}
                yield {"type": "response.custom_tool_call_input.done", "item_id": item_id, "output_index": index, "input": raw}
                item = {**item, "status": "completed", "input": raw}
        output.append(item)
        yield {"type": "response.output_item.done", "output_index": index, "item": item}
    input_tokens = len(json.dumps(body)) // 4
    usage = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input_tokens + 5}
    yield {"type": "response.completed", "response": {**response, "status": "completed", "output": output, "usage": usage}}


def _pieces(text: str, size: int = 8) -> list[str]:
    """``text`` in deltas of ``size`` characters (at least one, so an empty text still has a delta)."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


# -- HTTP ----------------------------------------------------------------------------------------


def _error_body(api: Api, status: int) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 429: "rate_limit_error", 529: "overloaded_error"}.get(status, "api_error")
    if api == "anthropic":
        return {"type": "error", "error": {"type": kind, "message": f"stub: scripted {status}"}}
    return {"error": {"type": kind, "code": None, "message": f"stub: scripted {status}", "param": None}}


def _keepalive(kind: Keepalive, sequence: Iterator[int], snapshot: dict[str, Any]) -> bytes:
    match kind:
        case "none":
            return b""
        case "comment":
            return encode_comment("keepalive")
        case "ping":
            return encode_event(json.dumps({"type": "ping"}), event="ping")
        case "in_progress" | "in_progress_empty":
            response = {**snapshot, "output": [] if kind == "in_progress_empty" else snapshot.get("output", [])}
            payload = {"type": "response.in_progress", "sequence_number": next(sequence), "response": response}
            return encode_event(json.dumps(payload), event="response.in_progress")
        case "unknown":
            return encode_event(json.dumps({"type": "keepalive"}), event="keepalive")


def _apply(snapshot: dict[str, Any], event: dict[str, Any]) -> None:
    """Fold one Responses event into ``snapshot``, the response as streamed so far."""
    kind = event["type"]
    if kind == "response.created":
        snapshot.update(json.loads(json.dumps(event["response"])))
        return
    output = snapshot.get("output", [])
    if kind in ("response.output_item.added", "response.output_item.done"):
        item = json.loads(json.dumps(event["item"]))
        if event["output_index"] < len(output):
            output[event["output_index"]] = item
        else:
            output.append(item)
    elif kind == "response.content_part.added":
        output[event["output_index"]]["content"].append(dict(event["part"]))
    elif kind == "response.output_text.delta":
        output[event["output_index"]]["content"][event["content_index"]]["text"] += event["delta"]
    elif kind == "response.function_call_arguments.delta":
        output[event["output_index"]]["arguments"] += event["delta"]
    elif kind == "response.custom_tool_call_input.delta":
        output[event["output_index"]]["input"] += event["delta"]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                chunk = self.rfile.read(size)
                self.rfile.readline()
                if size == 0:
                    return b"".join(chunks)
                chunks.append(chunk)
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def _handle(self) -> None:
        raw = self._read_body()
        split = urlsplit(self.path)
        try:
            body: Any = json.loads(raw) if raw else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            body = raw.decode("utf-8", "replace")
        stub = self.server.stub
        stub.record(Recorded(self.command, split.path, parse_qs(split.query, keep_blank_values=True),
                             {k.lower(): v for k, v in self.headers.items()}, body, time.monotonic()))
        route = (self.command, split.path)
        if route == ("POST", "/v1/messages"):
            self._model("anthropic", body)
        elif route == ("POST", "/v1/responses"):
            self._model("responses", body)
        elif route == ("POST", "/v1/messages/count_tokens"):
            self._json(200, {"input_tokens": len(raw) // 4})
        elif route == ("GET", "/v1/models"):
            if "anthropic-version" in self.headers:
                entry = {"type": "model", "id": stub.model, "display_name": stub.model, "created_at": "2025-01-01T00:00:00Z"}
                self._json(200, {"data": [entry], "has_more": False, "first_id": stub.model, "last_id": stub.model})
            else:
                self._json(200, {"object": "list", "data": [{"id": stub.model, "object": "model", "created": 0, "owned_by": "stub"}]})
        else:
            self._json(404, {"type": "error", "error": {"type": "not_found_error", "message": f"stub: no route {route}"}})

    do_GET = do_POST = do_HEAD = do_DELETE = do_PUT = _handle

    def _json(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _model(self, api: Api, body: dict[str, Any]) -> None:
        stub = self.server.stub
        status = stub.take_failure()
        if status is not None:
            self._json(status, _error_body(api, status), {"retry-after": "0"} if status == 429 else None)
            return
        steps = stub.script(api, body)
        if not body.get("stream"):
            if api == "responses":
                raise ValueError("the stub streams Responses only")
            self._json(200, anthropic_message(stub, body, steps))
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        events = list(anthropic_events(stub, body, steps) if api == "anthropic" else responses_events(stub, body, steps))
        sequence = itertools.count()
        if stub.take_drop():
            events = events[: stub.drop_after]
        silence = stub.take_silence()
        snapshot: dict[str, Any] = {}
        try:
            for i, event in enumerate(events):
                if silence is not None and i == silence.after:
                    self._silence(silence, sequence, snapshot)
                if api == "responses":
                    event = {"type": event["type"], "sequence_number": next(sequence), **event}
                    _apply(snapshot, event)
                self._chunk(encode_event(json.dumps(event), event=event["type"]))
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _silence(self, silence: Silence, sequence: Iterator[int], snapshot: dict[str, Any]) -> None:
        end = time.monotonic() + silence.seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(silence.every, left))
            if time.monotonic() < end:
                data = _keepalive(silence.keepalive, sequence, snapshot)
                if data:
                    self._chunk(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], stub: AgentStub) -> None:
        super().__init__(address, _Handler)
        self.stub = stub


def start(stub: AgentStub, port: int = 0) -> tuple[_Server, threading.Thread]:
    """Serve ``stub`` on 127.0.0.1:``port`` (0: a free one) in a daemon thread; ``server.server_port`` is the port.

    Stop it with ``server.shutdown(); server.server_close()``.
    """
    server = _Server(("127.0.0.1", port), stub)
    thread = threading.Thread(target=server.serve_forever, name="agent-stub", daemon=True)
    thread.start()
    return server, thread


def main() -> None:
    """Serve a stub that answers every model request with one text, and print each request as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--text", default="OK")
    args = parser.parse_args()
    stub = AgentStub(script=lambda api, body: [Text(args.text)])
    server, thread = start(stub, args.port)
    print(f"listening on http://127.0.0.1:{server.server_port}", flush=True)
    seen = 0
    try:
        while thread.is_alive():
            time.sleep(0.2)
            for entry in stub.requests[seen:]:
                print(json.dumps(entry.to_json()), flush=True)
            seen = len(stub.requests)
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
