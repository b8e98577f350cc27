"""engine/gbnf.py: the grammars of enforced schemas, their examples, the cache, the call watch."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.tool_calls import random_schema  # the benchmark's schema generator
from ringserve.core.errors import RingserveError
from ringserve.core.events import (
    ChatMessage,
    GenerationRequest,
    OutputFormat,
    OutputKind,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from ringserve.core.schema import MAX_REPEATS, check_schema, grammar_bytes
from ringserve.core.toolcalls import CALL_CLOSE, CALL_OPEN, format_call
from ringserve.engine import gbnf
from ringserve.engine.examples import example
from tests.support.gbnf import accepts

WHERE = "tools[0].input_schema"


def obj(**props: object) -> dict[str, object]:
    return {"type": "object", "properties": props}


@pytest.mark.parametrize(
    "schema",
    [
        {
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/n"}},
            "required": ["a"],
            "$defs": {"n": {"type": "object", "properties": {"b": {"$ref": "#/$defs/n"}}, "required": ["b"]}},
        },
        {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}},
    ],
)
def test_a_schema_with_no_finite_value_is_a_400(schema: dict[str, object]) -> None:
    text = json.dumps(schema)
    with pytest.raises(RingserveError, match=r"^tools\[0\]\.parameters: the schema has no finite value"):
        gbnf.calls_grammar([ToolSpec("f", "", text)], False)
    with pytest.raises(RingserveError, match=r"^output\.schema: the schema has no finite value"):
        gbnf.output_grammar(text, "output.schema")


def test_a_recursive_schema_with_optional_recursion_converts() -> None:
    node = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}
    tree = {"type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"], "$defs": {"node": node}}
    c = gbnf.calls_grammar([ToolSpec("f", "", json.dumps(tree))], False)
    assert '"v": 1' in example(c)


ENFORCED = [
    obj(),
    {"type": "object"},
    {"properties": {"a": {"type": "string"}}},
    {"type": "object", "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {"type": "object", "additionalProperties": True},
    obj(a={"type": "string", "minLength": 1, "maxLength": 5}),
    obj(a={"type": "string", "format": "date-time"}),
    obj(a={"type": "string", "format": "uuid"}, b={"type": "string", "format": "date"}, c={"format": "time"}),
    obj(a={"enum": ["x", 1, None]}, b={"const": {"k": [1]}}, c={"type": "string", "enum": ["a"]}),
    obj(a={"anyOf": [{"type": "integer"}, {"type": "null"}]}, b={"type": ["number", "boolean"]}),
    obj(a={"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3}),
    obj(a={"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}),
    {
        "type": "object",
        "title": "T",
        "description": "annotations are dropped",
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "properties": {"node": {"$ref": "#/$defs/Node", "description": "annotated ref"}},
        "$defs": {"Node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}},
        "required": ["node"],
    },
    {"type": "object", "definitions": {"X": {"type": "integer"}}, "properties": {"x": {"$ref": "#/definitions/X"}}},
]


@pytest.mark.parametrize("schema", ENFORCED)
def test_enforced_schemas_convert_and_their_example_validates(schema: dict[str, object]) -> None:
    text = json.dumps(schema)
    check_schema(text, WHERE)
    constraint = gbnf.output_grammar(text, "output.schema")
    assert "root ::= " in constraint.grammar
    jsonschema.validate(json.loads(example(constraint)), schema)


def test_string_characters_exclude_control_characters() -> None:
    g = gbnf.output_grammar(json.dumps(obj(a={"type": "string"})), "o").grammar
    (char,) = [line for line in g.splitlines() if line.startswith("char ::= ")]
    assert r"\x00-\x1F" in char


def test_literals_escape_backslashes_and_quotes() -> None:
    name = 'a\\b"c'
    g = gbnf.output_grammar(json.dumps(obj(**{name: {"const": "x\\y"}})), "o").grammar
    # The grammar literal for the key is the JSON text "a\\b\"c" with GBNF escapes on top.
    assert r'"\"a\\\\b\\\"c\""' in g
    assert r'"\"x\\\\y\""' in g


def test_refs_of_two_tools_with_the_same_def_name_get_their_own_rules() -> None:
    a = {"type": "object", "properties": {"p": {"$ref": "#/$defs/D"}}, "$defs": {"D": {"type": "integer"}}}
    b = {"type": "object", "properties": {"p": {"$ref": "#/$defs/D"}}, "$defs": {"D": {"type": "boolean"}}}
    c = gbnf.calls_grammar([ToolSpec("a", "", json.dumps(a)), ToolSpec("b", "", json.dumps(b))], True)
    rules = dict(line.split(" ::= ", 1) for line in c.grammar.splitlines())
    assert rules["s0-p"] != rules["s1-p"]
    assert {rules[rules["s0-p"]], rules[rules["s1-p"]]} == {"integer", "boolean"}


def test_a_property_named_like_a_def_does_not_capture_the_ref() -> None:
    schema = {
        "type": "object",
        "properties": {"D": {"type": "string"}, "x": {"$ref": "#/$defs/D"}},
        "$defs": {"D": {"type": "integer"}},
    }
    rules = dict(line.split(" ::= ", 1) for line in gbnf.output_grammar(json.dumps(schema), "o").grammar.splitlines())
    assert rules[rules["s0-x"]] == "integer"


def test_calls_grammar_one_call_or_up_to_max_calls() -> None:
    tool = ToolSpec("get_weather", "", json.dumps(obj(city={"type": "string"})))
    one = gbnf.calls_grammar([tool], False)
    many = gbnf.calls_grammar([tool], True)
    call = format_call("get_weather", '{"city": "x"}')
    assert accepts(one.grammar, call) and not accepts(one.grammar, call + "\n" + call)
    assert accepts(many.grammar, "\n".join([call] * gbnf.MAX_CALLS))
    assert not accepts(many.grammar, "\n".join([call] * (gbnf.MAX_CALLS + 1)))
    assert example(one).startswith(CALL_OPEN) and example(one).endswith(CALL_CLOSE)
    body = json.loads(example(one)[len(CALL_OPEN) : -len(CALL_CLOSE)])
    assert body == {"name": "get_weather", "arguments": {"city": "example"}}


def test_grammars_are_cached_by_schema_text() -> None:
    gbnf.GRAMMAR_CACHE.clear()
    text = json.dumps(obj(cached={"type": "integer"}))
    first = gbnf.output_grammar(text, "o")
    assert gbnf.output_grammar(text, "o") is first
    assert gbnf.GRAMMAR_CACHE.statistics().hits == 1
    tools = [ToolSpec("t", "", text)]
    assert gbnf.calls_grammar(tools, True) is gbnf.calls_grammar(tools, True)


def test_the_grammar_cache_holds_at_most_its_bytes() -> None:
    """Distinct schemas near the size limit (about 330 KB of grammar each) fill it past its
    budget: the oldest go, and what it holds stays within CACHE_BYTES."""
    gbnf.GRAMMAR_CACHE.clear()
    n = 2 * gbnf.CACHE_BYTES // 300_000
    for i in range(n):
        schema = obj(**{f"p{i}": {"type": "array", "items": {"type": "integer"}, "minItems": MAX_REPEATS}})
        assert len(gbnf.output_grammar(json.dumps(schema), "o").grammar) > 300_000
    held = gbnf.GRAMMAR_CACHE.statistics()
    assert 0 < held.entries < n and held.held <= gbnf.CACHE_BYTES == held.max_bytes


def request(**kw: object) -> GenerationRequest:
    return GenerationRequest((ChatMessage("user", "hi"),), 10, **kw)  # type: ignore[arg-type]


TOOLS = (
    ToolSpec("a", "", json.dumps(obj(x={"type": "integer"}))),
    ToolSpec("b", "", json.dumps({"type": "object", "patternProperties": {}}), strict=False),
)


def test_constraint_for() -> None:
    assert gbnf.constraint_for(request()) is None
    assert gbnf.constraint_for(request(tools=TOOLS)) is None  # auto, not strict: free
    assert gbnf.constraint_for(request(tools=TOOLS, tool_choice=ToolChoice(ToolChoiceMode.NONE))) is None
    named = gbnf.constraint_for(request(tools=TOOLS, tool_choice=ToolChoice(ToolChoiceMode.NAMED, "a")))
    assert named == gbnf.calls_grammar([TOOLS[0]], False)
    with pytest.raises(RingserveError, match=r"tools\[1\]\.parameters: keyword 'patternProperties'"):
        gbnf.constraint_for(request(tools=TOOLS, tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    with pytest.raises(RingserveError, match="tool_choice names 'zz'") as info:
        gbnf.constraint_for(request(tools=TOOLS, tool_choice=ToolChoice(ToolChoiceMode.NAMED, "zz")))
    assert info.value.param == "tool_choice"
    strict = (TOOLS[0], ToolSpec("b", "", TOOLS[1].parameters, strict=True))
    with pytest.raises(RingserveError, match=r"tools\[1\]\.parameters"):
        gbnf.constraint_for(request(tools=strict))
    any_object = gbnf.constraint_for(request(output=OutputFormat(OutputKind.JSON_OBJECT)))
    assert any_object is not None and json.loads(example(any_object)) == {}
    with pytest.raises(RingserveError, match=r"^output\.schema: "):
        gbnf.constraint_for(request(output=OutputFormat(OutputKind.JSON_SCHEMA, '{"type": "array"}')))


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_random_schemas_convert_and_examples_validate(rng: object) -> None:
    schema = random_schema(rng)  # type: ignore[arg-type]
    constraint = gbnf.calls_grammar([ToolSpec("t", "", json.dumps(schema))], False)
    body = json.loads(example(constraint)[len(CALL_OPEN) : -len(CALL_CLOSE)])
    jsonschema.validate(body["arguments"], schema)


STRICT = (ToolSpec("a", "", json.dumps(obj(x={"type": "integer"})), strict=True), TOOLS[1])


def test_strict_auto_gets_lazy_calls_and_others_stay_free() -> None:
    assert gbnf.constraint_for(request(tools=STRICT)) == gbnf.LazyCalls(STRICT)
    json_out = request(tools=STRICT, output=OutputFormat(OutputKind.JSON_OBJECT))
    assert isinstance(gbnf.constraint_for(json_out), gbnf.Constraint)  # the output grammar: no calls


@pytest.mark.parametrize(
    ("tail", "head"),
    [("", '{"name": '), ("\n", '{"name": '), (" \n\t", '{"name": '), ("{", '"name": '), ('\n{"na', 'me": ')],
)
def test_lazy_calls_continue_what_the_marker_token_held(tail: str, head: str) -> None:
    constraint = gbnf.LazyCalls(STRICT).after(tail)
    assert constraint is not None
    assert example(constraint) == head + '"a", "arguments": {"x": 1}}' + CALL_CLOSE
    body = (tail + example(constraint))[: -len(CALL_CLOSE)]
    assert json.loads(body) == {"name": "a", "arguments": {"x": 1}}
    root = next(line for line in constraint.grammar.splitlines() if line.startswith("root ::= "))
    assert root.startswith("root ::= [ \\t\\n]{0,2} ") == (tail.strip() == "")
    # The non-strict tool's arguments are any object: its refused keyword is not converted.
    assert "patternProperties" not in constraint.grammar and '"\\"b\\", \\"arguments\\": " s1' in root


@pytest.mark.parametrize("tail", ['{ "name"', "x", '{"name": "a"'])
def test_lazy_calls_refuse_a_tail_the_grammar_cannot_continue(tail: str) -> None:
    assert gbnf.LazyCalls(STRICT).after(tail) is None


def test_call_watch_switches_on_after_the_marker_and_off_after_the_call() -> None:
    watch = gbnf.CallWatch(gbnf.LazyCalls(STRICT))
    on = gbnf.GrammarOn(gbnf.LazyCalls(STRICT).after("\n"))  # type: ignore[arg-type]
    fed = [
        (b"I'll call <tool", None),
        (b"_call", None),
        (b">\n", on),
        (b'{"name": "a", "arguments": {"x": "</tool_call>', None),  # inside a string: not an end
        (b'"}}\n</tool_call', None),
        (b">", gbnf.GrammarOff()),
        (b" then \xc3", None),
        (b"\xa9<tool_call>\n", on),  # a character split across pieces, the marker in one piece
    ]
    assert [watch.feed(piece) for piece, _ in fed] == [switch for _, switch in fed]


def test_call_watch_ends_on_a_call_it_cannot_constrain() -> None:
    watch = gbnf.CallWatch(gbnf.LazyCalls(STRICT))
    assert watch.feed(b'<tool_call>{ "name"') is None
    assert watch.feed(b': "a", "arguments": {}}\n</tool_call>') is None
    assert watch.feed(b"<tool_call>\n") is None  # the watch has ended


def test_constraint_for_refuses_bounds_over_the_grammar_limit_in_all() -> None:
    """The surface-neutral check (surfaces check first, in their own spelling): the total over
    every enforced schema counts, each bound as its maximum (or its minimum without one)."""
    def strings(n: int, bound: dict[str, int]) -> str:
        return json.dumps(obj(**{f"p{i}": {"type": "string", **bound} for i in range(n)}))

    half = MAX_REPEATS // 2
    two = (ToolSpec("a", "", strings(1, {"maxLength": 1000})), ToolSpec("b", "", strings(1, {"minLength": half})))
    assert gbnf.constraint_for(request(tools=two, tool_choice=ToolChoice(ToolChoiceMode.REQUIRED))) is not None
    over = (*two, ToolSpec("c", "", strings(1, {"minLength": half - 999})))
    with pytest.raises(RingserveError, match=rf"^the schemas' .* add up to {MAX_REPEATS + 1} repetitions") as info:
        gbnf.constraint_for(request(tools=over, tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    assert info.value.param == "tools"
    # under auto only strict tools are decoded under a grammar: these (not strict) are fine there
    assert gbnf.constraint_for(request(tools=over)) is None


# -- what core/schema.py estimates a grammar's size to be, against the size made -------------

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
leaves = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "number", "integer", "boolean", "null"])}),
    st.builds(lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
              st.integers(0, 50), st.integers(0, 50)),
    st.builds(lambda values: {"enum": values}, st.lists(names | st.integers(), min_size=1, max_size=5)),
    st.builds(lambda fmt: {"type": "string", "format": fmt}, st.sampled_from(["date", "time", "date-time", "uuid"])),
)


def _object(props: dict[str, object], flags: list[bool]) -> dict[str, object]:
    return {"type": "object", "properties": props, "required": [k for k, f in zip(props, flags, strict=False) if f]}


schemas = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.builds(_object, st.dictionaries(names, inner, max_size=5), st.lists(st.booleans(), min_size=5, max_size=5)),
        st.builds(lambda item, lo, span: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + span},
                  inner, st.integers(0, 3), st.integers(0, 30)),
        st.builds(lambda alts: {"anyOf": alts}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda items: {"type": "array", "prefixItems": items}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda value: {"type": "object", "additionalProperties": value}, inner),
    ),
    max_leaves=25,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.builds(lambda props: {"type": "object", "properties": props}, st.dictionaries(names, schemas, max_size=4)),
                min_size=1, max_size=3))
def test_the_grammar_size_estimate_is_never_below_the_size_made(tools: list[dict[str, object]]) -> None:
    texts = [json.dumps(t) for t in tools]
    for text in texts:
        check_schema(text, WHERE)
    specs = [ToolSpec(f"tool_{i}", "", text, strict=True) for i, text in enumerate(texts)]
    made = [gbnf.calls_grammar(specs, True), gbnf.LazyCalls(tuple(specs)).after(""), gbnf.output_grammar(texts[0], "o")]
    assert all(c is not None and len(c.grammar) <= grammar_bytes(texts) for c in made)


def test_a_ref_key_in_a_const_value_is_a_value_not_a_reference() -> None:
    """The bundled resolve_refs walked const values too: it rewrote this one (a silently different
    answer) and raised AttributeError (a 500) on a "$ref" that is not a string."""
    for value in ({"$ref": "#/properties"}, {"$ref": 5}):
        schema = obj(a={"const": value})
        assert json.dumps(json.dumps(value))[1:-1] in gbnf.output_grammar(json.dumps(schema), "o").grammar
