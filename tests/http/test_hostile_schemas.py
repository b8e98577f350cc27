"""Hostile JSON schemas on every request form that takes one (issue 36 items 1, 3, 4): a 400 in
the surface's shape naming the field, never a 500; refused before any grammar is made; a
server's memory stays bounded; a grammar that fails in one slot leaves the others alone.

The forms: Anthropic ``tools[i].input_schema`` and ``output_config.format.schema`` on
``/v1/messages`` and ``/v1/messages/count_tokens``; OpenAI Chat ``tools[i].function.parameters``
and ``response_format.json_schema.schema``; Responses ``tools[i].parameters`` and
``text.format.schema`` on ``/v1/responses`` and ``/v1/responses/input_tokens``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.common import default_runner
from ringserve.engine import examples, gbnf
from tests.http.test_drain import FakeServerProcess
from tests.http.test_hostile import ThreadedServer, assert_answer, client  # noqa: F401 - client: over this module's server
from tests.support.server import fake_config

#: The issue's schema: about 300 bytes, 2,200 repetitions in the grammar, 200 million characters in any value.
BOMB = {
    "type": "object",
    "properties": {"a": {"type": "array", "minItems": 1000, "items": {
        "type": "array", "minItems": 1000, "items": {"type": "string", "minLength": 200}}}},
    "required": ["a"],
}
USER = [{"role": "user", "content": "hi"}]


@attrs.frozen
class Form:
    """One place a request takes a schema: the route, the body around the schema, the error's
    ``param`` (None: Anthropic's errors have none) and the schema's path in the message."""

    name: str
    path: str
    body: Callable[[Any], dict[str, Any]]
    param: str | None
    where: str

    @property
    def surface(self) -> str:
        return "anthropic" if self.path.startswith("/v1/messages") else "openai"


def _anthropic_tool(schema: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, "messages": USER,
            "tools": [{"name": "f", "input_schema": schema, "strict": True}]}


def _anthropic_output(schema: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, "messages": USER,
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}


def _count(body: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    def without_max_tokens(schema: Any) -> dict[str, Any]:
        return {k: v for k, v in body(schema).items() if k != "max_tokens"}

    return without_max_tokens


def _openai_tool(schema: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]}


def _openai_format(schema: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _responses_tool(schema: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": schema, "strict": True}]}


def _responses_format(schema: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}


FORMS = [
    Form("anthropic tool", "/v1/messages", _anthropic_tool, None, "tools[0].input_schema"),
    Form("anthropic output", "/v1/messages", _anthropic_output, None, "output_config.format.schema"),
    Form("count_tokens tool", "/v1/messages/count_tokens", _count(_anthropic_tool), None, "tools[0].input_schema"),
    Form("count_tokens output", "/v1/messages/count_tokens", _count(_anthropic_output), None,
         "output_config.format.schema"),
    Form("chat tool", "/v1/chat/completions", _openai_tool, "tools", "tools[0].function.parameters"),
    Form("chat response_format", "/v1/chat/completions", _openai_format, "response_format",
         "response_format.json_schema.schema"),
    Form("responses tool", "/v1/responses", _responses_tool, "tools", "tools[0].parameters"),
    Form("responses text.format", "/v1/responses", _responses_format, "text", "text.format.schema"),
    Form("input_tokens tool", "/v1/responses/input_tokens", _responses_tool, "tools", "tools[0].parameters"),
    Form("input_tokens text.format", "/v1/responses/input_tokens", _responses_format, "text", "text.format.schema"),
]
FORM_IDS = [form.name for form in FORMS]


def refusal(form: Form, response: httpx.Response) -> str:
    """The message of a 400 in the form's surface shape (with the form's ``param`` on OpenAI's)."""
    assert response.status_code == 400, (form.name, response.status_code, response.text[:300])
    assert_answer(form.surface, response.status_code, response.content)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if form.param is not None:
        assert error["param"] == form.param
    return str(error["message"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    srv = ThreadedServer(fake_config(tmp_path_factory.mktemp("schemas"), engine={"slots": 4, "ctx_per_slot": 2048}))
    srv.peak_at_start = peak_rss_bytes(os.getpid()) if sys.platform.startswith("linux") else 0
    yield srv
    srv.close()


@attrs.define
class Probe:
    """Counts the grammars made and the examples built while it is on."""

    grammars: int = 0
    examples: int = 0


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Probe:
    counts = Probe()
    convert, instance = gbnf._convert, examples.example_instance

    def counted_convert(*args: Any) -> Any:
        counts.grammars += 1
        return convert(*args)

    def counted_instance(*args: Any) -> Any:
        counts.examples += 1
        return instance(*args)

    monkeypatch.setattr(gbnf, "_convert", counted_convert)
    monkeypatch.setattr(examples, "example_instance", counted_instance)
    return counts


# -- item 1: a schema is bounded by what it can cost -------------------------------------------


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_the_bomb_is_a_400_naming_the_keyword_before_any_grammar_is_made(client, probe, form):
    message = refusal(form, client.post(form.path, json=form.body(BOMB)))
    assert message.startswith(f"{form.where}.properties.a.items: 'minItems' 1000 times the 200 repetitions")
    assert probe.grammars == 0 and probe.examples == 0


@pytest.mark.parametrize("form", [f for f in FORMS if "output" in f.name or "format" in f.name],
                         ids=lambda f: f.name)
def test_the_probe_sees_the_grammars_made(client, probe, form):
    """A generation makes its grammar (so the probe above can see one); a count makes none, since
    a grammar adds nothing to the prompt (``Runner.count``)."""
    fine = client.post(form.path, json=form.body({"type": "object", "properties": {form.name: {"type": "integer"}}}))
    assert fine.status_code == 200, fine.text[:300]
    counting = form.path.endswith(("/count_tokens", "/input_tokens"))
    assert probe.grammars == (0 if counting else 1)


ROOT = Path(__file__).resolve().parents[2]


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (``VmHWM`` in ``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_process_under_the_bomb_stays_within_its_memory(tmp_path):
    """The issue's request took a server from 74 MB to 3.19 GB. Every form, three times over
    (distinct schemas, so no cache answers): refused, and the peak grows by less than 32 MB."""
    server = FakeServerProcess(tmp_path, {"engine": {"slots": 2, "ctx_per_slot": 2048}}, {})
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            fine = client.post("/v1/messages", json=_anthropic_output({"type": "object"}))
            assert fine.status_code == 200
            before = peak_rss_bytes(server.proc.pid)
            for round_ in range(3):
                for form in FORMS:
                    bomb = {**BOMB, "title": f"round {round_}"}
                    refusal(form, client.post(form.path, json=form.body(bomb)))
            after = peak_rss_bytes(server.proc.pid)
    finally:
        assert server.stop() == 0
    assert after - before < 32 << 20, (before, after)


# -- item 3: a $ref that names what is not a schema --------------------------------------------

REF_TO_A_LIST = {"type": "object", "properties": {"a": {"$ref": "#/required"}}, "required": ["a"]}


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_a_ref_to_a_list_is_a_400_naming_the_reference(client, form):
    """Was a 500 on every form: the converter took the list for a schema (AttributeError)."""
    message = refusal(form, client.post(form.path, json=form.body(REF_TO_A_LIST)))
    assert message == f"{form.where}.properties.a: '$ref' '#/required' names a list that is not a schema (a keyword's value)"


# -- item 4: a strict tool under auto is refused as the forced one is --------------------------

LEFT_RECURSIVE = {"type": "object", "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "integer"}]}},
                  "properties": {"x": {"$ref": "#/$defs/a"}}}


@pytest.mark.parametrize("form", [f for f in FORMS if "tool" in f.name], ids=lambda f: f.name)
def test_a_strict_tool_under_auto_is_refused_as_the_forced_one(client, form):
    """A schema llama.cpp cannot take as a grammar (left recursion): under auto the request was
    admitted and failed with a 500 at the engine's start ("the engine could not start")."""
    auto = form.body(LEFT_RECURSIVE)
    forced = {**auto, "tool_choice": {"type": "any"} if form.surface == "anthropic" else "required"}
    messages = [refusal(form, client.post(form.path, json=body)) for body in (auto, forced)]
    assert messages[0] == messages[1] == (f"{form.where}.$defs.a.anyOf[0]: '$ref' '#/$defs/a' leads back to itself"
                                          " through '$ref' and 'anyOf' alone (left recursion, which llama.cpp's"
                                          " grammar parser refuses)")


# -- a property: any schema on any form ---------------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                           max_leaves=6)
names = st.text(max_size=8) | st.sampled_from(["a", "b", "$ref", "items", "A" * 3000])
bounds = st.integers(0, 4) | st.integers(0, 3000) | st.sampled_from([-1, 10**6, 10**20, 1.5, True, "3", None])
refs = st.sampled_from(["#/required", "#/properties", "#/properties/a", "#/properties/a/items", "#/$defs/a", "#/$defs/b",
                        "#/definitions/a", "#/$defs/a/anyOf", "#", "#/", "#/~0", "https://example.com/s", ""]) | json_values
types = (st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null", "date"])
         | st.lists(st.sampled_from(["string", "null", "object", 3]), max_size=3))


def _node(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries({}, optional={
        "type": types, "properties": st.dictionaries(names, inner, max_size=4), "required": st.lists(names, max_size=3),
        "items": inner | st.lists(inner, max_size=2), "prefixItems": st.lists(inner, max_size=2),
        "anyOf": st.lists(inner, max_size=3), "$ref": refs, "$defs": st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2),
        "minItems": bounds, "maxItems": bounds, "minLength": bounds, "maxLength": bounds,
        "additionalProperties": st.booleans() | inner, "enum": st.lists(json_values, max_size=3), "const": json_values,
        "format": st.sampled_from(["date", "uuid", "email"]), "description": st.text(max_size=4), "oneOf": st.lists(inner, max_size=2),
    })


hostile = st.recursive(st.fixed_dictionaries({"type": types}) | st.just({}) | st.booleans() | json_values, _node, max_leaves=12)
"""Any keywords with any values: mostly refused early, by the checks of the first keyword."""

small = st.integers(0, 3)
big = st.integers(0, 1500) | st.sampled_from([10**6])


def _array(item: Any, low: int, span: int | None) -> dict[str, Any]:
    return {"type": "array", "items": item, "minItems": low, **({} if span is None else {"maxItems": low + span})}


def _object(props: dict[str, Any], flags: list[bool]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": [k for k, f in zip(props, flags, strict=False) if f]}


flags = st.lists(st.booleans(), min_size=4, max_size=4)
plausible_leaves = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object"])}),
    st.builds(lambda low, span: {"type": "string", "minLength": low, "maxLength": low + span}, small | big, small),
    st.builds(lambda low: {"type": "string", "minLength": low}, big),
    st.builds(lambda values: {"enum": values}, st.lists(json_values, min_size=1, max_size=3)),
    st.builds(lambda value: {"const": value}, json_values | st.fixed_dictionaries({"$ref": refs})),
    st.builds(lambda ref: {"$ref": ref}, refs),
    hostile,
)
plausible = st.recursive(plausible_leaves, lambda inner: st.one_of(
    st.builds(_object, st.dictionaries(names, inner, max_size=4), flags),
    st.builds(_array, inner, small | big, st.none() | small),
    st.builds(lambda alts: {"anyOf": alts}, st.lists(inner, min_size=1, max_size=3)),
    st.builds(lambda items: {"type": "array", "prefixItems": items}, st.lists(inner, min_size=1, max_size=2)),
    st.builds(lambda value: {"type": "object", "additionalProperties": value}, inner),
), max_leaves=16)
"""Schemas of the keywords ringserve enforces, mostly well formed, with hostile parts: $refs to
anything, bounds that multiply, consts holding "$ref", long names, any node at all."""

top_schemas = st.builds(
    lambda props, required, defs: {**_object(props, required), "$defs": defs},
    st.dictionaries(names, plausible, min_size=1, max_size=4), flags,
    st.dictionaries(st.sampled_from(["a", "b"]), plausible, max_size=2),
)

WITNESS = {"model": "m", "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": "witness"}]}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(form=st.sampled_from(FORMS), schema=top_schemas)
def test_any_schema_on_any_form_is_answered_and_never_fails_another_request(server, client, form, schema):
    """Never a 500 (a grammar the engine cannot take, a converter crash); a request streaming
    beside it always completes, and no decode step fails; this process's peak RSS (the server's
    included) grows by less than 256 MB over the module (one bomb took 3.2 GB)."""
    with ThreadPoolExecutor(2) as pool:
        witness = pool.submit(client.post, "/v1/messages", json=WITNESS)
        answer = client.post(form.path, json=form.body(schema))
        witnessed = witness.result()
    assert_answer(form.surface, answer.status_code, answer.content)
    assert witnessed.status_code == 200 and b"event: message_stop" in witnessed.content, witnessed.content[-300:]
    assert default_runner(server.state.hub).statistics().failed_steps == 0
    if sys.platform.startswith("linux"):
        assert peak_rss_bytes(os.getpid()) < server.peak_at_start + (256 << 20)

