"""Both official SDKs, sync and async, stream through every silence on the real model (issue 12).

One slot and a 1 s heartbeat, so every stream below gets ``: ping`` after its first event (the
OpenAI SDK used to raise ``JSONDecodeError`` there): (a) queued behind another request, (b)
prefilling a long prompt, (c) behind a slow safety checker, (d) read again with ``Last-Event-ID``
while queued. Each completes and its text equals the non-stream text at temperature 0. Few tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.common import ServerProcess
from tests.support.conformance import sdk_answer, sdk_stream_text
from tests.support.server import MODEL_TOML, SERVE

pytestmark = pytest.mark.model

SDKS = ["anthropic", "openai"]
MODES = pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
GREEDY = {"extra_body": {"temperature": 0}}
REQUEST = {"max_tokens": 8, "messages": [{"role": "user", "content": "Name three colours."}], **GREEDY}
#: A prompt of about 300 tokens: over a second of prefill on the shared 2-core test machine, a
#: fraction of one on a fast CPU (not asserted; tests/http/test_conformance.py pins prefill silences on
#: the fake engine). Longer prompts take minutes there.
LONG_REQUEST = {**REQUEST, "messages": [{"role": "user", "content": "Summarise: " + "The cat sat on the mat. " * 40}]}
#: What holds the only slot (cancelled once a waiting stream has had a ping). The reply is a
#: continued count, which the model carries on greedily for far longer than a heartbeat interval
#: (a plain "Count to one thousand." ends after a few numbers on a fast machine, before any ping).
BLOCKER = {"model": "any", "max_tokens": 2000, "temperature": 0, "messages": [
    {"role": "user", "content": "Count from 1 to 1000, separated by commas."},
    {"role": "assistant", "content": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,"}]}


def _server(tmp_path_factory: pytest.TempPathFactory, name: str, extra: str = "") -> ServerProcess:
    d = tmp_path_factory.mktemp(name)
    (d / "config.toml").write_text(
        f'[server]\nheartbeat_interval = 1.0\n[engine]\nslots = 1\nctx_per_slot = 4096\n'
        f'[store]\npath = "{d / "store.sqlite3"}"\n{MODEL_TOML}{extra}')
    return ServerProcess([*SERVE, "--config", str(d / "config.toml")])


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = _server(tmp_path_factory, "plain")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow_safety(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = _server(tmp_path_factory, "safety",
                     '[safety]\nwindow_tokens = 2\nchecker = "tests.support.safety_checkers:slow_first"\n')
    yield server
    server.stop()


def _heartbeats(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("ringserve_heartbeats_total "):
            return float(line.split()[1])
    raise AssertionError("no ringserve_heartbeats_total")


def _behind_a_blocker(server: ServerProcess, read: Callable[[], str]) -> str:
    """Run ``read`` (a blocking SDK stream) while another request holds the only slot; free the slot
    once the server has sent a heartbeat, so the stream waited in the queue past a ping."""
    with httpx.Client(base_url=server.url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        blocker = http.post("/v1/messages", json=BLOCKER, headers={"Prefer": "respond-async"}).json()
        pings = _heartbeats(http)
        reading = pool.submit(read)
        while _heartbeats(http) == pings:  # bounded by the blocker's 2000 tokens
            assert not reading.done(), reading.result()
            time.sleep(0.1)
        http.post(f"/v1/messages/{blocker['id']}/cancel")
        return reading.result(timeout=60)




@pytest.mark.parametrize("sdk", SDKS)
@MODES
def test_a_queued_stream(plain: ServerProcess, sdk: str, use_async: bool) -> None:
    expected, _ = sdk_answer(sdk, plain.url, **REQUEST)
    assert expected
    text = _behind_a_blocker(plain, lambda: sdk_stream_text(sdk, plain.url, use_async=use_async, **REQUEST))
    assert text == expected


@pytest.mark.parametrize("sdk", SDKS)
@MODES
def test_b_a_long_prefill(plain: ServerProcess, sdk: str, use_async: bool) -> None:
    expected, _ = sdk_answer(sdk, plain.url, **LONG_REQUEST)
    assert sdk_stream_text(sdk, plain.url, use_async=use_async, **LONG_REQUEST) == expected


@pytest.mark.parametrize("sdk", SDKS)
@MODES
def test_c_a_slow_safety_checker(slow_safety: ServerProcess, sdk: str, use_async: bool) -> None:
    expected, _ = sdk_answer(sdk, slow_safety.url, **REQUEST)
    with httpx.Client(base_url=slow_safety.url, timeout=60) as http:
        before = _heartbeats(http)
        assert sdk_stream_text(sdk, slow_safety.url, use_async=use_async, **REQUEST) == expected
        assert _heartbeats(http) > before  # the checker took safety_checkers.SLOW_SECONDS (> 1 s) first


@pytest.mark.parametrize("sdk", SDKS)
@MODES
def test_d_a_resumed_stream(plain: ServerProcess, sdk: str, use_async: bool) -> None:
    """A message created without a reader, read with Last-Event-ID <id>:0 while it waits for the slot."""
    expected, _ = sdk_answer(sdk, plain.url, **REQUEST)
    path = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}[sdk]
    body = {"model": "any", "max_tokens": REQUEST["max_tokens"], "messages": REQUEST["messages"], "temperature": 0}

    def read() -> str:
        with httpx.Client(base_url=plain.url, timeout=60) as http:
            created = http.post(path, json=body, headers={"Prefer": "respond-async"}).json()
        return sdk_stream_text(sdk, plain.url, use_async=use_async, resume=created["id"],
                               last_event_id=f"{created['id']}:0")

    assert _behind_a_blocker(plain, read) == expected
