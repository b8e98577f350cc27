"""The playground page (``/``) end to end in headless Chromium.

Debian's ``chromium`` (``/usr/bin/chromium``) driven by Playwright for Python
with ``executable_path`` (Playwright's own browser downloads are never used).
The server runs in this Trio run behind :class:`tests.proxy.DroppingProxy`;
Playwright's sync API runs in a worker thread and cuts connections through
``trio.from_thread``. Skipped only when the browser cannot run, with the reason.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import fake_config, running_server
from tests.proxy import forget_last_event_id, server_behind_proxy

CHROMIUM = "/usr/bin/chromium"
#: Fresh profile per test (Playwright passes --user-data-dir from launch_persistent_context) and --headless.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
REPLY = "Streaming over SSE survives drops: the page resumes with Last-Event-ID and shows every word once. " * 2
#: About 3 s of generation (2-byte tokens, 30 ms a step), so the cut lands mid-stream.
ENGINE = {"reply": REPLY, "piece_bytes": 2, "step_seconds": 0.03}
SERVER = {"retry_ms": 100}  # EventSource's reconnection delay after a drop


def _sync_playwright() -> Any:
    """Playwright's sync entry point, or a skip saying why the browser cannot run."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright for Python is not installed (pip install playwright)")
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"{CHROMIUM} not found (apt-get install chromium)")
    return sync_playwright


def in_browser(tmp_path: Path, url: str, script: Callable[[Any], Any]) -> Any:
    """Run ``script(page)`` on ``url`` in a fresh headless Chromium (call from a worker thread)."""
    from playwright.sync_api import Error

    with _sync_playwright()() as playwright:
        try:
            context = playwright.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS)
        except Error as exc:
            pytest.skip(f"Chromium cannot start here: {str(exc).splitlines()[0]}")
        try:
            page = context.new_page()
            page.set_default_timeout(20_000)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url + "/")
            result = script(page)
            assert errors == [], errors
            return result
        finally:
            context.close()


def text_of(page: Any, element_id: str) -> str:
    return page.text_content(f"#{element_id}") or ""


def wait_for_text(page: Any, element_id: str, condition: str) -> None:
    """Wait until ``condition`` (JS, over ``t``: the element's text) holds."""
    page.wait_for_function(f"(() => {{ const t = document.getElementById({element_id!r}).textContent; "
                           f"return {condition}; }})()")


@pytest.mark.parametrize(("surface", "request_filter"), [
    ("anthropic", None),
    ("openai", None),
    # The proxy deletes Last-Event-ID: the server replays from the start and the page drops what it has.
    ("anthropic", forget_last_event_id),
], ids=["anthropic", "openai", "anthropic-replayed"])
async def test_playground_streams_and_resumes_after_a_server_side_drop(tmp_path: Path, surface: str,
                                                                        request_filter: Any) -> None:
    _sync_playwright()
    async with server_behind_proxy(tmp_path, server=SERVER, request_filter=request_filter,
                                   **ENGINE) as (state, proxy):

        def script(page: Any) -> dict[str, Any]:
            page.fill("#prompt", "Tell me about resumable streams.")
            page.select_option("#surface", surface)
            page.click("#send")
            wait_for_text(page, "output", "t.length >= 10")  # the reply is streaming in
            before = text_of(page, "output")
            cut = trio.from_thread.run_sync(proxy.cut_all)
            wait_for_text(page, "status", "t === 'done' || t.startsWith('error')")
            page.screenshot(path=str(tmp_path / f"playground-{surface}.png"), full_page=True)
            return {"before": before, "cut": cut, **{k: text_of(page, k) for k in (
                "output", "status", "message-id", "ttft", "tps", "stop-reason", "reconnects", "log")}}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, proxy.url, script)
        async with httpx.AsyncClient(base_url=state.urls[0]) as http:
            stored = (await http.get(f"/v1/messages/{seen['message-id']}")).json()
    assert seen["status"] == "done" and seen["cut"] >= 1
    assert len(seen["before"]) < len(REPLY)  # the drop came mid-stream
    assert seen["output"] == stored["text"] == REPLY  # resumed: no gap, no repeat
    assert int(seen["reconnects"]) >= 1 and "reconnect #1: resumed after event" in seen["log"]
    assert seen["stop-reason"] == stored["stop_reason"] == {"anthropic": "end_turn", "openai": "stop"}[surface]
    assert seen["ttft"].endswith(" ms") and float(seen["tps"]) > 0
    assert (tmp_path / f"playground-{surface}.png").stat().st_size > 0


async def test_playground_stop_button_cancels_the_generation(tmp_path: Path) -> None:
    _sync_playwright()
    async with server_behind_proxy(tmp_path, server=SERVER, **ENGINE) as (state, proxy):

        def script(page: Any) -> dict[str, str]:
            page.fill("#prompt", "Go on for a while.")
            page.click("#send")
            wait_for_text(page, "output", "t.length >= 10")
            page.click("#stop")
            wait_for_text(page, "status", "t === 'cancelled' || t.startsWith('error')")
            return {k: text_of(page, k) for k in ("output", "status", "message-id", "stop-reason")}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, proxy.url, script)
        async with httpx.AsyncClient(base_url=state.urls[0]) as http:
            stored = (await http.get(f"/v1/messages/{seen['message-id']}")).json()
    assert seen["status"] == "cancelled" and seen["stop-reason"] == "end_turn"  # with ringserve_cancelled
    assert stored["status"] == "cancelled" and seen["output"] == stored["text"]
    assert len(seen["output"]) < len(REPLY)



async def test_playground_reads_the_message_when_the_ring_no_longer_holds_the_resume_point(tmp_path: Path) -> None:
    # An 8-entry ring and a 1.5 s reconnection delay: ~50 events are produced while the page is away,
    # so the resume is refused (410) and the page reads GET /v1/messages/{id} instead.
    async with server_behind_proxy(tmp_path, server={"retry_ms": 1500}, stream={"ring_max_entries": 8},
                                   **ENGINE) as (state, proxy):

        def script(page: Any) -> dict[str, str]:
            page.fill("#prompt", "hello")
            page.click("#send")
            wait_for_text(page, "output", "t.length >= 10")
            trio.from_thread.run_sync(proxy.cut_all)
            wait_for_text(page, "status", "t === 'done' || t.startsWith('error')")
            return {k: text_of(page, k) for k in ("output", "status", "message-id", "log", "stop-reason")}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, proxy.url, script)
        async with httpx.AsyncClient(base_url=state.urls[0]) as http:
            stored = (await http.get(f"/v1/messages/{seen['message-id']}")).json()
    assert seen["status"] == "done" and "the stream was refused; reading the message" in seen["log"]
    assert seen["output"] == stored["text"] == REPLY and seen["stop-reason"] == "end_turn"


async def test_playground_renews_an_expired_stream_token(tmp_path: Path) -> None:
    """With API keys on, EventSource reconnects reuse the token URL; once it expires the page gets a new one."""
    _sync_playwright()
    config = fake_config(tmp_path, auth={"api_keys": ["sk-page"], "stream_token_ttl": 1.0},
                         server={"max_stream_seconds": 0.4, "retry_ms": 100}, stream={"flush_tokens": 1})
    async with running_server(config, **ENGINE) as state:

        def script(page: Any) -> dict[str, str]:
            page.fill("#api-key", "sk-page")
            page.fill("#prompt", "Tell me about stream tokens.")
            page.click("#send")
            wait_for_text(page, "status", "t === 'done' || t.startsWith('error')")
            return {k: text_of(page, k) for k in ("output", "status", "message-id", "log")}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, state.urls[0], script)
        async with httpx.AsyncClient(base_url=state.urls[0], headers={"x-api-key": "sk-page"}) as http:
            stored = (await http.get(f"/v1/messages/{seen['message-id']}")).json()
    assert seen["status"] == "done"
    assert seen["output"] == stored["text"] == REPLY
    assert "resuming with a fresh stream token" in seen["log"]
