"""The samplers and log probabilities a request asks for, on every surface (issue 40 item 4).

Each sampler field llama-server reads is read on every surface into the request's
``SamplingParams`` (None for each it does not send); each bad value is a 400 in the surface's
own shape naming the field; ``logprobs`` are read where the API has them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import LogitBias, SamplingParams
from ringserve.surfaces.base import read_request, token_text
from ringserve.surfaces.registry import ANTHROPIC, OPENAI
from ringserve.surfaces.responses import RESPONSES

MESSAGES = [{"role": "user", "content": "hi"}]
BODIES: dict[str, dict[str, Any]] = {
    "anthropic": {"model": "m", "max_tokens": 9, "messages": MESSAGES},
    "openai": {"model": "m", "messages": MESSAGES},
    "responses": {"model": "m", "input": "hi"},
}
SURFACES = {"anthropic": ANTHROPIC, "openai": OPENAI, "responses": RESPONSES}
ROUTES = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions", "responses": "/v1/responses"}

#: Every sampler field with a value, and what the request holds for it.
FIELDS: dict[str, tuple[Any, Any]] = {
    "temperature": (0.5, 0.5),
    "top_k": (12, 12),
    "top_p": (0.9, 0.9),
    "min_p": (0.1, 0.1),
    "typical_p": (0.7, 0.7),
    "repeat_penalty": (1.3, 1.3),
    "repeat_last_n": (32, 32),
    "presence_penalty": (-0.5, -0.5),
    "frequency_penalty": (1, 1.0),
    "dry_multiplier": (0.8, 0.8),
    "dry_base": (2, 2.0),
    "dry_allowed_length": (3, 3),
    "dry_penalty_last_n": (128, 128),
    "dry_sequence_breakers": (["\n", "."], ("\n", ".")),
    "xtc_probability": (0.5, 0.5),
    "xtc_threshold": (0.2, 0.2),
    "logit_bias": ({"42": 5}, (LogitBias(42, 5.0),)),
    "seed": (-1, 2**32 - 1),
}

#: (field, a bad value) pairs: each is a 400 naming the field on every surface.
BAD = [
    ("temperature", -0.1), ("temperature", "hot"), ("top_k", -1), ("top_k", 1.5), ("top_p", 1.01),
    ("min_p", -0.1),
    ("typical_p", 2), ("repeat_penalty", 0), ("repeat_penalty", -1.0), ("repeat_penalty", 10**400),
    ("repeat_last_n", -1), ("repeat_last_n", 2**31), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("frequency_penalty", True), ("dry_multiplier", -0.5), ("dry_base", "x"), ("dry_allowed_length", -2),
    ("dry_penalty_last_n", 0.5), ("dry_sequence_breakers", []), ("dry_sequence_breakers", "\n"),
    ("dry_sequence_breakers", [1]), ("xtc_probability", 1.5), ("xtc_threshold", -0.1), ("seed", "7"),
    ("logit_bias", 5), ("logit_bias", {"42": 101}), ("logit_bias", {"42": True}),
    ("logit_bias", {"42": "ban"}),
    ("logit_bias", [[42]]), ("logit_bias", [42, 5]), ("logit_bias", [[True, 5]]), ("logit_bias", [[None, 5]]),
]


def parse(surface: str, **fields: Any):
    return SURFACES[surface].parse_request({**BODIES[surface], **fields})


@pytest.mark.parametrize("surface", SURFACES)
def test_every_sampler_field_is_read_and_the_others_are_none(surface):
    assert parse(surface).request.sampling == SamplingParams()
    sent = {k: v for k, (v, _) in FIELDS.items()}
    parsed = read_request(SURFACES[surface].parse_request, {**BODIES[surface], **sent}, "")
    assert parsed.request.sampling == SamplingParams(**{k: want for k, (_, want) in FIELDS.items()})
    assert parsed.ignored == ()  # none of them is reported as ignored


@pytest.mark.parametrize("surface", SURFACES)
def test_a_dry_base_below_one_is_the_defaults_as_llama_server_reads_it(surface):
    assert parse(surface, dry_base=0.5).request.sampling.dry_base is None


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize(("field", "value"), BAD)
def test_a_bad_sampler_value_is_a_400_naming_the_field(surface, field, value):
    with pytest.raises(RingserveError) as err:
        parse(surface, **{field: value})
    assert (err.value.kind, err.value.param) == (ErrorKind.INVALID_REQUEST, field)
    assert err.value.message.startswith(field)


def test_the_temperatures_ceiling_is_the_apis():
    assert parse("openai", temperature=2).request.sampling.temperature == 2.0
    with pytest.raises(RingserveError, match="temperature: must be between 0.0 and 1.0"):
        parse("anthropic", temperature=1.5)


@pytest.mark.parametrize(("value", "want"), [
    ({"15339": -100, " 7": 3.5, "+8": 1, "-1": 0}, ((15339, -100.0), (7, 3.5), (8, 1.0), (-1, 0.0))),
    # texts, as strtol leaves them: a trailing space is no number
    ({"hello": False, "12ab": 2, " 7 ": 1}, (("hello", -math.inf), ("12ab", 2.0), (" 7 ", 1.0))),
    ([[15339, 100], ["hi", False], [0, -0.5]], ((15339, 100.0), ("hi", -math.inf), (0, -0.5))),
    ({}, ()),
    ([], ()),
])
def test_logit_bias_takes_what_llama_server_takes(value, want):
    """OpenAI's object of ids, llama-server's texts and ``[token, bias]`` pairs, ``false`` bans;
    the vocabulary is checked where the request is prepared (an id out of it is a 400 there)."""
    for surface in SURFACES:
        bias = parse(surface, logit_bias=value).request.sampling.logit_bias
        assert bias == tuple(LogitBias(*w) for w in want)


# -- log probabilities --------------------------------------------------------------------------


def test_chat_logprobs_and_top_logprobs():
    assert parse("openai").request.logprobs is None
    assert parse("openai", logprobs=False, top_logprobs=0).request.logprobs is None
    assert parse("openai", logprobs=True).request.logprobs == 0
    assert parse("openai", logprobs=True, top_logprobs=20).request.logprobs == 20
    for fields, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                          ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
                          ({"top_logprobs": 2}, "top_logprobs"),
                          ({"logprobs": 1}, "logprobs")):
        with pytest.raises(RingserveError) as err:
            parse("openai", **fields)
        assert err.value.param == param, fields


def test_responses_logprobs_are_asked_by_include_and_their_count_is_top_logprobs():
    include = ["message.output_text.logprobs"]
    assert parse("responses").request.logprobs is None
    assert parse("responses", top_logprobs=5).request.logprobs is None  # no include: none
    assert parse("responses", include=include).request.logprobs == 0
    body = {**BODIES["responses"], "include": include, "top_logprobs": 20}
    parsed = read_request(RESPONSES.parse_request, body, "")
    assert parsed.request.logprobs == 20 and parsed.ignored == ()
    assert RESPONSES.restored(parsed.echo, None).options.top_logprobs == 20
    with pytest.raises(RingserveError) as err:
        parse("responses", include=include, top_logprobs=21)
    assert err.value.param == "top_logprobs"


def test_anthropic_has_no_logprobs_a_field_of_them_is_reported_as_ignored():
    body = {**BODIES["anthropic"], "logprobs": True, "top_logprobs": 3}
    parsed = read_request(ANTHROPIC.parse_request, body, "")
    assert parsed.request.logprobs is None and parsed.ignored == ("logprobs", "top_logprobs")


@pytest.mark.parametrize(("piece", "text"), [
    (b"hello", "hello"),
    ("é".encode(), "é"),
    ("€".encode()[:2], ""),  # a character its bytes do not finish: cut, as llama-server's validate_utf8
    (b"a" + "😀".encode()[:3], "a"),
    ("😀".encode()[2:], "\ufffd\ufffd"),  # the end of a character: invalid on its own
    (b"\xff", "\ufffd"),
])
def test_a_tokens_text_is_its_bytes_but_a_cut_character(piece, text):
    assert token_text(piece) == text


# -- through the server: the 400 in each surface's shape ---------------------------------------


def check_400(surface: str, resp, field: str) -> None:
    assert resp.status_code == 400, resp.text
    body = resp.json()
    if surface == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == field
    assert body["error"]["message"].startswith(field)


@pytest.mark.parametrize("surface", SURFACES)
async def test_bad_samplers_and_unknown_tokens_are_400s_in_the_surfaces_shape(fake_server, surface):
    _state, client = fake_server
    for field, value in [*BAD[::4], ("logit_bias", {str(1 << 16): 1}), ("logit_bias", [[-1, 1]])]:
        for stream in (False, True):
            body = {**BODIES[surface], field: value, "stream": stream}
            check_400(surface, await client.post(ROUTES[surface], json=body), field)
    ok = await client.post(ROUTES[surface], json={**BODIES[surface], "logit_bias": {"hello": False, "7": 3}})
    assert ok.status_code == 200, ok.text
