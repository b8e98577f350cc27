"""Drive the chat page (``/``) in headless Chromium: launching, reading an answer, screenshots.

Debian's ``chromium`` (``/usr/bin/chromium``) driven by Playwright for Python
with ``executable_path`` (Playwright's own browser downloads are never used).
The server runs in the test's Trio run; Playwright's sync API runs in a worker
thread (``trio.to_thread.run_sync``) and reaches the server side through
``trio.from_thread``. Skipped only when the browser cannot run, with the reason.

Screenshots go to ``$RINGSERVE_SCREENSHOTS`` when set (a folder, created),
else to ``screenshots/`` in the test's pytest tmp dir; they are never committed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
#: Fresh profile per test (Playwright passes --user-data-dir from launch_persistent_context) and --headless.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
#: Terminal states of an answer as the page labels them (``data-state``).
TERMINAL = ("done", "stopped", "error")

#: JS: the last assistant answer on the page as a plain object (null before there is one).
_ANSWER = """(() => {
  const a = [...document.querySelectorAll('#messages .msg.assistant')].at(-1);
  if (!a) return null;
  const q = (s) => a.querySelector(s).textContent;
  const thinking = a.querySelector('.thinking');
  return {state: a.dataset.state, messageId: a.dataset.messageId, text: q('.src'), rendered: q('.body'),
          ttft: q('.ttft'), tps: q('.tps'), stopReason: q('.stop-reason'), reconnects: q('.reconnects'),
          model: q('.meta .model'), loading: a.querySelector('.load').hidden ? null : q('.load'),
          note: q('.note'), log: q('.log ol'), thinking: q('.thinking-text'), thinkingShown: !thinking.hidden,
          thinkingOpen: thinking.open, thinkingFirst: thinking.nextElementSibling === a.querySelector('.body')};
})()"""


def require_browser() -> Any:
    """Playwright's sync entry point, or a skip saying why the browser cannot run."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright for Python is not installed (pip install playwright)")
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"{CHROMIUM} not found (apt-get install chromium)")
    return sync_playwright


class Browser:
    """One headless Chromium profile; :meth:`page` opens tabs and records their script errors."""

    def __init__(self, context: Any, tmp_path: Path) -> None:
        self.context = context
        self.errors: list[str] = []
        env = os.environ.get("RINGSERVE_SCREENSHOTS")
        self.shots = Path(env) if env else tmp_path / "screenshots"

    def page(self, url: str, *, width: int = 1100, height: int = 800) -> Any:
        """A new tab at ``url`` (the page root, or with ``#conversation``)."""
        page = self.context.new_page()
        page.set_viewport_size({"width": width, "height": height})
        page.set_default_timeout(20_000)
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        page.goto(url if "#" in url else url + "/")
        page.wait_for_selector("#composer")
        return page

    def shot(self, page: Any, name: str) -> Path:
        """Screenshot ``page`` as ``<shots>/<name>.png``; returns the path."""
        self.shots.mkdir(parents=True, exist_ok=True)
        path = self.shots / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path


def in_browser(tmp_path: Path, script: Callable[[Browser], Any]) -> Any:
    """Run ``script(browser)`` in a fresh headless Chromium (call from a worker thread).

    The page's Content-Security-Policy is bypassed (so the renderer's own
    escaping is what the rendering tests check). Fails if a page threw an uncaught error or left a promise rejection unhandled.
    """
    from playwright.sync_api import Error

    with require_browser()() as playwright:
        try:
            context = playwright.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS,
                bypass_csp=True)  # Playwright's wait_for_function evaluates strings; the page's CSP forbids that
        except Error as exc:
            pytest.skip(f"Chromium cannot start here: {str(exc).splitlines()[0]}")
        try:
            browser = Browser(context, tmp_path)
            result = script(browser)
            assert browser.errors == [], browser.errors
            return result
        finally:
            context.close()


def answer(page: Any) -> dict[str, Any] | None:
    """The last answer on ``page``: state, message id, source text, rendered text, stats, model, the
    model's load line (None when hidden), note, log; its thinking section's text, whether it is
    shown, open, and just above the answer."""
    return page.evaluate(_ANSWER)


def wait_answer(page: Any, condition: str, timeout_ms: int = 30_000) -> dict[str, Any]:
    """Wait until ``condition`` (JS over ``a``, the object :func:`answer` returns) holds; return the answer."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(f"(() => {{ const a = {_ANSWER}; return a !== null && ({condition}); }})()",
                               timeout=timeout_ms)
    except PlaywrightTimeout:
        raise AssertionError(f"no answer with {condition} after {timeout_ms} ms; the last: {answer(page)}") from None
    result = answer(page)
    assert result is not None
    return result


def wait_finished(page: Any, timeout_ms: int = 30_000) -> dict[str, Any]:
    """Wait until the last answer has ended (done, stopped or error)."""
    return wait_answer(page, f"{json.dumps(list(TERMINAL))}.includes(a.state)", timeout_ms)


def send(page: Any, text: str, *, surface: str | None = None, temperature: float | None = None,
         max_tokens: int | None = None, model: str | None = None) -> None:
    """Set the given settings (``model``: pick it once the picker lists the models), type ``text``
    and press Enter."""
    if model is not None:
        picker(page)
        page.select_option("#model", model)
    if surface is not None or temperature is not None or max_tokens is not None:
        if page.is_hidden("#settings"):
            page.click("#settings-toggle")
        if surface is not None:
            page.select_option("#surface", surface)
        if temperature is not None:
            page.fill("#temperature", str(temperature))
        if max_tokens is not None:
            page.fill("#max-tokens", str(max_tokens))
    page.fill("#input", text)
    page.press("#input", "Enter")


def picker(page: Any) -> dict[str, Any]:
    """The model picker once it lists the models: the chosen model and each option's text."""
    page.wait_for_function("document.getElementById('model').options.length > 0")
    return page.evaluate("""(() => {
      const select = document.getElementById('model');
      return {value: select.value, options: [...select.options].map((o) => o.textContent)};
    })()""")


def stored_answer(page: Any) -> dict[str, Any]:
    """The last assistant record of the conversation on screen, as kept in localStorage."""
    return page.evaluate("""(() => {
      const conv = JSON.parse(localStorage.getItem('ringserve.conv.' + location.hash.slice(1)));
      return conv.messages.filter((m) => m.role === 'assistant').at(-1);
    })()""")
