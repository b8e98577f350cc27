"""Issue 15: a response's event stream stays replayable for as long as the response can be retrieved.

Once its ring log has expired (ttl), left the ring (caps) or the process restarted, the stream is
rebuilt from the store (``live/resume.py`` ``rebuilt``): the same seqs and the same bytes as the original read,
so ``starting_after=N`` and the SDK's ``responses.stream(response_id=..., starting_after=N)``
(which re-reads from seq 0) work; a crash ends the rebuilt stream with the ``response.failed``
that GET shows.
"""

from __future__ import annotations

import signal

import httpx
import trio

from ringserve.store.sqlite import MessageStore
from tests.http.test_drain import FakeServerProcess
from tests.http.test_responses import LONG_ECHO, check_object, check_stream, sdk, wait_until
from tests.support.conformance import stream_bytes
from tests.support.server import fake_config, running_server

REQUEST = {"model": "any", "input": LONG_ECHO, "stream": True, "metadata": {"k": "v"}, "instructions": "brief",
           "temperature": 0.5}


def events_after(raw: bytes, n: int) -> bytes:
    """The SSE blocks of ``raw`` whose seq is after ``n`` (heartbeat comments left out)."""
    blocks = [b + b"\n\n" for b in raw.split(b"\n\n") if b and not b.startswith(b":")]
    return b"".join(blocks[n + 1:])


async def read_stream(client: httpx.AsyncClient, rid: str, **params: object) -> bytes:
    resp, raw = await stream_bytes(client, "GET", f"/v1/responses/{rid}", params={"stream": "true", **params})
    assert resp.status_code == 200, raw
    return raw


async def create_stream(client: httpx.AsyncClient) -> tuple[str, bytes]:
    """A streamed response of :data:`REQUEST`: its id and every byte the POST read."""
    resp, original = await stream_bytes(client, "POST", "/v1/responses", json=REQUEST)
    assert check_stream(original).text == LONG_ECHO.removeprefix("echo:")
    return resp.headers["x-message-id"], original


def final_text(url: str, rid: str, after: int) -> str:
    with sdk(url).responses.stream(response_id=rid, starting_after=after) as stream:
        return stream.get_final_response().output_text


async def test_an_expired_log_replays_the_same_bytes_from_the_store(tmp_path):
    # coalescing at its default window: the delta boundaries depend on timing, not on the text
    config = fake_config(tmp_path, stream={"ttl_seconds": 0.2})
    async with running_server(config, step_seconds=0.002) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            rid, original = await create_stream(client)
            seen = check_stream(original)
            assert len(seen.seqs) > 20
            await wait_until(lambda: state.hub.logs.get(rid) is None)
            assert events_after(await read_stream(client, rid), -1) == events_after(original, -1)
            for n in (0, 1, 10, len(seen.seqs) - 2):
                assert await read_stream(client, rid, starting_after=n) == events_after(original, n), n
            last_id = f"{rid}:{len(seen.seqs) // 2}"
            _resp, tail = await stream_bytes(client, "GET", f"/v1/responses/{rid}", params={"stream": "true"},
                                             headers={"Last-Event-ID": last_id})
            assert tail == events_after(original, len(seen.seqs) // 2)
            text = await trio.to_thread.run_sync(final_text, state.urls[0], rid, 10)
            assert text == seen.text
            assert state.hub.logs.get(rid) is None  # the rebuilt log is not kept in the log store


async def test_a_log_whose_head_left_the_ring_is_rebuilt(tmp_path):
    config = fake_config(tmp_path, stream={"ring_max_entries": 8})
    async with running_server(config, step_seconds=0.002) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            rid, original = await create_stream(client)
            assert state.hub.logs.get(rid) is not None  # still held, but only its last 8 entries
            assert await read_stream(client, rid, starting_after=3) == events_after(original, 3)
            text = await trio.to_thread.run_sync(final_text, state.urls[0], rid, 3)
            assert text == LONG_ECHO.removeprefix("echo:")


async def test_after_a_restart_the_stream_is_the_same(tmp_path):
    config = fake_config(tmp_path)
    async with running_server(config, step_seconds=0.002) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            rid, original = await create_stream(client)
    async with running_server(config) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            assert events_after(await read_stream(client, rid), -1) == events_after(original, -1)
            assert await read_stream(client, rid, starting_after=12) == events_after(original, 12)
            text = await trio.to_thread.run_sync(final_text, state.urls[0], rid, 12)
            assert text == LONG_ECHO.removeprefix("echo:")


async def test_a_crash_ends_the_rebuilt_stream_with_the_failure_get_shows(tmp_path):
    sections = {"stream": {"persist_seconds": 0.01}}
    server = FakeServerProcess(tmp_path, sections, {"step_seconds": 0.01})
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            body = {"model": "any", "input": LONG_ECHO, "background": True, "metadata": {"k": "v"}}
            rid = check_object(await client.post("/v1/responses", json=body))["id"]
            with trio.fail_after(20):
                while len(MessageStore(str(server.store)).get(rid).text) < 40:  # persisted, not only sent
                    await trio.sleep(0.01)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
    finally:
        server.stop()
    server = FakeServerProcess(tmp_path, sections, {})
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            after = check_object(await client.get(f"/v1/responses/{rid}"))
            assert after["status"] == "failed" and after["metadata"] == {"k": "v"}
            raw = await read_stream(client, rid)
            seen = check_stream(raw)
            assert seen.types[-1] == "response.failed" and seen.final == after
            assert seen.text == after["output"][0]["content"][0]["text"]
            assert await read_stream(client, rid, starting_after=5) == events_after(raw, 5)
    finally:
        server.stop()
