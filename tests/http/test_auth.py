"""API keys, stream tokens, the loopback rule and the access log (ringserve/auth.py, http/accesslog.py).

Every /v1 route of both surfaces refuses a missing or wrong key with 401 in the
surface's own shape; /health, /ready and /metrics stay open. A stream token
reads one message's stream, within its lifetime, and nothing else. The access
log has one line per request and never a key or a token.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import httpx
import pytest

from ringserve.config import AuthConfig
from ringserve.core.sse import SSEParser
from ringserve.http.accesslog import redact_query
from ringserve.http.auth import ENV_KEY, ENV_KEYS, Authenticator, AuthSetupError, check_bind, is_loopback
from ringserve.server import serve
from tests.support.helpers import ANTHROPIC_BODY, OPENAI_BODY
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until

KEY = "sk-test-0123456789abcdef"
OTHER_KEY = "sk-other-key"
ASYNC = {"Prefer": "respond-async"}
ROUTES = {"/v1/messages": ANTHROPIC_BODY, "/v1/chat/completions": OPENAI_BODY}


def assert_401(resp: httpx.Response, surface: str, says: str = "a valid API key is required") -> None:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"].startswith("Bearer")
    body = resp.json()
    assert says in body["error"]["message"]
    if surface == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"


@pytest.fixture
async def keyed(tmp_path):
    """A fake-engine server with two keys; yields (state, client without credentials)."""
    config = fake_config(tmp_path, auth={"api_keys": [KEY, OTHER_KEY]})
    async with running_server(config) as state, httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client:
        yield state, client


# -- unit: keys, tokens, loopback ------------------------------------------------------------


def test_keys_from_config_and_environment():
    auth = Authenticator.from_config(AuthConfig(api_keys=("a-key",)), {ENV_KEYS: " b-key, ,c-key "})
    assert auth.enabled
    assert all(auth.key_matches(k) for k in ("a-key", "b-key", "c-key"))
    assert not any(auth.key_matches(k) for k in ("", "a-ke", "a-key ", "b-key,c-key", None))
    assert not Authenticator.from_config(AuthConfig(), {}).enabled
    assert "a-key" not in repr(auth) and "b-key" not in repr(auth)
    one = Authenticator.from_config(AuthConfig(), {ENV_KEY: "d-key"})  # the clients' and launch's variable
    assert one.enabled and one.key_matches("d-key") and not one.key_matches("a-key")


@pytest.mark.parametrize("bad", ["has space", "tab\there", "caf\u00e9", "x" * 513])
def test_malformed_keys_are_refused_at_start(bad):
    with pytest.raises(AuthSetupError):
        Authenticator.from_config(AuthConfig(api_keys=(bad,)), {})


def test_bearer_scheme_is_case_insensitive_and_either_header_works():
    auth = Authenticator.from_config(AuthConfig(api_keys=(KEY,)), {})
    assert auth.request_key_ok({"Authorization": f"Bearer {KEY}"})
    assert auth.request_key_ok({"Authorization": f"bearer  {KEY}"})
    assert auth.request_key_ok({"x-api-key": KEY})
    assert auth.request_key_ok({"Authorization": "Bearer wrong", "x-api-key": KEY})
    assert not auth.request_key_ok({"Authorization": f"Basic {KEY}"})
    assert not auth.request_key_ok({"Authorization": KEY})
    assert not auth.request_key_ok({})


def test_stream_token_is_bound_to_one_message_and_expires():
    now = 1_000_000.0
    auth = Authenticator(token_ttl=60.0, clock=lambda: now)
    token, expires = auth.issue("msg_a")
    assert expires == 1_000_060
    assert auth.token_ok(token, "msg_a")
    assert not auth.token_ok(token, "msg_b")
    now = 1_000_060.0
    assert not auth.token_ok(token, "msg_a")
    # another server's secret, a changed expiry, a changed MAC, junk
    assert not Authenticator(clock=lambda: 0.0).token_ok(token, "msg_a")
    later = auth.issue("msg_a", now=now)[0]
    forged_expiry = f"{int(later.split('.')[0]) + 999}.{later.split('.')[1]}"
    assert auth.token_ok(later, "msg_a") and not auth.token_ok(forged_expiry, "msg_a")
    mac = later.split(".")[1]
    flipped = later[:-1] + ("A" if mac[-1] != "A" else "B")
    for bad in (flipped, "", ".", "123", "abc.def", "-1.x", "1e9.x", "\x00.\x00", "9" * 200, None):
        assert not auth.token_ok(bad, "msg_a"), bad


def test_a_stream_token_has_one_spelling():
    """The MAC covers the expiry's integer; any other text of that integer, or of the token, is refused."""
    auth = Authenticator(token_ttl=60.0, clock=lambda: 1_000_000.0)
    token, expires = auth.issue("msg_a")
    mac = token.partition(".")[2]
    assert auth.token_ok(token, "msg_a")
    for other in (f"0{token}", f"00{token}", f"+{token}", f" {token}", f"{token} ", f"{token}=", f"{token}.",
                  f"{expires}.{mac}.", f"{expires}..{mac}", f"{expires:_}.{mac}", f"{token}\n"):
        assert not auth.token_ok(other, "msg_a"), other


@pytest.mark.parametrize(
    "host, loopback", [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
                       ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.1", False),
                       ("example.com", False), ("", False)],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_check_bind():
    open_ = Authenticator()
    keyed = Authenticator.from_config(AuthConfig(api_keys=(KEY,)), {})
    check_bind("127.0.0.1", open_, False)
    check_bind("0.0.0.0", keyed, False)
    check_bind("0.0.0.0", open_, True)
    with pytest.raises(AuthSetupError, match="0.0.0.0") as info:
        check_bind("0.0.0.0", open_, False)
    assert "\n" not in str(info.value) and "allow_remote_without_keys" in str(info.value)


async def test_serve_refuses_a_remote_host_without_keys_before_binding(tmp_path):
    config = fake_config(tmp_path).replace("server", host="0.0.0.0")
    with pytest.raises(AuthSetupError):
        await serve(config, lambda _c: pytest.fail("must not load an engine"), handle_signals=False)
    assert not (tmp_path / "store.sqlite3").exists()


def test_cli_prints_one_line_and_exits_2_for_a_remote_host_without_keys():
    env = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "ringserve", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ringserve: refusing to listen on 0.0.0.0")


# -- HTTP: every /v1 route needs a key -------------------------------------------------------


@pytest.mark.parametrize("path", list(ROUTES))
async def test_generation_routes_need_a_valid_key(keyed, path):
    _, client = keyed
    surface = "anthropic" if path == "/v1/messages" else "openai"
    assert_401(await client.post(path, json=ROUTES[path]), surface)
    assert_401(await client.post(path, json=ROUTES[path], headers={"x-api-key": "sk-wrong"}), surface)
    assert_401(await client.post(path, json=ROUTES[path], headers={"Authorization": "Bearer sk-wrong"}), surface)
    assert_401(await client.post(path, json=ROUTES[path], headers={"Authorization": f"Basic {KEY}"}), surface)
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}, {"x-api-key": OTHER_KEY}):
        resp = await client.post(path, json=ROUTES[path], headers=headers)
        assert resp.status_code == 200, resp.text


async def test_a_missing_key_is_refused_before_the_body_is_read(keyed):
    _, client = keyed
    resp = await client.post("/v1/messages", content=b"x" * (8 * 1024 * 1024))
    assert_401(resp, "anthropic")


async def test_message_routes_and_models_need_a_key_in_the_surface_shape(keyed):
    _, client = keyed
    auth = {"x-api-key": KEY}
    ids = {}
    for path, surface in (("/v1/messages", "anthropic"), ("/v1/chat/completions", "openai")):
        ids[surface] = (await client.post(path, json=ROUTES[path], headers=auth)).json()["id"]
    for surface, mid in ids.items():
        for method, url in (("GET", f"/v1/messages/{mid}"), ("GET", f"/v1/messages/{mid}/stream"),
                            ("POST", f"/v1/messages/{mid}/cancel"), ("POST", f"/v1/messages/{mid}/stream_token")):
            assert_401(await client.request(method, url), surface)
            assert (await client.request(method, url, headers=auth)).status_code == 200, url
    assert_401(await client.get("/v1/models"), "openai")
    assert_401(await client.get("/v1/models", headers={"anthropic-version": "2023-06-01"}), "anthropic")
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
    assert_401(await client.get("/v1/no-such-route"), "openai")  # OpenAI's shape outside /v1/messages


async def test_health_ready_and_metrics_stay_open(keyed):
    _, client = keyed
    for path in ("/health", "/ready", "/metrics"):
        assert (await client.get(path)).status_code == 200, path


# -- HTTP: stream tokens ---------------------------------------------------------------------


async def read_stream(client: httpx.AsyncClient, url: str, **kwargs) -> tuple[int, list]:
    resp = await client.get(url, **kwargs)
    return resp.status_code, SSEParser().feed(resp.content) if resp.status_code == 200 else []


@pytest.mark.parametrize("path", list(ROUTES))
async def test_respond_async_gives_a_stream_token_that_reads_without_a_key(keyed, path):
    _, client = keyed
    created = await client.post(path, json=ROUTES[path], headers={**ASYNC, "x-api-key": KEY})
    assert created.status_code == 202
    body = created.json()
    mid, token = body["id"], body["stream_token"]
    assert body["stream_url"] == f"/v1/messages/{mid}/stream?stream_token={token}"
    status, events = await read_stream(client, body["stream_url"])
    assert status == 200
    assert events[-1].event == "message_stop" or events[-1].data == "[DONE]"
    # EventSource's automatic reconnect re-sends the same URL, now with Last-Event-ID: accepted.
    status, again = await read_stream(client, body["stream_url"], headers={"Last-Event-ID": events[-2].id})
    assert (status, again) == (200, events[-1:])


async def test_stream_token_route_and_refusals(keyed):
    state, client = keyed
    auth = {"x-api-key": KEY}
    a = (await client.post("/v1/messages", json=ANTHROPIC_BODY, headers={**ASYNC, **auth})).json()["id"]
    b = (await client.post("/v1/chat/completions", json=OPENAI_BODY, headers={**ASYNC, **auth})).json()["id"]
    issued = await client.post(f"/v1/messages/{a}/stream_token", headers=auth)
    assert issued.status_code == 200
    token = issued.json()["stream_token"]
    assert issued.json()["stream_url"] == f"/v1/messages/{a}/stream?stream_token={token}"
    assert (await read_stream(client, f"/v1/messages/{a}/stream", params={"stream_token": token}))[0] == 200
    # another message's token, an expired one, a forged one: the answer says how to get a new token
    renew = "the stream token is invalid, expired or for another message"
    resp = await client.get(f"/v1/messages/{b}/stream", params={"stream_token": token})
    assert_401(resp, "openai", says=renew)
    assert f"POST /v1/messages/{b}/stream_token" in resp.json()["error"]["message"]
    expired, _ = state.auth.issue(a, now=0.0)
    assert_401(await client.get(f"/v1/messages/{a}/stream", params={"stream_token": expired}), "anthropic", renew)
    forged = token.split(".")[0] + "." + "A" * 43
    assert_401(await client.get(f"/v1/messages/{a}/stream", params={"stream_token": forged}), "anthropic", renew)
    assert_401(await client.get(f"/v1/messages/{a}/stream", params={"stream_token": "0" + token}), "anthropic", renew)
    assert_401(await client.get(f"/v1/messages/{a}/stream"), "anthropic")
    # a token opens only the stream route, not the message itself or its cancel
    assert_401(await client.get(f"/v1/messages/{a}", params={"stream_token": token}), "anthropic")
    assert_401(await client.post(f"/v1/messages/{a}/cancel", params={"stream_token": token}), "anthropic")
    # unknown message: the key is valid, so the answer is 404, not a token
    assert (await client.post("/v1/messages/msg_nope/stream_token", headers=auth)).status_code == 404


# -- the access log --------------------------------------------------------------------------


async def test_access_log_has_one_line_per_request_and_no_secret(keyed, caplog):
    state, client = keyed
    caplog.set_level(logging.DEBUG)
    auth = {"Authorization": f"Bearer {KEY}"}
    created = await client.post("/v1/messages", json=ANTHROPIC_BODY, headers={**ASYNC, "x-api-key": KEY})
    mid, token = created.json()["id"], created.json()["stream_token"]
    await wait_until(lambda: state.hub.live(mid) is None)  # ended: event 1 exists (a 202 comes before it)
    await client.get(created.json()["stream_url"], headers={"Last-Event-ID": f"{mid}:1"})
    await client.get(f"/v1/messages/{mid}/stream?stream_token={token}&api_key={OTHER_KEY}&last_event_id=")
    await client.post(f"/v1/messages/{mid}/stream_token", headers=auth)
    await client.post("/v1/chat/completions", json=OPENAI_BODY, headers={"Authorization": f"Bearer {OTHER_KEY}x"})
    await client.get("/health", headers={"X-Request-Id": "req-42"})

    def access_records() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "ringserve.access"]

    # the line is written once the response has ended, which can be just after the client has it
    await wait_until(lambda: len(access_records()) >= 6)
    access = access_records()
    lines = [json.loads(r.getMessage()) for r in access]
    assert len(lines) == 6
    post, resume, by_token, token_route, refused, health = lines
    assert post["route"] == "/v1/messages" and post["status"] == 202 and post["message_id"] == mid
    assert resume == {**resume, "route": "/v1/messages/<message_id>/stream", "status": 200, "resume": True,
                      "message_id": mid, "query": "stream_token=[redacted]"}
    assert resume["bytes"] > 0 and resume["duration_s"] >= 0
    assert by_token["query"] == "stream_token=[redacted]&api_key=[redacted]&last_event_id="
    assert token_route["status"] == 200 and not token_route["resume"]
    assert refused["status"] == 401 and refused["error_type"] == "authentication"
    assert health["request_id"] == "req-42"
    assert len({line["request_id"] for line in lines}) == 6
    server_side = [r for r in caplog.records if r.name.startswith(("ringserve", "hypercorn", "quart"))]
    everything = "\n".join(
        [r.getMessage() for r in server_side] + [json.dumps(getattr(r, "access", None)) for r in access]
    )
    for secret in (KEY, OTHER_KEY, token, token.split(".")[1]):
        assert secret not in everything


@pytest.mark.parametrize("query, secret", [
    (b"stream_token=SECRET1", "SECRET1"),
    (b"stream_token%3DSECRET2", "SECRET2"),      # the token inside a parameter name
    (b"a=1;stream_token=SECRET3", "SECRET3"),    # the token inside a value
    (b"x=1&API_KEY=SECRET4", "SECRET4"),
])
def test_redaction_catches_smuggled_tokens(query, secret):
    assert secret not in redact_query(query)
    assert redact_query(b"last_event_id=msg_1%3A4&a=b") == "last_event_id=msg_1%3A4&a=b"
