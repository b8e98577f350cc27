"""What two replicas share through one redis-server, in one process each on the fake engine: the
messages that were live across a Redis restart read back whole through the other replica, a
``previous_response_id`` chain continues on any replica, and a delete through either replica
deletes the response everywhere."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ringserve.core.batch import Sampled, SlotFeed
from ringserve.engine.fake import FakeEngine
from tests.support.redis_server import RedisServer, needs_redis
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until

pytest.importorskip("coredis", reason="the redis extra is not installed (pip install 'ringserve[redis]')")

pytestmark = needs_redis

REPLY = "abcdefghij" * 240


class GatedEngine(FakeEngine):
    """The fake engine, whose decode calls wait while :attr:`gate` is clear (the test's hand on
    the generation: it pauses and goes on at the facts the test waits for, not at times)."""

    def __init__(self, gate: threading.Event, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = gate

    def decode(self, feeds: Sequence[SlotFeed]) -> list[Sampled]:
        self.gate.wait()
        return super().decode(feeds)


@asynccontextmanager
async def two_replicas(tmp_path: Path, redis: RedisServer, gate: threading.Event,
                       **engine: Any) -> AsyncIterator[tuple[Any, Any]]:
    """Replicas A and B (their ServerStates) on ``redis``; A's engine decodes while ``gate`` is set."""
    configs = []
    for name in "ab":
        (tmp_path / name).mkdir()
        configs.append(fake_config(tmp_path / name, stream={"backend": "redis", "redis_url": redis.url}))
    async with running_server(configs[0], lambda _config: GatedEngine(gate, **engine)) as a, \
            running_server(configs[1], **engine) as b:
        try:
            yield a, b
        finally:
            gate.set()  # a decode waiting on it lets the servers stop


def _url(replica: Any) -> str:
    return replica.urls[0]


async def _events(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> bytes:
    """The whole SSE body of a resume (it ends at the terminal event of an ended message)."""
    resp = await client.get(url, headers=headers)
    assert resp.status_code == 200, (url, resp.status_code, resp.text)
    return resp.content


async def test_responses_live_across_a_redis_restart_read_back_whole_through_the_other_replica(tmp_path):
    """Three background responses generate on A; Redis stops while they run and starts again
    (empty: no persistence) before they end. Through B afterwards, each one's status, Response
    object and resume after an early event are what A answers: the owner writes a status hash that
    went missing whole again (not only the fields that changed, which B read as a 500), and B
    rebuilds a stream whose head the restart lost from that state."""
    gate = threading.Event()
    gate.set()
    redis = RedisServer(tmp_path)
    try:
        # 1,200 tokens of 2 bytes, 5 ms each: it ends only after the steps below let it go on
        engine = {"piece_bytes": 2, "step_seconds": 0.005, "reply": REPLY}
        async with two_replicas(tmp_path, redis, gate, **engine) as (a, b), \
                httpx.AsyncClient(timeout=30) as client:
            body = {"model": "any", "input": "hello", "background": True, "max_output_tokens": 2000}
            ids = []
            for _ in range(3):
                resp = await client.post(f"{_url(a)}/v1/responses", json=body)
                assert resp.status_code == 200, resp.text
                ids.append(resp.json()["id"])

            async def seen_on_b_with_text() -> bool:
                for response_id in ids:
                    status = (await client.get(f"{_url(b)}/v1/messages/{response_id}")).json()
                    if status.get("status") != "generating" or not status["text"]:
                        return False
                return True

            await wait_until(seen_on_b_with_text)
            gate.clear()
            redis.stop()
            await wait_until(lambda: not a.hub.logs.available and not b.hub.logs.available)
            # A goes on while Redis is down: its entries and state wait in its flusher's queue
            marks = {response_id: a.hub.live(response_id).open_log.next_seq for response_id in ids}
            gate.set()
            await wait_until(lambda: all(a.hub.live(i).open_log.next_seq > marks[i] + 5 for i in ids))
            gate.clear()
            redis = RedisServer(tmp_path, port=redis.port)  # the same address, nothing in it
            await wait_until(lambda: a.hub.logs.available and b.hub.logs.available)
            gate.set()

            await wait_until(lambda: not any(a.hub.live(i) for i in ids), timeout=60)

            async def ended_on_b() -> bool:  # A's last state reaches Redis by its flusher, after A ends
                statuses = [(await client.get(f"{_url(b)}/v1/messages/{i}")).json()["status"] for i in ids]
                return "generating" not in statuses

            await wait_until(ended_on_b)
            for response_id in ids:
                on_a = await client.get(f"{_url(a)}/v1/messages/{response_id}")
                on_b = await client.get(f"{_url(b)}/v1/messages/{response_id}")
                assert on_b.status_code == 200, on_b.text
                assert on_b.json() == on_a.json() and on_a.json()["text"] == REPLY
                object_a = await client.get(f"{_url(a)}/v1/responses/{response_id}")
                object_b = await client.get(f"{_url(b)}/v1/responses/{response_id}")
                assert object_b.status_code == 200 and object_b.json() == object_a.json()
                resume = {"Last-Event-ID": f"{response_id}:2"}  # in the head the restart lost
                stream = f"/v1/responses/{response_id}?stream=true"
                whole = await _events(client, f"{_url(a)}{stream}", resume)
                assert await _events(client, f"{_url(b)}{stream}", resume) == whole
                assert b"response.completed" in whole
    finally:
        redis.stop()


async def test_a_previous_response_id_chain_continues_on_either_replica(tmp_path):
    """A conversation whose turns go to A and B in turn, as a round-robin balancer sends them: each
    turn continues the one the other replica just answered (its end may not have reached Redis
    yet), and its prompt is the whole conversation, the same on both replicas (the render and
    ``input_tokens`` routes, and the generation's own count). Each replica read only its own
    SQLite for the chain: the second turn was a 404."""
    gate = threading.Event()
    gate.set()
    redis = RedisServer(tmp_path)
    try:
        async with two_replicas(tmp_path, redis, gate, reply=lambda text: f"reply to {text}") as (a, b), \
                httpx.AsyncClient(timeout=30) as client:
            previous: dict[str, str] = {}
            for turn in range(5):
                here, there = (a, b) if turn % 2 == 0 else (b, a)
                body = {"model": "any", "input": f"turn {turn}", **previous}
                resp = await client.post(f"{_url(here)}/v1/responses", json=body)
                assert resp.status_code == 200, (turn, resp.text)
                answer = resp.json()
                assert answer["status"] == "completed"
                assert answer["output"][0]["content"][0]["text"] == f"reply to turn {turn}"
                prompts = [(await client.post(f"{_url(r)}/v1/responses/render", json=body)).json()
                           for r in (a, b)]
                counts = [(await client.post(f"{_url(r)}/v1/responses/input_tokens", json=body)).json()
                          for r in (a, b)]
                assert prompts[0] == prompts[1] and counts[0] == counts[1]
                assert prompts[0]["input_tokens"] == counts[0]["input_tokens"]
                assert counts[0]["input_tokens"] == answer["usage"]["input_tokens"]
                turns = [f"<|user|>turn {i}\n<|assistant|>reply to turn {i}\n" for i in range(turn)]
                assert prompts[0]["prompt"].startswith("".join(turns) + f"<|user|>turn {turn}\n"), prompts[0]
                previous = {"previous_response_id": answer["id"]}
            assert there is not here
    finally:
        redis.stop()


async def test_a_delete_through_either_replica_deletes_the_response_everywhere(tmp_path, monkeypatch):
    """``DELETE /v1/responses/{id}`` through B of a response A made (ended, or still generating)
    is relayed to A, which deletes its row, its status hash and its stream; through A it deletes
    the hash too (B and A itself read it from Redis for a day). Either way both replicas then
    answer 404, and B answered ``deleted: true`` only once it was. When the replica that holds
    the response does not delete it, the answer is a 503 that says so, not ``deleted: true``."""
    from ringserve.logs import redis as redis_module

    gate = threading.Event()
    gate.set()
    redis = RedisServer(tmp_path)
    try:
        async with two_replicas(tmp_path, redis, gate, piece_bytes=2, reply=REPLY) as (a, b), \
                httpx.AsyncClient(timeout=30) as client:
            body = {"model": "any", "input": "hello"}

            async def made_on_a(**extra: Any) -> str:
                resp = await client.post(f"{_url(a)}/v1/responses", json={**body, **extra})
                assert resp.status_code == 200, resp.text
                response_id = resp.json()["id"]

                async def seen_on_b() -> bool:
                    return (await client.get(f"{_url(b)}/v1/responses/{response_id}")).status_code == 200

                await wait_until(seen_on_b)
                return response_id

            async def gone_everywhere(response_id: str) -> None:
                for replica in (a, b):
                    got = await client.get(f"{_url(replica)}/v1/responses/{response_id}")
                    assert got.status_code == 404, (replica.urls, got.text)
                    again = await client.delete(f"{_url(replica)}/v1/responses/{response_id}")
                    assert again.status_code == 404, again.text
                assert a.hub.store.get(response_id) is None

            for through in (b, a):
                response_id = await made_on_a()
                deleted = await client.delete(f"{_url(through)}/v1/responses/{response_id}")
                assert deleted.status_code == 200, deleted.text
                assert deleted.json() == {"id": response_id, "object": "response.deleted", "deleted": True}
                await gone_everywhere(response_id)

            gate.clear()  # a background response still generating on A, deleted through B
            response_id = await made_on_a(background=True)
            answers: list[httpx.Response] = []
            async with trio.open_nursery() as nursery:

                async def delete_through_b() -> None:
                    answers.append(await client.delete(f"{_url(b)}/v1/responses/{response_id}"))

                nursery.start_soon(delete_through_b)
                def cancelled_on_a() -> bool:  # B's cancel reached A (the message ends at once)
                    live = a.hub.live(response_id)
                    return live is None or live.cancel_reason is not None

                await wait_until(cancelled_on_a)
                gate.set()
            assert answers[0].status_code == 200 and answers[0].json()["deleted"] is True, answers[0].text
            await gone_everywhere(response_id)

            monkeypatch.setattr(redis_module, "DELETE_WAIT_SECONDS", 0.5)
            response_id = await made_on_a()
            monkeypatch.setattr(a.hub.logs, "on_delete", None)  # A does not act on the relayed delete
            refused = await client.delete(f"{_url(b)}/v1/responses/{response_id}")
            assert refused.status_code == 503, refused.text
            assert "was not deleted" in refused.json()["error"]["message"]
            for replica in (a, b):
                assert (await client.get(f"{_url(replica)}/v1/responses/{response_id}")).status_code == 200
    finally:
        redis.stop()
