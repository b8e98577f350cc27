"""Resuming after the terminal event answers 204 No Content (issue 18, item 6).

A browser ``EventSource`` reconnects by itself after a stream ends, with
``Last-Event-ID`` set to the terminal event's id; a 200 with an empty body
would make it reconnect forever, a 204 makes it stop (WHATWG HTML,
"Server-sent events"). The browser side is in ``tests/system/test_browser.py``.
"""

from __future__ import annotations

import httpx
import pytest

from ringserve.store.sqlite import MessageStore
from tests.http.test_resume import body_for, wait_until
from tests.support.helpers import sse_events
from tests.support.server import fake_config, running_server


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
async def test_resuming_after_the_terminal_event_is_204_also_once_the_log_expired(tmp_path, path):
    config = fake_config(tmp_path, stream={"ttl_seconds": 0.3})
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        resp, events, _ = await sse_events(client, "POST", path, json=body_for(path, "echo:to the end", stream=True))
        mid = resp.headers["x-message-id"]
        last, before = events[-1].id, events[-2].id
        url = f"/v1/messages/{mid}/stream"

        async def answers() -> list[tuple[int, bytes]]:
            got = []
            for resp in (await client.get(url, headers={"Last-Event-ID": last}),
                         await client.get(url, params={"last_event_id": last})):
                got.append((resp.status_code, resp.content))
                assert resp.headers["x-message-id"] == mid
            return got

        assert await answers() == [(204, b""), (204, b"")]
        _, rest, _ = await sse_events(client, "GET", url, headers={"Last-Event-ID": before})
        assert rest == events[-1:]  # the event before the last still resumes (200)
        await wait_until(lambda: state.hub.logs.get(mid) is None, timeout=5)
        assert await answers() == [(204, b""), (204, b"")]  # the store knows the terminal event's seq
        _, rebuilt, _ = await sse_events(client, "GET", url, headers={"Last-Event-ID": before})
        assert rebuilt == events[-1:]  # rebuilt from the store
        metrics = (await client.get("/metrics")).text
        assert 'ringserve_resumes_total{result="ended"} 4.0' in metrics
    assert MessageStore(config.store.path).get(mid).final_seq == len(events) - 1


async def test_a_store_from_before_final_seq_gets_the_column(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE messages (id TEXT PRIMARY KEY, surface TEXT NOT NULL, model TEXT NOT NULL,"
               " created INTEGER NOT NULL, status TEXT NOT NULL, request TEXT NOT NULL, request_hash TEXT NOT NULL,"
               " idempotency_key TEXT UNIQUE, text TEXT NOT NULL DEFAULT '', stop_reason TEXT, stop_sequence TEXT,"
               " input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0, error TEXT,"
               " updated REAL NOT NULL)")
    db.execute("INSERT INTO messages (id, surface, model, created, status, request, request_hash, updated)"
               " VALUES ('msg_old', 'anthropic', 'm', 1, 'complete', '{}', 'h', 1.0)")
    db.commit()
    db.close()
    store = MessageStore(str(path))
    assert store.get("msg_old").final_seq is None
    store.update("msg_old", final_seq=7)
    assert store.get("msg_old").final_seq == 7
    store.close()


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c"])
async def test_the_204_keeps_the_connection_usable(tmp_path, http2):
    async with running_server(fake_config(tmp_path)) as state, \
            httpx.AsyncClient(base_url=state.urls[0], http1=not http2, http2=http2, timeout=30) as client:
        resp, events, _ = await sse_events(client, "POST", "/v1/messages",
                                           json=body_for("/v1/messages", "echo:end", stream=True))
        mid = resp.headers["x-message-id"]
        for _ in range(3):  # the same connection each time (keep-alive, or one HTTP/2 connection)
            ended = await client.get(f"/v1/messages/{mid}/stream", headers={"Last-Event-ID": events[-1].id})
            assert (ended.status_code, ended.content, ended.http_version) == (204, b"", "HTTP/2" if http2 else "HTTP/1.1")
        assert (await client.get(f"/v1/messages/{mid}")).json()["status"] == "complete"
