"""A browser ``EventSource`` follows a background Response through a drop (issue 15), in headless Chromium.

``GET /v1/responses/{id}?stream=true&stream_token=...``: the page's own ``EventSource`` reconnects
after the proxy cuts the connection, with ``Last-Event-ID``, and gets every event once; after the
terminal event it stops (no reconnect loop: it closes itself on the terminal event here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from tests.http.test_responses import TERMINAL
from tests.support.browser import Browser, in_browser, require_browser
from tests.support.proxy import server_behind_proxy

REPLY = "A browser follows a background response over SSE and resumes it after a drop. " * 2
ENGINE = {"reply": REPLY, "piece_bytes": 2, "step_seconds": 0.03}  # about 2.5 s of generation

#: Reads the response's events with an EventSource until the terminal event; every named event
#: needs its own listener (``onmessage`` sees only unnamed ones).
FOLLOW = """([url, types, terminal]) => new Promise((resolve, reject) => {
  const es = new EventSource(url);
  const seen = [];
  let opens = 0;
  es.onopen = () => { opens += 1; };
  es.onerror = () => { if (es.readyState === EventSource.CLOSED) reject(new Error("closed: " + seen.length)); };
  window.followed = seen;
  for (const type of types) {
    es.addEventListener(type, (e) => {
      const data = JSON.parse(e.data);
      seen.push({type, seq: data.sequence_number, id: e.lastEventId, delta: data.delta || ""});
      if (terminal.includes(type)) { es.close(); resolve({seen, opens, status: data.response.status}); }
    });
  }
})"""

TYPES = ["response.created", "response.queued", "response.in_progress", "response.output_item.added",
         "response.content_part.added", "response.output_text.delta", "response.output_text.done",
         "response.content_part.done", "response.output_item.done", *TERMINAL]


async def test_event_source_follows_a_background_response_through_a_drop(tmp_path: Path) -> None:
    require_browser()
    async with server_behind_proxy(tmp_path, server={"retry_ms": 100}, **ENGINE) as (state, proxy):
        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(proxy.url)
            # created once the browser is up, so the generation (2.5 s) cannot end before the cut
            with httpx.Client(base_url=state.urls[0], timeout=30) as http:
                rid = http.post("/v1/responses", json={"model": "any", "input": "go", "background": True}).json()["id"]
                token = http.post(f"/v1/messages/{rid}/stream_token").json()["stream_token"]
            ids.append(rid)
            url = f"{proxy.url}/v1/responses/{rid}?stream=true&stream_token={token}"
            # started, not awaited (evaluate would wait for the promise): window.done holds it
            page.evaluate(f"(args) => {{ window.done = ({FOLLOW})(args); }}", [url, TYPES, list(TERMINAL)])
            page.wait_for_function("() => window.followed.filter(e => e.delta).length >= 5")
            trio.from_thread.run_sync(proxy.cut_all)  # mid-stream: the EventSource reconnects by itself
            return page.evaluate("() => window.done")

        ids: list[str] = []
        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
        rid = ids[0]
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as http:
            final = (await http.get(f"/v1/responses/{rid}")).json()
    events = seen["seen"]
    assert seen["opens"] >= 2 and proxy.cuts >= 1  # it did reconnect
    assert [e["seq"] for e in events] == list(range(len(events)))  # no gap, no repeat
    assert all(e["id"] == f"{rid}:{e['seq']}" for e in events)
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert seen["status"] == final["status"] == "completed"
    assert "".join(e["delta"] for e in events) == final["output"][0]["content"][0]["text"] == REPLY
