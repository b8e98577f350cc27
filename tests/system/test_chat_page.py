"""The chat page's user stories in headless Chromium: reloads, closed tabs, two tabs, keys, rendering, phone.

See ``tests/support/browser.py`` for the browser set-up and where screenshots go.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ringserve.config import ModelSettings
from ringserve.engine.fake import FakeEngine
from ringserve.engine.loader import Front
from ringserve.engine.protocol import EngineError
from tests.live.test_models import SlowLoader, named, presets
from tests.support.browser import (Browser, answer, in_browser, picker, require_browser, send, stored_answer, wait_answer,
                           wait_finished)
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until
from bench.common import metric_totals

#: About 12 s of generation on the fake engine (2-byte tokens, 40 ms a step): time for three reloads.
LONG = "Reloading the page mid-answer must continue it where it was, with no repeated and no missing text. " * 6
SLOW = {"reply": LONG, "piece_bytes": 2, "step_seconds": 0.04}
#: About 3 s.
SHORT = "A closed tab comes back to the whole answer, read from the stream log or from the message store. " * 2
ENGINE = {"reply": SHORT, "piece_bytes": 2, "step_seconds": 0.03}
#: Tokens the fake engine samples for SHORT: one per 2 bytes, and the end-of-generation token.
ENGINE_TOKENS = len(SHORT.encode()) // 2 + 1
SERVER = {"retry_ms": 100}
SURFACE_PATH = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}


def config(tmp_path: Path, **sections: dict[str, Any]) -> Any:
    """One stream event per token, a fast EventSource retry."""
    return fake_config(tmp_path, stream={"flush_tokens": 1, **sections.pop("stream", {})},
                       server={**SERVER, **sections.pop("server", {})}, **sections)


def text_of_answer(surface: str, body: dict[str, Any]) -> str:
    return body["content"][0]["text"] if surface == "anthropic" else body["choices"][0]["message"]["content"]


async def same_request_without_reloads(base_url: str, record: dict[str, Any], timeout: float = 30) -> str:
    """The text of the page's own request body, sent again without streaming (and so without reloads)."""
    body = {**json.loads(record["request"]), "stream": False}
    body.pop("stream_options", None)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as http:
        resp = await http.post(SURFACE_PATH[record["surface"]], json=body)
    assert resp.status_code == 200, resp.text
    return text_of_answer(record["surface"], resp.json())


def reload_three_times(browser: Browser, url: str, prompt: str, surface: str, step: int,
                       timeout_ms: int = 30_000, **settings: Any) -> dict[str, Any]:
    """Send ``prompt``, then reload each time ``step`` more characters have arrived, three times."""
    page = browser.page(url)
    send(page, prompt, surface=surface, temperature=0, **settings)
    at_reload: list[int] = []
    shown_after: list[int] = []
    for n in range(3):
        floor = (at_reload[-1] if at_reload else 0) + step
        at_reload.append(len(wait_answer(page, f"a.state === 'streaming' && a.text.length >= {floor}",
                                         timeout_ms)["text"]))
        page.reload()
        page.wait_for_selector("#messages .msg.assistant")
        shown_after.append(len(answer(page)["text"]))  # the stored text, shown before any event arrives
        if n == 0:
            browser.shot(page, f"reloaded-mid-answer-{surface}")
    seen = wait_finished(page, timeout_ms)
    browser.shot(page, f"finished-after-reloads-{surface}")
    return {**seen, "at_reload": at_reload, "shown_after": shown_after, "record": stored_answer(page)}


def check_reloads(seen: dict[str, Any], reference: str) -> None:
    assert seen["state"] == "done"
    assert seen["at_reload"][-1] < len(seen["text"])  # every reload came in the middle of the answer
    assert all(n > 0 for n in seen["shown_after"])  # a reload shows what it had at once
    assert seen["text"] == reference  # neither repeated nor missing text
    assert int(seen["reconnects"]) >= 3 and seen["log"].count("reconnect #") == 1  # this page's own: the last
    record = seen["record"]
    assert record["messageId"] == seen["messageId"] and record["text"] == reference and record["lastSeq"] > 0


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
async def test_three_reloads_mid_answer_give_the_text_of_the_same_request_without_them(tmp_path: Path,
                                                                                     surface: str) -> None:
    require_browser()
    cfg = config(tmp_path)
    engine = FakeEngine(n_slots=cfg.engine.slots, **SLOW)
    async with running_server(cfg, lambda _config: engine) as state:
        seen = await trio.to_thread.run_sync(
            lambda: in_browser(tmp_path, lambda b: reload_three_times(b, state.urls[0], "Tell me about reloads.",
                                                                      surface, step=20)))
        engine.step_seconds = 0  # the pace gave the reloads their time; the reference needs none (12 s less)
        reference = await same_request_without_reloads(state.urls[0], seen["record"])
    assert reference == LONG
    check_reloads(seen, reference)


@pytest.mark.model
def test_three_reloads_mid_answer_on_the_real_model(model_server: Any, tmp_path: Path) -> None:
    require_browser()
    # Greedy, the bundled model writes to max_tokens here (about 4 characters a token): 400 tokens take
    # about 2 s on two quiet cores, time for three reloads, and under a minute beside busy loops. (To
    # "Count from 1 to 100" it stops after 10, about 50 characters, which a quiet machine wrote in full
    # before the third reload.)
    prompt = "Write a long story about a dragon who learns to read."
    seen = in_browser(tmp_path, lambda b: reload_three_times(b, model_server.url, prompt, "anthropic", step=4,
                                                             timeout_ms=180_000, max_tokens=400))
    reference = trio.run(same_request_without_reloads, model_server.url, seen["record"], 180)
    check_reloads(seen, reference)


async def test_a_reload_during_the_post_gets_the_same_message(tmp_path: Path) -> None:
    """The POST reached the server but its 202 never reached the page: after the reload the page
    sends the same body with the same Idempotency-Key and follows the message the server made."""
    require_browser()
    async with running_server(config(tmp_path), **ENGINE) as state:

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(state.urls[0])
            created: list[dict[str, Any]] = []

            def swallow(route: Any) -> None:
                if created:
                    route.continue_()
                else:  # the first POST: forward it, and keep its answer from the page until the reload
                    created.append(route.fetch().json())

            page.route("**/v1/messages", swallow)
            send(page, "hello")
            while not created:
                page.wait_for_timeout(20)
            sending = answer(page)
            page.reload()
            return {"created": created[0], "sending": sending, **wait_finished(page)}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
        async with httpx.AsyncClient(base_url=state.urls[0]) as http:
            generated = metric((await http.get("/metrics")).text, "ringserve_generated_tokens_total")
    assert seen["sending"]["state"] == "sending" and seen["sending"]["messageId"] == ""
    assert seen["messageId"] == seen["created"]["id"]
    assert seen["state"] == "done" and seen["text"] == SHORT
    assert generated == ENGINE_TOKENS  # one generation, not two


@pytest.mark.parametrize("log_expired", [False, True], ids=["from-the-log", "from-the-store"])
async def test_a_closed_tab_reopened_later_shows_the_finished_answer(tmp_path: Path, log_expired: bool) -> None:
    require_browser()
    async with running_server(config(tmp_path, stream={"ttl_seconds": 0.5 if log_expired else 60}),
                              **ENGINE) as state:
        http = httpx.AsyncClient(base_url=state.urls[0])

        async def finished(message_id: str) -> bool:
            if (await http.get(f"/v1/messages/{message_id}")).json()["status"] != "complete":
                return False
            if not log_expired:
                return True
            state.hub.store.update(message_id, trace="")  # as a row written before schema 5: not rebuilt
            async with http.stream("GET", f"/v1/messages/{message_id}/stream") as resp:
                return resp.status_code == 410

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(state.urls[0])
            send(page, "hello")
            before = wait_answer(page, "a.text.length >= 10")
            url = page.url
            page.close()
            trio.from_thread.run(wait_until, lambda: finished(before["messageId"]))  # the answer is finished
            page = browser.page(url)
            seen = wait_finished(page)
            browser.shot(page, f"reopened-{'store' if log_expired else 'log'}")
            return {"before": before, **seen}

        async with http:
            seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
            message = (await http.get(f"/v1/messages/{seen['messageId']}")).json()
    assert len(seen["before"]["text"]) < len(SHORT)
    assert seen["state"] == "done" and seen["text"] == message["text"] == SHORT
    assert seen["stopReason"] == "end_turn"
    if log_expired:
        assert "(410); reading the stored message" in seen["log"] and "stored message" in seen["note"]
    else:
        assert "reconnect #" in seen["log"] and seen["note"] == ""


@pytest.mark.parametrize("answer_204", [False, True], ids=["200-without-events", "204"])
async def test_a_resume_after_the_terminal_event_ends_with_the_stored_message(tmp_path: Path,
                                                                               answer_204: bool) -> None:
    """A stored answer that has its terminal event but not its end (as if the tab died in between).

    Resuming after the terminal event is answered 204 by this server (EventSource gives up: the
    page asks why) and 200 with no events by older ones (EventSource would reconnect for ever):
    either way the page reads GET /v1/messages/{id} and ends the answer with it. The older
    server's 200 is played by the browser's request routing.
    """
    require_browser()
    async with running_server(config(tmp_path), **ENGINE) as state:

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(state.urls[0])
            send(page, "hello")
            first = wait_finished(page)
            page.evaluate("""(() => {
              const key = 'ringserve.conv.' + location.hash.slice(1);
              const conv = JSON.parse(localStorage.getItem(key));
              const answer = conv.messages.at(-1);
              Object.assign(answer, {status: 'streaming', stopReason: null, finishedAt: null});
              localStorage.setItem(key, JSON.stringify(conv));
            })()""")
            if not answer_204:
                page.route("**/stream?*last_event_id=*",
                           lambda route: route.fulfill(status=200, content_type="text/event-stream", body=""))
            page.reload()
            return {"first": first, **wait_finished(page)}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
    assert seen["first"]["state"] == "done"
    assert seen["state"] == "done" and seen["text"] == SHORT and seen["stopReason"] == "end_turn"
    assert ("had already ended (204)" in seen["log"]) is answer_204
    assert "reading the message" in seen["log"]


def two_tabs(browser: Browser, url: str) -> tuple[Any, Any]:
    """Two tabs on one (new) conversation; the first sends, the second learns of it from storage events."""
    first = browser.page(url)
    second = browser.page(first.url)
    send(first, "hello")
    wait_answer(second, "a.state === 'streaming' && a.text.length >= 10")
    return first, second


async def test_a_second_tab_follows_the_same_answer_live(tmp_path: Path) -> None:
    require_browser()
    async with running_server(config(tmp_path), **ENGINE) as state:

        def script(browser: Browser) -> tuple[dict[str, str], dict[str, str]]:
            first, second = two_tabs(browser, state.urls[0])
            browser.shot(second, "second-tab-streaming")
            return wait_finished(first), wait_finished(second)

        first, second = await trio.to_thread.run_sync(in_browser, tmp_path, script)
    assert first["state"] == second["state"] == "done"
    assert first["messageId"] == second["messageId"]
    assert first["text"] == second["text"] == SHORT


def metric(text: str, name: str) -> float:
    return metric_totals(text)[name]


async def test_stop_in_one_tab_stops_both_and_frees_the_slot(tmp_path: Path) -> None:
    require_browser()
    async with running_server(config(tmp_path), **SLOW) as state:
        http = httpx.AsyncClient(base_url=state.urls[0])

        async def slot_free() -> bool:
            text = (await http.get("/metrics")).text
            return metric(text, "ringserve_slots_busy") == 0 and metric(text, "ringserve_active_generations") == 0

        def script(browser: Browser) -> tuple[dict[str, str], dict[str, str], float]:
            first, second = two_tabs(browser, state.urls[0])
            busy = metric(trio.from_thread.run(http.get, "/metrics").text, "ringserve_slots_busy")
            second.keyboard.press("Escape")
            return wait_finished(first), wait_finished(second), busy

        async with http:
            first, second, busy = await trio.to_thread.run_sync(in_browser, tmp_path, script)
            await wait_until(slot_free)  # the slot is free
            message = (await http.get(f"/v1/messages/{first['messageId']}")).json()
            cancels = metric((await http.get("/metrics")).text, "ringserve_cancels_total")
    assert busy == 1
    assert first["state"] == second["state"] == "stopped" and first["stopReason"] == message["stop_reason"]
    assert first["text"] == second["text"] == message["text"] and message["status"] == "cancelled"
    assert 10 <= len(first["text"]) < len(LONG)
    assert cancels == 1


HOSTILE = ('<script>window.__pwned = "script"</script>\n\n'
           '<img src=x onerror="window.__pwned = \'img\'"> and <b onclick="x()">html</b>\n\n'
           '**bold**, *italic* and `<i>code</i>`; [bad](javascript:window.__pwned=1), [good](https://example.com/a?b=1)'
           '\n\n- one\n- two\n\n```html\n<script>alert(1)</script>\n```\n')


#: A thinking model's reply (the Hermes/Qwen3 family's <think> block), about 2 s on the fake engine.
THOUGHT = "The user says hello. <b>Greet</b> them back, briefly and warmly."
THINKING_REPLY = f"<think>{THOUGHT}</think>Hello! How can I help?"


@pytest.mark.parametrize("surface", ["anthropic", "openai"])
async def test_the_thinking_streams_into_a_collapsed_section_above_the_answer(tmp_path: Path, surface: str) -> None:
    require_browser()
    async with running_server(config(tmp_path), chat_format="hermes", reply=THINKING_REPLY, piece_bytes=2,
                              step_seconds=0.03) as state:

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(state.urls[0])
            send(page, "hello", surface=surface)
            # streamed as it comes, before any answer text; shown collapsed
            during = wait_answer(page, "a.thinking.length >= 10 && a.text === ''")
            seen = wait_finished(page)
            page.click("#messages .msg.assistant .thinking summary")
            opened = answer(page)
            browser.shot(page, f"thinking-{surface}")
            page.reload()
            page.wait_for_selector("#messages .msg.assistant")
            return {"during": during, "seen": seen, "opened": opened, "reloaded": answer(page)}

        got = await trio.to_thread.run_sync(in_browser, tmp_path, script)
    during, seen = got["during"], got["seen"]
    assert during["thinkingShown"] and not during["thinkingOpen"] and THOUGHT.startswith(during["thinking"])
    assert seen["state"] == "done" and seen["thinking"] == THOUGHT and seen["text"] == "Hello! How can I help?"
    assert seen["thinkingFirst"] and not seen["thinkingOpen"] and got["opened"]["thinkingOpen"]
    assert got["reloaded"]["thinking"] == THOUGHT  # kept with the answer in localStorage


async def test_an_answer_without_thinking_has_no_thinking_section(tmp_path: Path) -> None:
    require_browser()
    async with running_server(config(tmp_path)) as state:

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(state.urls[0])
            send(page, "echo:plain")
            return wait_finished(page)

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
    assert seen["text"] == "plain" and not seen["thinkingShown"] and seen["thinking"] == ""


async def test_model_html_and_script_render_as_text(tmp_path: Path) -> None:
    require_browser()
    async with running_server(config(tmp_path)) as state:  # the fake engine answers "echo:X" with X

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(state.urls[0])
            send(page, "echo:" + HOSTILE)
            seen = wait_finished(page)
            dom = page.evaluate("""(() => {
              const box = document.getElementById('messages');
              const body = [...box.querySelectorAll('.msg.assistant .body')].at(-1);
              return {
                elements: [...body.querySelectorAll('*')].map((e) => e.tagName.toLowerCase()),
                handlers: [...box.querySelectorAll('*')].flatMap((e) => [...e.attributes].map((a) => a.name))
                  .filter((name) => name.startsWith('on')),
                scripts: document.querySelectorAll('script').length,
                pwned: window.__pwned ?? null,
                links: [...body.querySelectorAll('a')].map((a) => [a.getAttribute('href'), a.rel, a.textContent]),
                code: [...body.querySelectorAll('pre code')].map((c) => c.textContent),
                user: box.querySelector('.msg.user .body').textContent,
              };
            })()""")
            browser.shot(page, "markdown-and-hostile-html")
            return {**seen, **dom}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
    assert seen["state"] == "done" and seen["text"] == HOSTILE
    assert seen["pwned"] is None and seen["handlers"] == [] and seen["scripts"] == 1  # the page's own app.js
    assert set(seen["elements"]) <= {"p", "br", "strong", "em", "code", "a", "ul", "li", "pre"}
    assert {"strong", "em", "code", "ul", "pre"} <= set(seen["elements"])
    assert '<script>window.__pwned = "script"</script>' in seen["rendered"]
    assert "<img src=x onerror=\"window.__pwned = 'img'\">" in seen["rendered"]
    assert seen["links"] == [["https://example.com/a?b=1", "noopener noreferrer nofollow", "good"]]
    assert "[bad](javascript:window.__pwned=1)" in seen["rendered"]
    assert seen["code"] == ["<script>alert(1)</script>"]
    assert seen["user"] == "echo:" + HOSTILE


#: (Markdown, the HTML the renderer builds for it).
MARKDOWN = [
    ("plain", "<p>plain</p>"),
    ("a\nb", "<p>a<br>b</p>"),
    ("a\n\nb", "<p>a</p><p>b</p>"),
    ("**b** *i* _i_ __b__", "<p><strong>b</strong> <em>i</em> <em>i</em> <strong>b</strong></p>"),
    ("*a **b** c*", "<p><em>a <strong>b</strong> c</em></p>"),
    ("snake_case_name and 2 * 3 * 4", "<p>snake_case_name and 2 * 3 * 4</p>"),
    ("`a<b` and ``x ` y``", "<p><code>a&lt;b</code> and <code>x ` y</code></p>"),
    ("```py\nx = 1 < 2\n\ny\n```\nafter", '<pre><code data-lang="py">x = 1 &lt; 2\n\ny</code></pre><p>after</p>'),
    ("```\nstill streaming", "<pre><code>still streaming</code></pre>"),
    ("- a\n- b\n\n- c", "<ul><li>a</li><li>b</li><li>c</li></ul>"),
    ("3. c\n4. d", '<ol start="3"><li>c</li><li>d</li></ol>'),
    ("- a\n  - b", "<ul><li>a<ul><li>b</li></ul></li></ul>"),
    ("# T\n## U", "<h3>T</h3><h4>U</h4>"),
    ("> q\n> r", "<blockquote><p>q<br>r</p></blockquote>"),
    ("x\n\n---\n\ny", "<p>x</p><hr><p>y</p>"),
    ("[x](https://e.com)", '<p><a href="https://e.com/" rel="noopener noreferrer nofollow" target="_blank">x</a></p>'),
    ("<https://e.com/p>", '<p><a href="https://e.com/p" rel="noopener noreferrer nofollow" target="_blank">'
                          "https://e.com/p</a></p>"),
    ("[x](javascript:alert(1))", "<p>[x](javascript:alert(1))</p>"),
    ("[x](JaVaScRiPt:alert(1)) [y](data:text/html,hi) [z](/relative)",
     "<p>[x](JaVaScRiPt:alert(1)) [y](data:text/html,hi) [z](/relative)</p>"),
    ("<javascript:alert(1)>", "<p>&lt;javascript:alert(1)&gt;</p>"),
    ("![i](https://e.com/x.png)", '<p>!<a href="https://e.com/x.png" rel="noopener noreferrer nofollow" '
                                  'target="_blank">i</a></p>'),
    ("<b>hi</b> &amp; &lt;", "<p>&lt;b&gt;hi&lt;/b&gt; &amp;amp; &amp;lt;</p>"),
    ('<a href="javascript:x">y</a>', '<p>&lt;a href="javascript:x"&gt;y&lt;/a&gt;</p>'),
    ("\\*not\\* \\<b>", "<p>*not* &lt;b&gt;</p>"),
]


async def test_markdown_renderer_builds_only_safe_elements(tmp_path: Path) -> None:
    require_browser()
    async with running_server(config(tmp_path)) as state:

        def script(browser: Browser) -> list[str]:
            page = browser.page(state.urls[0])
            return page.evaluate("""async (cases) => {
              const { renderMarkdown } = await import('/static/markdown.js');
              return cases.map((source) => {
                const box = document.createElement('div');
                box.appendChild(renderMarkdown(source));
                return box.innerHTML;
              });
            }""", [source for source, _ in MARKDOWN])

        rendered = await trio.to_thread.run_sync(in_browser, tmp_path, script)
    assert dict(zip([s for s, _ in MARKDOWN], rendered)) == dict(MARKDOWN)


async def test_with_keys_on_the_page_asks_for_the_key_and_keeps_it_in_the_tab(tmp_path: Path) -> None:
    require_browser()
    async with running_server(config(tmp_path, auth={"api_keys": ["sk-right"]}), **ENGINE) as state:

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(state.urls[0])
            page.wait_for_selector("#key-panel", state="visible")
            asked = page.text_content("#key-status")
            browser.shot(page, "key-asked")
            send(page, "hello")  # no key yet: the page asks again and sends nothing
            not_sent = page.text_content("#key-status"), page.locator("#messages .msg").count()
            page.fill("#api-key", "sk-wrong")
            page.click("#key-save")
            page.wait_for_function("document.getElementById('key-status').textContent.includes('refused')")
            refused = page.text_content("#key-status")
            browser.shot(page, "key-refused")
            page.fill("#api-key", "sk-right")
            page.click("#key-save")
            page.wait_for_selector("#key-panel", state="hidden")
            send(page, "hello")
            seen = wait_finished(page)
            storage = page.evaluate("() => ({local: JSON.stringify({...localStorage}),"
                                    " session: sessionStorage.getItem('ringserve.apiKey')})")
            page.reload()
            page.wait_for_function("document.getElementById('model').textContent !== ''")  # read with the key
            after_reload = page.is_hidden("#key-panel")
            other = browser.page(state.urls[0])  # another tab: a session of its own
            other.wait_for_selector("#key-panel", state="visible")
            return {**seen, "asked": asked, "not_sent": not_sent, "refused": refused, "storage": storage,
                    "after_reload": after_reload, "other": other.text_content("#key-status"),
                    "field": page.get_attribute("#api-key", "type")}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
    assert "needs an API key" in seen["asked"]
    assert "Enter the API key first" in seen["not_sent"][0] and seen["not_sent"][1] == 0
    assert "The server refused the API key: a valid API key is required" in seen["refused"]
    assert seen["state"] == "done" and seen["text"] == SHORT
    assert seen["storage"]["session"] == "sk-right"
    assert "sk-right" not in seen["storage"]["local"] and "sk-wrong" not in seen["storage"]["local"]
    assert seen["after_reload"]  # the tab's session survives its reload
    assert "needs an API key" in seen["other"]
    assert seen["field"] == "password"


async def test_keyboard_and_phone_width(tmp_path: Path) -> None:
    require_browser()
    async with running_server(config(tmp_path), **SLOW) as state:

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(state.urls[0], width=390, height=780)
            page.click("#input")
            page.keyboard.type("first line")
            page.keyboard.press("Shift+Enter")
            page.keyboard.type("second line")
            typed = page.input_value("#input")
            page.keyboard.press("Enter")
            wait_answer(page, "a.state === 'streaming' && a.text.length >= 10")
            layout = page.evaluate("""(() => ({
              overflow: document.documentElement.scrollWidth - window.innerWidth,
              sidebarShown: document.getElementById('sidebar').getBoundingClientRect().right > 0,
              composerBottom: document.getElementById('composer').getBoundingClientRect().bottom,
            }))()""")
            browser.shot(page, "phone-streaming")
            page.keyboard.press("Escape")
            seen = wait_finished(page)
            page.click("#menu")
            page.wait_for_function("document.getElementById('sidebar').getBoundingClientRect().left >= 0")
            browser.shot(page, "phone-conversations")
            return {**seen, **layout, "typed": typed, "user": page.text_content("#messages .msg.user .body"),
                    "input": page.input_value("#input")}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
    assert seen["typed"] == "first line\nsecond line" and seen["user"] == "first line\nsecond line"
    assert seen["input"] == ""
    assert seen["state"] == "stopped"
    assert seen["overflow"] <= 0 and not seen["sidebarShown"] and seen["composerBottom"] <= 780


async def test_the_model_picker_lists_the_models_starts_on_the_default_and_sends_the_one_picked(tmp_path: Path) -> None:
    """Two presets on fake engines that say which model they are, beta the default: the picker lists
    both with their status and starts on beta (not the first listed); a request goes to the model
    picked, the answer says which model wrote it, and the pick outlives a reload."""
    require_browser()
    config = presets(tmp_path, router={"default_model": "beta"}).replace("server", **SERVER)
    async with running_server(config, engine_factory=named) as state:

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(state.urls[0])
            first = picker(page)
            send(page, "hello")
            on_default = {**wait_finished(page), "record": stored_answer(page)}
            send(page, "hello again", model="alpha")
            picked = {**wait_finished(page), "record": stored_answer(page)}
            page.wait_for_function("document.getElementById('model').textContent.includes('alpha · loaded')")
            browser.shot(page, "model-picker")
            page.reload()
            return {"first": first, "on_default": on_default, "picked": picked, "reloaded": picker(page)}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
    assert seen["first"] == {"value": "beta", "options": ["alpha · not loaded", "beta · not loaded"]}
    on_default, picked = seen["on_default"], seen["picked"]
    assert (on_default["state"], on_default["text"], on_default["model"]) == ("done", "I am beta.", "beta")
    assert json.loads(on_default["record"]["request"])["model"] == "beta"
    assert (picked["state"], picked["text"], picked["model"]) == ("done", "I am alpha.", "alpha")
    assert json.loads(picked["record"]["request"])["model"] == "alpha"
    assert seen["reloaded"] == {"value": "alpha", "options": ["alpha · loaded", "beta · loaded"]}


class BrokenFront(SlowLoader):
    """A model whose front cannot be made (a file that is not GGUF, say): its POST is refused."""

    def front(self, settings: ModelSettings) -> Front:
        raise EngineError("not a GGUF file")


@pytest.mark.parametrize("outcome", ["loads", "fails", "refused"])
async def test_an_answer_shows_its_model_loading_and_a_failed_load_plainly(tmp_path: Path, outcome: str) -> None:
    """The model loads on the first request, its engine held by the test: the answer says it is
    loading the model, with the progress the loader reported (after a reload too), until the text
    comes. A load that
    fails, in the stream (the engine) or before it (the front: the POST is refused), ends the
    answer with the server's reason, not an error type."""
    require_browser()
    loader = BrokenFront() if outcome == "refused" else SlowLoader(fail=outcome == "fails")
    async with running_server(presets(tmp_path, ("alpha",)).replace("server", **SERVER), loader) as state:

        def script(browser: Browser) -> dict[str, Any]:
            page = browser.page(state.urls[0])
            send(page, "hello", model="alpha")
            during = None
            if outcome != "refused":
                during = wait_answer(page, "a.state === 'loading the model'")
                browser.shot(page, "model-loading")
                page.reload()  # the reloaded page follows the same answer, still waiting for the load
                during = {**wait_answer(page, "a.state === 'loading the model'"), "before": during}
                loader.release.set()
            seen = wait_finished(page)
            browser.shot(page, f"model-{outcome}")
            return {"during": during, **seen, "picker": picker(page)}

        seen = await trio.to_thread.run_sync(in_browser, tmp_path, script)
    if outcome != "refused":
        during = seen["during"]
        assert (during["loading"], during["text"]) == ("Loading alpha… 50%", "")
        assert during["messageId"] == during["before"]["messageId"] != ""
        assert "waiting for the model alpha to load" in during["before"]["log"]
    if outcome == "loads":
        assert (seen["state"], seen["text"], seen["loading"]) == ("done", "loaded and answering", None)
        return
    reason = "out of memory" if outcome == "fails" else "not a GGUF file"
    assert (seen["state"], seen["text"], seen["loading"]) == ("error", "", None)
    assert seen["note"] == (f"The model 'alpha' cannot be loaded: {reason}."
                            " Sending again tries to load it once more.")
    assert seen["picker"]["options"] == ["alpha · failed to load"]
