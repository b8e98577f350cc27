"""The chat page's stream handling in headless Chromium: drops, replays, Stop, refused resumes, token renewal.

The server runs behind :class:`tests.support.proxy.DroppingProxy`, which cuts
connections on demand; see ``tests/support/browser.py`` for how the browser is driven
and ``tests/system/test_chat_page.py`` for reloads, tabs, keys and rendering.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.browser import Browser, in_browser, require_browser, send, wait_answer, wait_finished
from tests.support.proxy import Cut, forget_last_event_id, server_behind_proxy
from tests.support.server import fake_config, running_server

REPLY = "Streaming over SSE survives drops: the page resumes with Last-Event-ID and shows every word once. " * 2
#: About 3 s of generation (2-byte tokens, 30 ms a step), so the cut lands mid-stream.
ENGINE = {"reply": REPLY, "piece_bytes": 2, "step_seconds": 0.03}
SERVER = {"retry_ms": 100}  # EventSource's reconnection delay after a drop


def go_down(proxy: Any) -> None:
    """From now on the proxy ends every connection at accept, as a stopped server would (a refused connect)."""
    proxy.plan = lambda: Cut(at_accept=True)
    proxy.cut_all()


async def stored(state: Any, message_id: str, key: str | None = None) -> dict[str, Any]:
    headers = {"x-api-key": key} if key else {}
    async with httpx.AsyncClient(base_url=state.urls[0], headers=headers) as http:
        return (await http.get(f"/v1/messages/{message_id}")).json()


@pytest.mark.parametrize(("surface", "request_filter"), [
    ("anthropic", None),
    ("openai", None),
    # The proxy deletes Last-Event-ID: the server replays from the start and the page drops what it has.
    ("anthropic", forget_last_event_id),
], ids=["anthropic", "openai", "anthropic-replayed"])
async def test_page_streams_and_resumes_after_a_server_side_drop(tmp_path: Path, surface: str,
                                                                  request_filter: Any) -> None:
    require_browser()
    async with server_behind_proxy(tmp_path, server=SERVER, request_filter=request_filter,
                                   **ENGINE) as (state, proxy):

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(proxy.url)
            send(page, "Tell me about resumable streams.", surface=surface)
            before = wait_answer(page, "a.text.length >= 10")["text"]  # the reply is streaming in
            cut = trio.from_thread.run_sync(proxy.cut_all)
            seen = wait_finished(page)
            browser.shot(page, f"drop-{surface}{'-replayed' if request_filter else ''}")
            return {"before": before, "cut": cut, **seen}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
        message = await stored(state, seen["messageId"])
    assert seen["state"] == "done" and seen["cut"] >= 1
    assert len(seen["before"]) < len(REPLY)  # the drop came mid-stream
    assert seen["text"] == seen["rendered"] == message["text"] == REPLY  # resumed: no gap, no repeat
    assert int(seen["reconnects"]) >= 1 and "reconnect #1: resumed after event" in seen["log"]
    assert seen["stopReason"] == message["stop_reason"] == {"anthropic": "end_turn", "openai": "stop"}[surface]
    assert seen["ttft"].endswith(" ms") and float(seen["tps"]) > 0


async def test_stop_button_cancels_the_generation(tmp_path: Path) -> None:
    require_browser()
    async with server_behind_proxy(tmp_path, server=SERVER, **ENGINE) as (state, proxy):

        def script(browser: Browser) -> dict[str, str]:
            page = browser.page(proxy.url)
            send(page, "Go on for a while.")
            wait_answer(page, "a.text.length >= 10")
            page.click("#stop")
            seen = wait_finished(page)
            browser.shot(page, "stopped")
            return seen

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
        message = await stored(state, seen["messageId"])
    assert seen["state"] == "stopped" and seen["stopReason"] == message["stop_reason"]
    assert "Stopped" in seen["note"]
    assert message["status"] == "cancelled" and seen["text"] == message["text"]
    assert 10 <= len(seen["text"]) < len(REPLY)


async def test_page_reads_the_message_when_the_ring_no_longer_holds_the_resume_point(tmp_path: Path) -> None:
    # An 8-entry ring and a 1.5 s reconnection delay: ~50 events are produced while the page is away,
    # so the resume is refused (410) and the page reads GET /v1/messages/{id} instead.
    require_browser()
    async with server_behind_proxy(tmp_path, server={"retry_ms": 1500}, stream={"ring_max_entries": 8},
                                   **ENGINE) as (state, proxy):

        def script(browser: Browser) -> dict[str, str]:
            page = browser.page(proxy.url)
            send(page, "hello")
            wait_answer(page, "a.text.length >= 10")
            trio.from_thread.run_sync(proxy.cut_all)
            seen = wait_finished(page)
            browser.shot(page, "log-gone")
            return seen

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
        message = await stored(state, seen["messageId"])
    assert seen["state"] == "done" and "(410); reading the stored message" in seen["log"]
    assert "stored message" in seen["note"]
    assert seen["text"] == message["text"] == REPLY and seen["stopReason"] == "end_turn"


async def test_page_renews_an_expired_stream_token(tmp_path: Path) -> None:
    """With API keys on, EventSource reconnects reuse the token URL; once it expires the page gets a new one."""
    require_browser()
    config = fake_config(tmp_path, auth={"api_keys": ["sk-page"], "stream_token_ttl": 1.0},
                         server={"max_stream_seconds": 0.4, "retry_ms": 100}, stream={"flush_tokens": 1})
    async with running_server(config, **ENGINE) as state:

        def script(browser: Browser) -> dict[str, str]:
            page = browser.page(state.urls[0])
            page.fill("#api-key", "sk-page")
            page.click("#key-save")
            page.wait_for_selector("#key-panel", state="hidden")
            send(page, "Tell me about stream tokens.")
            return wait_finished(page)

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
        message = await stored(state, seen["messageId"], key="sk-page")
    assert seen["state"] == "done"
    assert seen["text"] == message["text"] == REPLY
    assert "(401); resuming with a fresh stream token" in seen["log"]


async def test_page_says_when_the_server_is_unreachable_and_recovers(tmp_path: Path) -> None:
    """Every connection refused at accept: the page says so, keeps trying, and finishes the answer once back."""
    require_browser()
    async with server_behind_proxy(tmp_path, server=SERVER, **ENGINE) as (state, proxy):

        def come_back() -> None:
            proxy.plan = Cut

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(proxy.url)
            send(page, "hello")
            wait_answer(page, "a.text.length >= 10")
            trio.from_thread.run_sync(go_down, proxy)
            page.wait_for_function("document.getElementById('banner').textContent.includes('not reachable')")
            during = wait_answer(page, "a.state === 'reconnecting'")
            browser.shot(page, "server-down")
            trio.from_thread.run_sync(come_back)
            seen = wait_finished(page)
            page.wait_for_selector("#banner", state="hidden")
            return {"during": during, **seen}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
        message = await stored(state, seen["messageId"])
    assert seen["during"]["state"] == "reconnecting"
    assert seen["state"] == "done" and seen["text"] == message["text"] == REPLY


async def test_page_says_when_a_message_cannot_be_sent(tmp_path: Path) -> None:
    require_browser()
    async with server_behind_proxy(tmp_path, server=SERVER, **ENGINE) as (_state, proxy):

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(proxy.url)
            trio.from_thread.run_sync(go_down, proxy)
            send(page, "hello")
            seen = wait_finished(page)
            banner = page.text_content("#banner")
            browser.shot(page, "send-failed")
            return {"banner": banner, **seen}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
    assert seen["state"] == "error" and "Could not reach the server" in seen["note"]
    assert "not reachable" in seen["banner"]


async def test_an_event_source_left_open_after_message_stop_reconnects_once_then_stops(tmp_path: Path) -> None:
    """After the terminal event EventSource reconnects with its id; the 204 it gets makes it stop for good."""
    require_browser()
    async with running_server(fake_config(tmp_path, server=SERVER)) as state, \
            httpx.AsyncClient(base_url=state.urls[0]) as http:
        created = (await http.post("/v1/messages", headers={"Prefer": "respond-async"},
                                   json={"model": "any", "max_tokens": 32, "stream": True,
                                         "messages": [{"role": "user", "content": "echo:the end"}]})).json()

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(state.urls[0])
            page.evaluate("""(url) => {
                const es = window.es = new EventSource(url);
                window.seen = { stops: [], errors: 0, opens: 0 };
                es.addEventListener("message_stop", (ev) => window.seen.stops.push(ev.lastEventId));
                es.onopen = () => { window.seen.opens += 1; };
                es.onerror = () => { window.seen.errors += 1; };
            }""", created["stream_url"])
            page.wait_for_function("window.seen.stops.length === 1")
            page.wait_for_function("window.es.readyState === EventSource.CLOSED")
            page.wait_for_timeout(20 * SERVER["retry_ms"])  # 20 reconnection delays: no request comes
            return page.evaluate("({...window.seen, state: window.es.readyState})")

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
        metrics = (await http.get("/metrics")).text
    # one error when the stream closed (EventSource then reconnects), one for the 204 (it stops: CLOSED)
    assert len(seen.pop("stops")) == 1 and seen == {"errors": 2, "opens": 1, "state": 2}
    resumes = {line.split('"')[1]: float(line.split()[-1])
               for line in metrics.splitlines() if line.startswith("ringserve_resumes_total{") and line[-4:] != " 0.0"}
    assert resumes == {"ok": 1.0, "ended": 1.0}  # the stream, then exactly one reconnect (204)
