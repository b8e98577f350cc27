"""HTTP/2 through hypercorn: h2c with prior knowledge, TLS with ALPN (configured in TOML), and
cancelling one stream of a multiplexed connection cancels only that stream's reader."""

from __future__ import annotations

import datetime
import gc
import ipaddress
import json
import re
import ssl
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import hypercorn.protocol.h2
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ringserve.config import Config
from ringserve.core.sse import SSEParser
from ringserve.http.messages import message_status_json
from tests.support.h2client import open_h2
from tests.support.helpers import ANTHROPIC_BODY, anthropic_text, sse_events
from tests.support.server import fake_config, running_server

ECHO = {**ANTHROPIC_BODY, "stream": True, "messages": [{"role": "user", "content": "echo:over HTTP/2"}]}


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files (valid one day)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ringserve test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path


async def test_h2c_with_prior_knowledge(tmp_path):
    async with running_server(fake_config(tmp_path)) as state:
        async with httpx.AsyncClient(base_url=state.urls[0], http1=False, http2=True, timeout=30) as client:
            resp, events, _ = await sse_events(client, "POST", "/v1/messages", json=ECHO)
            assert resp.http_version == "HTTP/2"
            assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert events[-1].event == "message_stop"
            assert anthropic_text(events) == "over HTTP/2"


async def test_tls_with_alpn_from_toml(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    toml = tmp_path / "config.toml"
    toml.write_text(f'[server]\nport = 0\ncertfile = "{cert}"\nkeyfile = "{key}"\n'
                    f'[store]\npath = "{tmp_path / "store.sqlite3"}"\n')
    config = Config.from_toml(toml)
    trusted = ssl.create_default_context(cafile=str(cert))
    async with running_server(config) as state:
        url = state.urls[0]
        assert url.startswith("https://127.0.0.1:")
        for http2, version in ((True, "HTTP/2"), (False, "HTTP/1.1")):  # ALPN picks h2, or http/1.1
            async with httpx.AsyncClient(base_url=url, http2=http2, verify=trusted, timeout=30) as client:
                resp, events, _ = await sse_events(client, "POST", "/v1/messages", json=ECHO)
                assert resp.http_version == version
                assert events[-1].event == "message_stop"
                assert anthropic_text(events) == "over HTTP/2"


async def test_cancelling_one_http2_stream_cancels_only_its_reader(tmp_path):
    """Two streams multiplexed on one HTTP/2 connection; resetting one (RST_STREAM) cancels its
    generation (policy abort) and leaves the other to finish.

    A client of our own on the ``h2`` library: httpx (httpcore) never sends RST_STREAM when a
    response is closed early, it only forgets the stream.
    """
    reply = " ".join(f"w{i:02}" for i in range(60))  # 60 tokens of 4 bytes, 0.02 s each
    body = json.dumps({**ANTHROPIC_BODY, "stream": True, "max_tokens": 200}).encode()
    async with running_server(fake_config(tmp_path), step_seconds=0.02, reply=reply) as state:
        host, port = state.urls[0].removeprefix("http://").rsplit(":", 1)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        heads = [(":method", "POST"), (":scheme", "http"), (":authority", f"{host}:{port}"),
                 (":path", "/v1/messages"), ("content-type", "application/json"),
                 ("content-length", str(len(body)))]
        parsers = {1: SSEParser(), 3: SSEParser()}
        events: dict[int, list] = {1: [], 3: []}
        message_ids: dict[int, str] = {}
        for stream_id in parsers:
            conn.send_headers(stream_id, heads)
            conn.send_data(stream_id, body, end_stream=True)
        ended: set[int] = set()
        with trio.fail_after(15):
            sock = await trio.open_tcp_stream(host, int(port))
            async with sock:
                await sock.send_all(conn.data_to_send())
                while 3 not in ended:
                    data = await sock.receive_some(65536)
                    assert data, "the server closed the connection"
                    for ev in conn.receive_data(data):
                        if isinstance(ev, h2.events.ResponseReceived):
                            message_ids[ev.stream_id] = dict(ev.headers)[b"x-message-id"].decode()
                        elif isinstance(ev, h2.events.DataReceived):
                            conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                            if ev.stream_id not in ended:
                                events[ev.stream_id] += parsers[ev.stream_id].feed(ev.data)
                        elif isinstance(ev, h2.events.StreamEnded):
                            ended.add(ev.stream_id)
                    if 1 not in ended and all(
                        any(e.event == "content_block_delta" for e in events[i]) for i in (1, 3)
                    ):
                        conn.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
                        ended.add(1)
                    await sock.send_all(conn.data_to_send())
        msg = state.hub.live(message_ids[1])
        if msg is not None:
            with trio.fail_after(5):
                await msg.done.wait()  # the server saw the reset and the policy cancelled it
        async with httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
            cancelled = (await client.get(f"/v1/messages/{message_ids[1]}")).json()
    assert cancelled["status"] == "cancelled"
    assert cancelled["usage"]["output_tokens"] < 60
    assert events[3][-1].event == "message_stop"
    assert anthropic_text(events[3]) == reply
    final = json.loads(next(e for e in events[3] if e.event == "message_delta").data)
    assert final["delta"]["stop_reason"] == "end_turn"


def test_certfile_and_keyfile_go_together():
    with pytest.raises(ValueError, match="certfile and keyfile"):
        Config.from_dict({"server": {"certfile": "cert.pem"}})


@pytest.mark.parametrize("path, config_changes", [
    ("/nonexistent", {}),                                    # 404 before the body is read
    ("/v1/messages", {"auth": {"api_keys": ["sk-test"]}}),   # 401 before the body is read
    ("/v1/messages", {"server": {"max_body_bytes": 1000}}),  # 413 before the body is read
])
async def test_an_early_answer_to_a_big_h2_body_does_not_crash_the_server(tmp_path, path, config_changes):
    """hypercorn raised KeyError for DATA frames of a stream it had closed, which killed the server."""
    async with running_server(fake_config(tmp_path, **config_changes)) as state:
        url = state.urls[0]
        async with httpx.AsyncClient(http1=False, http2=True, base_url=url, timeout=10) as client:
            resp = await client.post(path, content=b"x" * 200_000, headers={"content-type": "application/json"})
            assert resp.status_code in (401, 404, 413)
        # the server (and every other connection) is still there
        async with httpx.AsyncClient(http1=False, http2=True, base_url=url, timeout=10) as client:
            for _ in range(3):
                assert (await client.get("/health")).status_code == 200
                await trio.sleep(0.05)


def _h2_buffered_bytes() -> int:
    """Response bytes held now in hypercorn's HTTP/2 stream buffers (all connections of this process)."""
    total = 0
    for o in gc.get_objects():
        try:
            if isinstance(o, hypercorn.protocol.h2.StreamBuffer):
                total += len(o.buffer)
        except ReferenceError:  # a weakref.proxy whose object is gone (isinstance looks through it)
            continue
    return total


#: Most bytes a stream whose window is shut may hold in hypercorn: its high-water mark (32 KiB) and two
#: sends (each at most 16 tokens of 2 KiB, coalesced), with room to spare; the answers are 2 MiB.
STUCK_BUFFER_BOUND = 256 * 1024


@pytest.mark.parametrize("tls", [False, True], ids=["h2c", "tls"])
async def test_streams_whose_window_never_opens_buffer_little_and_are_reset(tmp_path, tls):
    """A client with SETTINGS_INITIAL_WINDOW_SIZE 0 that never opens its streams' windows: while they
    are stuck, the server holds a bounded number of their bytes however long the answers (which run to
    the end under ``continue``); after slow_reader_timeout each stuck stream gets RST_STREAM (CANCEL), is
    counted as a dropped slow reader, and a generation under ``abort`` stops with it; the connection's
    other streams go on."""
    server: dict[str, object] = {"slow_reader_timeout": 60.0}
    cafile = None
    if tls:
        cert, key = self_signed_cert(tmp_path)
        server |= {"certfile": str(cert), "keyfile": str(key)}
        cafile = str(cert)
    config = fake_config(tmp_path, server=server, engine={"ctx_per_slot": 12000})
    def reply(kib: str) -> str:  # the user message says how long: "2048" is 2 MiB, 1024 tokens of 2 KiB
        return "0123456789abcdef" * (64 * int(kib))

    body = {**ANTHROPIC_BODY, "stream": True, "max_tokens": 10000, "messages": [{"role": "user", "content": "2048"}]}
    async with running_server(config, piece_bytes=2048, step_seconds=0.001, reply=reply) as state:
        client = await open_h2(state.urls[0], cafile)
        async with client.stream, trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            # a guard against a hang, not a timing: beside other work (load 8-12 on 2 cores) the 20 MiB
            # of answers took over 60 s
            with trio.fail_after(280):
                # Two stuck streams whose generations run to the end regardless of their reader.
                stuck = [await client.request("POST", "/v1/messages", body, read=False,
                                              headers={"ringserve-disconnect-policy": "continue"}) for _ in range(2)]
                await client.wait_for(lambda: all(client.streams[s].headers for s in stuck))
                ids = [client.streams[s].headers[b"x-message-id"].decode() for s in stuck]
                peak = 0
                for message_id in ids:
                    while (msg := state.hub.live(message_id)) is not None:
                        peak = max(peak, _h2_buffered_bytes())
                        with trio.move_on_after(0.2):
                            await msg.done.wait()
                finished = [message_status_json(state.hub, state.hub.lookup(i)) for i in ids]
                assert [m["status"] for m in finished] == ["complete", "complete"]
                assert all(m["text"] == reply("2048") for m in finished)  # 2 MiB each, none of it sent
                assert peak < STUCK_BUFFER_BOUND, peak
                assert not any(client.streams[s].body for s in stuck)
                assert state.watchdog.statistics().readers_dropped_total == 0

                # Now a short timeout: the stuck streams are reset; so is a new one, whose generation
                # (16 MiB, 8192 tokens, >= 8 s) stops with it under ``abort``.
                state.watchdog.timeout = 0.5
                long = {**body, "messages": [{"role": "user", "content": "16384"}]}
                aborted = await client.request("POST", "/v1/messages", long, read=False)
                await client.wait_for(lambda: client.streams[aborted].headers is not None)
                aborted_id = client.streams[aborted].headers[b"x-message-id"].decode()
                await client.wait_for(lambda: all(client.streams[s].reset_code is not None for s in [*stuck, aborted]))
                assert {client.streams[s].reset_code for s in [*stuck, aborted]} == {h2.errors.ErrorCodes.CANCEL}
                if (msg := state.hub.live(aborted_id)) is not None:
                    await msg.done.wait()
                cancelled = message_status_json(state.hub, state.hub.lookup(aborted_id))
                assert cancelled["status"] == "cancelled" and cancelled["usage"]["output_tokens"] < 8192 // 2
                assert _h2_buffered_bytes() == 0
                metrics = state.metrics.render().decode()
                assert re.search(r'^ringserve_slow_reader_disconnects_total\{reason="blocked"\} 3\.0$',
                                 metrics, re.MULTILINE), metrics

                # The connection itself is fine: a stream that reads gets its whole answer.
                echo = {**body, "messages": [{"role": "user", "content": "echo:still here"}]}
                reading = await client.request("POST", "/v1/messages", echo, read=True)
                await client.wait_for(lambda: client.streams[reading].ended)
                assert not client.closed
                events = SSEParser().feed(bytes(client.streams[reading].body))
                assert events[-1].event == "message_stop" and anthropic_text(events) == "still here"
            nursery.cancel_scope.cancel()
