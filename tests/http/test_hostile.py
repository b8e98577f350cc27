"""Hostile input: the answer is a 4xx in the surface's shape, never a 500, a hang or a crash.

Property tests (hypothesis) send arbitrary JSON, wrong types, invalid UTF-8,
huge numbers and control characters in every header ringserve reads, over
HTTP (what h11 lets through) and straight into the ASGI app (any bytes at
all), to one server on the fake engine running in a background thread. The
limits ([limits], server.max_body_bytes, Last-Event-ID) are checked one by
one, and the surfaces' rendered events go through the SSE encoder and parser
and come back unchanged (tests/core/test_sse.py covers the encoder's own framing).
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.common import default_runner
from ringserve.core.errors import ErrorKind
from ringserve.core.events import (
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    Failure,
    Finish,
    StopReason,
    Usage,
)
from ringserve.core.ringlog import format_event_id, parse_event_id
from ringserve.core.sse import SSEParser, encode_event
from ringserve.http.app import create_app
from ringserve.surfaces.anthropic import AnthropicSurface
from ringserve.surfaces.openai import OpenAISurface
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY
from tests.support.server import fake_config, running_server

KEY = "sk-hostile-key"
AUTH = {"x-api-key": KEY}
PATHS = {"/v1/messages": ("anthropic", ANTHROPIC_BODY), "/v1/chat/completions": ("openai", OPENAI_BODY)}
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
#: Headers ringserve reads, and the route each one matters on.
HEADERS = ("last-event-id", "idempotency-key", "prefer", "ringserve-disconnect-policy", "authorization", "x-api-key")


def assert_answer(surface: str, status: int, body: bytes) -> None:
    """A success, or a 4xx whose body is exactly the surface's error JSON."""
    assert status < 500, (status, body[:300])
    if status < 400:
        return
    doc = json.loads(body)
    if surface == "anthropic":
        assert set(doc) == {"type", "error"} and doc["type"] == "error"
        assert set(doc["error"]) == {"type", "message"}
        assert isinstance(doc["error"]["type"], str) and isinstance(doc["error"]["message"], str)
    else:
        assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
        assert isinstance(doc["error"]["message"], str) and isinstance(doc["error"]["type"], str)


# -- one server for every example, in a thread of its own ------------------------------------


class ThreadedServer:
    """A fake-engine ringserve in a background Trio run; sync tests talk to it over HTTP or ASGI."""

    def __init__(self, config: Any) -> None:
        self._config = config
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the server did not start"
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        async def main() -> None:
            self.stop = trio.Event()
            self.token = trio.lowlevel.current_trio_token()
            async with running_server(self._config) as state:
                self.state = state
                self.url = state.urls[0]
                self.app = create_app(state)  # a second app on the same state, for raw ASGI calls
                self._ready.set()
                await self.stop.wait()

        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - surfaced by __init__ or close()
            self._error = exc
        finally:
            self._ready.set()

    def asgi(self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b"",
             query: bytes = b"") -> tuple[int, bytes]:
        """Call the app directly with any header bytes at all; returns (status, body)."""
        return trio.from_thread.run(_asgi_call, self.app, method, path, headers, body, query, trio_token=self.token)

    def close(self) -> None:
        trio.from_thread.run_sync(self.stop.set, trio_token=self.token)
        self._thread.join(30)
        assert not self._thread.is_alive()
        if self._error is not None:
            raise self._error


async def _asgi_call(app: Any, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes,
                     query: bytes) -> tuple[int, bytes]:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80), "extensions": {},
    }
    received = False
    status = 0
    out = bytearray()
    done = trio.Event()

    async def receive() -> dict:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            out.extend(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    with trio.fail_after(20):  # never a hang
        await app(scope, receive, send)
    return status, bytes(out)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    config = fake_config(
        tmp_path_factory.mktemp("hostile"),
        auth={"api_keys": [KEY]},
        engine={"slots": 8, "queue_size": 4096, "ctx_per_slot": 2048},
    )
    srv = ThreadedServer(config)
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as client:
        srv.done_id = client.post("/v1/messages", json=ANTHROPIC_BODY).json()["id"]
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


# -- strategies -------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**400), max_value=10**400)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "max_tokens", "max_completion_tokens", "messages", "system", "temperature", "top_p", "top_k",
          "stop_sequences", "stop", "stream", "metadata", "seed", "n", "stream_options"]
messages = st.lists(
    st.fixed_dictionaries({}, optional={
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", ""]) | json_values,
        "content": st.text(max_size=40) | json_values
        | st.lists(st.fixed_dictionaries({"type": st.just("text") | json_values, "text": json_values}), max_size=3),
    }),
    max_size=4,
)


@st.composite
def mangled_bodies(draw, base: dict) -> dict:
    """A valid body with some fields replaced by values of any type, or dropped."""
    body = dict(base)
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        choice = draw(st.integers(0, 3))
        if choice == 0:
            body.pop(field, None)
        elif field == "messages":
            body[field] = draw(messages)
        else:
            body[field] = draw(json_values)
    return body


def raw_json(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


# -- properties: request bodies ----------------------------------------------------------------


@SETTINGS
@given(path=st.sampled_from(list(PATHS)), value=json_values)
def test_arbitrary_json_is_answered_in_shape(client, path, value):
    surface, _ = PATHS[path]
    resp = client.post(path, content=raw_json(value), headers=AUTH)
    assert_answer(surface, resp.status_code, resp.content)
    assert resp.status_code == 400 or isinstance(value, dict)


@SETTINGS
@given(data=st.data(), path=st.sampled_from(list(PATHS)))
def test_wrong_types_in_every_field_are_answered_in_shape(client, data, path):
    surface, base = PATHS[path]
    body = data.draw(mangled_bodies({**base, "max_tokens": 16}))
    resp = client.post(path, content=raw_json(body), headers=AUTH)
    assert_answer(surface, resp.status_code, resp.content)
    if resp.status_code == 200 and body.get("stream") is True:
        last = SSEParser().feed(resp.content)[-1]
        assert last.event == "message_stop" or last.data == "[DONE]"


@SETTINGS
@given(path=st.sampled_from(list(PATHS)), raw=st.binary(max_size=200)
       | st.builds(lambda a, b: b'{"model":"' + a + b'","messages":"' + b + b'"}', st.binary(max_size=8),
                   st.binary(max_size=8)))
def test_bytes_that_are_not_json_or_not_utf8_are_400(client, path, raw):
    surface, _ = PATHS[path]
    resp = client.post(path, content=raw, headers=AUTH)
    assert_answer(surface, resp.status_code, resp.content)
    assert resp.status_code == 400


NUMBERS = [b"1e999", b"-1e999", b"NaN", b"Infinity", b"-Infinity", b"1" + b"0" * 5000, b"9" * 400,
           b"-0", b"1e-999", b"0.5", b"2.0", b"18446744073709551616"]


@SETTINGS
@given(path=st.sampled_from(list(PATHS)), field=st.sampled_from(["max_tokens", "max_completion_tokens",
                                                                 "temperature", "top_p", "top_k", "seed", "n"]),
       number=st.sampled_from(NUMBERS) | st.integers().map(lambda i: str(i).encode()))
def test_huge_and_odd_numbers_are_answered_in_shape(client, path, field, number):
    surface, base = PATHS[path]
    text = json.dumps({**base, "max_tokens": 8}).encode()
    raw = text[:-1] + b',"' + field.encode() + b'":' + number + b"}"
    resp = client.post(path, content=raw, headers=AUTH)
    assert_answer(surface, resp.status_code, resp.content)


BOTH = ("anthropic", "openai")
#: (a change to a valid body, the surfaces that must answer 400: those that read the field; a
#: surface that does not know it accepts it and names it in Ringserve-Ignored-Fields)
KNOWN_BAD = [
    ({"messages": [{"role": [], "content": "x"}]}, BOTH),
    ({"messages": [{"role": {"a": 1}, "content": "x"}]}, BOTH),
    ({"messages": [{"role": "user", "content": 5}]}, BOTH),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, BOTH),
    ({"messages": {"role": "user"}}, BOTH),
    ({"messages": []}, BOTH),
    ({"model": ["x"]}, BOTH),
    ({"temperature": "hot"}, BOTH),
    ({"stream": "yes"}, BOTH),
    ({"stop_sequences": [1, 2]}, ("anthropic",)),
    ({"metadata": []}, ("anthropic",)),
    ({"system": 7}, ("anthropic",)),
    ({"stop": [1, 2]}, ("openai",)),
    ({"stream_options": []}, ("openai",)),
    ({"n": 2}, ("openai",)),
]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("change, rejected_by", KNOWN_BAD)
def test_known_bad_fields_are_400_in_shape(client, path, change, rejected_by):
    surface, base = PATHS[path]
    resp = client.post(path, content=raw_json({**base, **change}), headers=AUTH)
    assert_answer(surface, resp.status_code, resp.content)
    assert resp.status_code == (400 if surface in rejected_by else 200)


@pytest.mark.parametrize("path", list(PATHS))
def test_deep_nesting_is_400_not_a_crash(client, path):
    surface, _ = PATHS[path]
    for raw in (b"[" * 200_000, b'{"a":' * 100_000):
        resp = client.post(path, content=raw, headers=AUTH)
        assert_answer(surface, resp.status_code, resp.content)
        assert resp.status_code == 400


# -- properties: headers ------------------------------------------------------------------------


def header_target(server: ThreadedServer, name: str, value: bytes) -> tuple[str, str, list, bytes, str]:
    """(method, path, headers, body, surface) for a request that makes ringserve read header ``name``."""
    headers = [(b"content-type", b"application/json")]
    if name not in ("authorization", "x-api-key"):
        headers.append((b"x-api-key", KEY.encode()))
    headers.append((name.encode(), value))
    if name in ("last-event-id", "authorization", "x-api-key"):
        return "GET", f"/v1/messages/{server.done_id}/stream", headers, b"", "anthropic"
    return "POST", "/v1/chat/completions", headers, json.dumps({**OPENAI_BODY, "max_tokens": 8}).encode(), "openai"


@SETTINGS
@given(name=st.sampled_from(HEADERS), value=st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")))
def test_any_bytes_in_any_header_straight_into_the_app(server, name, value):
    """NUL, every other control character and any 8-bit byte, straight past the HTTP parser.

    CR and LF are left out: Quart's request object refuses them before any
    ringserve code runs, and no HTTP server passes them on (the next test).
    """
    method, path, headers, body, surface = header_target(server, name, value)
    status, answer = server.asgi(method, path, headers, body)
    assert_answer(surface, status, answer)
    if name in ("authorization", "x-api-key"):
        assert status == 401


# What h11 lets through in a header value: any byte but NUL, CR, LF, VT and FF, with no
# space or tab at either end. Control characters included.
wire_values = st.lists(st.integers(1, 255).filter(lambda b: b not in b"\r\n\x0b\x0c"), min_size=1,
                       max_size=300).map(bytes).map(lambda b: b.strip(b" \t")).filter(bool)


@SETTINGS
@given(name=st.sampled_from(HEADERS), value=wire_values | st.sampled_from(
    [b"respond-async", b"respond-async, wait=5", b"abort", b"continue", b"Bearer", b"Bearer x y", b"x" * 300]))
def test_any_header_value_over_http(server, client, name, value):
    method, path, headers, body, surface = header_target(server, name, value)
    resp = client.request(method, path, headers=headers, content=body)
    assert_answer(surface, resp.status_code, resp.content)


@pytest.mark.parametrize("name", HEADERS)
def test_nul_and_cr_from_a_real_client_get_400_and_the_server_lives_on(server, client, name):
    """h11 refuses NUL and bare CR in a header value with 400 before the app sees them (its shape, not ours)."""
    host, port = server.url.removeprefix("http://").split(":")
    for value in (b"a\x00b", b"a\rb", b"\x00"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /v1/messages/" + server.done_id.encode() + b"/stream HTTP/1.1\r\nHost: x\r\n"
                         + name.encode() + b": " + value + b"\r\n\r\n")
            head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 400"), head[:100]
    assert client.get("/health").status_code == 200


@SETTINGS
@given(value=st.text(max_size=300))
def test_any_last_event_id_query_is_answered_in_shape(server, client, value):
    resp = client.get(f"/v1/messages/{server.done_id}/stream", params={"last_event_id": value}, headers=AUTH)
    assert_answer("anthropic", resp.status_code, resp.content)


# -- limits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
async def test_body_over_max_body_bytes_is_413_in_shape(tmp_path, path):
    surface, base = PATHS[path]
    config = fake_config(tmp_path, server={"max_body_bytes": 1000})
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        ok = await client.post(path, json=base)
        assert ok.status_code == 200
        big = {**base, "messages": [{"role": "user", "content": "x" * 2000}]}
        resp = await client.post(path, json=big)
        assert_answer(surface, resp.status_code, resp.content)
        assert resp.status_code == 413
        assert "1000 bytes" in resp.text
        if surface == "anthropic":
            assert resp.json()["error"]["type"] == "request_too_large"


@pytest.mark.parametrize("path", list(PATHS))
async def test_message_count_text_size_and_max_tokens_limits(tmp_path, path):
    surface, base = PATHS[path]
    config = fake_config(tmp_path, limits={"max_messages": 3, "max_message_chars": 100},
                         engine={"ctx_per_slot": 512})
    one = {"role": "user", "content": "hi"}
    cases = {
        "too many messages": {**base, "messages": [one] * 4},
        "too much text": {**base, "messages": [{"role": "user", "content": "é" * 60}] * 2},
        "max_tokens 0": {**base, "max_tokens": 0},
        "max_tokens -1": {**base, "max_tokens": -1},
        "max_tokens over the limit": {**base, "max_tokens": 10**7},
        "max_tokens float": {**base, "max_tokens": 1.5},
        "max_tokens string": {**base, "max_tokens": "10"},
        "max_tokens bool": {**base, "max_tokens": True},
        # (a max_tokens over the context is served: tests/surfaces/test_compat.py)
    }
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        assert (await client.post(path, json={**base, "messages": [one] * 3})).status_code == 200
        assert (await client.post(path, json={**base, "messages": [{"role": "user", "content": "x" * 100}]})
                ).status_code == 200
        for name, body in cases.items():
            resp = await client.post(path, json=body)
            assert resp.status_code == 400, name
            assert_answer(surface, resp.status_code, resp.content)
            if surface == "openai":
                assert resp.json()["error"]["param"] in ("messages", "max_tokens"), name
        assert default_runner(state.hub).statistics().prompt_tokens_total > 0  # the two good ones ran


async def test_last_event_id_length_and_syntax_are_400(fake_server):
    _, client = fake_server
    mid = (await client.post("/v1/messages", json=ANTHROPIC_BODY)).json()["id"]
    for bad in (f"{mid}:" + "1" * 250, f"{mid}:-1", f"{mid}:1.0", f"{mid}:１", f"{mid}", ":", f"{mid}:0x1"):
        resp = await client.get(f"/v1/messages/{mid}/stream", headers={"Last-Event-ID": bad.encode()})
        assert resp.status_code == 400, bad
        assert_answer("anthropic", resp.status_code, resp.content)
    assert (await client.get(f"/v1/messages/{mid}/stream", headers={"Last-Event-ID": f"{mid}:1"})).status_code == 200


async def test_concurrent_readers_per_message_and_per_client_are_429(tmp_path):
    config = fake_config(tmp_path, limits={"max_readers_per_message": 2, "max_readers_per_client": 3})
    async with running_server(config, step_seconds=0.01) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        long_body = {**ANTHROPIC_BODY, "max_tokens": 2000,
                     "messages": [{"role": "user", "content": "echo:" + "abc " * 400}]}
        a = (await client.post("/v1/messages", json=long_body, headers={"Prefer": "respond-async"})).json()["id"]
        b = (await client.post("/v1/chat/completions", json={**OPENAI_BODY, **long_body},
                               headers={"Prefer": "respond-async"})).json()["id"]
        async with client.stream("GET", f"/v1/messages/{a}/stream") as r1, \
                client.stream("GET", f"/v1/messages/{a}/stream") as r2:
            assert r1.status_code == r2.status_code == 200
            third = await client.get(f"/v1/messages/{a}/stream")
            assert third.status_code == 429 and third.headers["retry-after"] == "1"
            assert third.json()["error"]["type"] == "rate_limit_error"
            async with client.stream("GET", f"/v1/messages/{b}/stream") as r3:
                assert r3.status_code == 200
                assert state.gate.readers("127.0.0.1") == 3
                resp = await client.get(f"/v1/messages/{b}/stream")
                assert resp.status_code == 429
                assert resp.json()["error"] == {**resp.json()["error"], "type": "rate_limit_error",
                                                "code": "rate_limit_exceeded"}
                # a new generation is refused before anything is started
                active = state.hub.statistics().active_generations
                resp = await client.post("/v1/messages", json={**ANTHROPIC_BODY, "stream": True})
                assert resp.status_code == 429
                assert state.hub.statistics().active_generations == active
        # every place is given back when the connections end
        with trio.fail_after(5):
            while state.gate.readers("127.0.0.1"):
                await trio.sleep(0.005)
        assert (await client.get(f"/v1/messages/{a}/stream", headers={"Last-Event-ID": f"{a}:0"})).status_code == 200


# -- the SSE encoder under the surfaces: what is rendered parses back unchanged -----------------

any_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60) | st.sampled_from(
    ["\r\n", "\r", "\n\n", "\x00", "data: x\n\nid: y", "\u2028\u2029", "\ufeff", "👍🏽 你好 🇯🇵", ": ping"])
message_ids = st.sampled_from(["msg_0123abcd", "chatcmpl-0123abcd", "msg_a:b:c"])


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(any_text, max_size=6), mid=message_ids, stop=st.none() | any_text, message=any_text,
       fail=st.booleans(), include_usage=st.booleans(), cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_rendered_streams_parse_back_to_the_same_events(texts, mid, stop, message, fail, include_usage, cuts):
    for surface in (AnthropicSurface(), OpenAISurface()):
        renderer = surface.renderer(mid, "model", 0, include_usage)
        usage = Usage(3, len(texts))
        wire = [*renderer.start(Usage(3, 0)), *renderer.block_start(BlockStart(0, BlockKind.TEXT))]
        for text in texts:
            wire += renderer.delta(BlockDelta(0, text))
        if not fail:
            wire += renderer.block_stop(BlockStop(0))
        wire += renderer.fail(Failure(ErrorKind.OVERLOADED, message, usage)) if fail else renderer.finish(
            Finish(StopReason.STOP_SEQUENCE if stop else StopReason.END, usage, stop))
        stream = b"".join(encode_event(ev.data, event=ev.event, id=format_event_id(mid, i))
                          for i, ev in enumerate(wire))
        parser = SSEParser()
        bounds = sorted({c % (len(stream) + 1) for c in cuts})
        events = []
        for lo, hi in itertools.pairwise([0, *bounds, len(stream)]):
            events += parser.feed(stream[lo:hi])
        assert parser.pending_bytes == 0
        assert [(e.event, e.data) for e in events] == [(ev.event or "message", ev.data) for ev in wire]
        assert [parse_event_id(e.id, mid) for e in events] == list(range(len(wire)))
        decoded = [None if e.data == "[DONE]" else json.loads(e.data) for e in events]
        if surface.name == "anthropic":
            got = [d["delta"]["text"] for d in decoded if d["type"] == "content_block_delta"]
            last = decoded[-1]
            assert last["error"]["message"] == message if fail else last["type"] == "message_stop"
            if not fail:
                assert decoded[-2]["delta"]["stop_sequence"] == stop
        else:
            got = [d["choices"][0]["delta"]["content"] for d in decoded[1:]
                   if d and d.get("choices") and "content" in d["choices"][0]["delta"]]
            assert (decoded[-1]["error"]["message"] == message) if fail else decoded[-1] is None
        assert got == texts


async def test_the_startup_log_writes_integer_limits_as_integers(tmp_path, caplog):
    """``up to 1073741824 bytes``, not ``1.07374e+09 bytes`` (a rounded figure of the configured one)."""
    config = fake_config(tmp_path, store={"max_bytes": 2**30, "max_age_seconds": 86400.5})
    with caplog.at_level("INFO", logger="ringserve"):
        async with running_server(config):
            pass
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("message store:"))
    assert "kept 86400.5s, up to 1073741824 bytes" in line, line
