"""core/grammar.py: which schema keywords are refused, which are enforced, the cache, the grammars."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.core import grammar
from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import (
    ChatMessage,
    GenerationRequest,
    OutputFormat,
    OutputKind,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from ringserve.core.toolcalls import CALL_CLOSE, CALL_OPEN

from bench.tool_calls import random_schema  # the benchmark's schema generator

WHERE = "tools[0].input_schema"


def refused(schema: object) -> str:
    with pytest.raises(RingserveError) as info:
        grammar.check_schema(json.dumps(schema), WHERE)
    assert info.value.kind is ErrorKind.INVALID_REQUEST
    assert info.value.param == WHERE
    return info.value.message


def obj(**props: object) -> dict[str, object]:
    return {"type": "object", "properties": props}


@pytest.mark.parametrize("keyword", sorted(grammar.REFUSED))
def test_every_refused_keyword_is_named(keyword: str) -> None:
    value: object = [{"type": "string"}] if keyword in ("oneOf", "allOf") else 1
    assert refused(obj(a={"type": "string", keyword: value})) == (
        f"{WHERE}.properties.a: keyword '{keyword}' is not supported"
    )
    assert refused({"type": "object", keyword: value}) == f"{WHERE}: keyword '{keyword}' is not supported"


def test_the_issue_example_message() -> None:
    assert refused({"type": "object", "patternProperties": {"^x": {}}}) == (
        "tools[0].input_schema: keyword 'patternProperties' is not supported"
    )


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string"}, 'the schema must be an object schema ("type": "object")'),
        ([1], "a schema must be a JSON object (boolean schemas are not supported)"),
        ({"anyOf": [{"type": "object"}]}, 'the schema must be an object schema ("type": "object")'),
        (obj(a=True), "a schema must be a JSON object (boolean schemas are not supported)"),
        (obj(a={"type": "string", "format": "email"}), "format 'email' is not supported"),
        (obj(a={"type": "string", "unknownThing": 1}), "keyword 'unknownThing' is not supported here"),
        (obj(a={"type": "date"}), "unknown type 'date'"),
        (obj(a={"type": {}}), "unknown type '{}'"),
        (obj(a={"type": [{}]}), "'type' must name JSON types, got [{}]"),
        (obj(a={"anyOf": [{"type": ["string", []]}]}), "'type' must name JSON types, got ['string', []]"),
        (obj(a={"minLength": 1}), "keyword 'minLength' is not supported without a matching 'type'"),
        (obj(a={"type": "integer", "properties": {}}), "keyword 'properties' is not supported here"),
        (obj(a={"type": ["string", "null"], "maxLength": 3}), "keyword 'maxLength' is not supported here"),
        (obj(a={"enum": [1, "x"], "type": "string"}), "a value of 'enum'/'const' is not of type 'string'"),
        (obj(a={"enum": []}), "'enum' must be a non-empty list"),
        (obj(a={"type": "string", "format": "date", "maxLength": 3}), "keyword 'maxLength' is not supported here"),
        (obj(a={"type": "array", "items": {}, "prefixItems": [{}]}), "keyword 'prefixItems' is not supported together with 'items'"),
        (obj(a={"type": "array", "prefixItems": [{}], "minItems": 2}), "keyword 'minItems' is not supported here"),
        (obj(a={"type": "array", "minItems": 2}), "keyword 'minItems' is not supported here"),
        (obj(a={"type": "array", "items": {}, "maxItems": 1, "minItems": 2}), "'maxItems' is below 'minItems'"),
        (
            obj(a={"type": "string", "minLength": 5, "maxLength": 1006}),
            "'maxLength' more than 1000 above 'minLength' is not supported (llama.cpp's grammar limit)",
        ),
        (
            obj(a={"type": "array", "items": {}, "maxItems": 30000}),
            "'maxItems' more than 1000 above 'minItems' is not supported (llama.cpp's grammar limit)",
        ),
        (obj(a={"$ref": "#/$defs/missing"}), "'$ref' '#/$defs/missing' does not resolve"),
        (obj(a={"$ref": "https://example.com/s.json"}), "'$ref' 'https://example.com/s.json' is not supported (only '#/...' paths into the same schema)"),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/x", "maxLength": 1}}, "$defs": {"x": {"type": "string"}}},
            "keyword 'maxLength' is not supported here",
        ),
        ({"type": "object", "required": ["b"], "properties": {}}, "'required' names 'b', which is not in 'properties'"),
        ({"type": "object", "required": ["b"]}, "'required' names 'b', which is not in 'properties' (there are none)"),
        ({"required": ["b"]}, "'required' names 'b', which is not in 'properties' (there are none)"),
        (
            {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
            "keyword 'additionalProperties' is supported next to 'properties' only as false",
        ),
        (
            {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
            "keyword 'additionalProperties' is supported next to 'properties' only as false",
        ),
    ],
)
def test_refused(schema: object, message: str) -> None:
    assert refused(schema).endswith(message)


def test_a_schema_nested_too_deeply_is_a_400_not_a_recursion_error() -> None:
    # 300 levels: what a request body parses to (json.loads allows it), deeper than the checker's recursion.
    text = '{"type": "object", "properties": {"a": ' * 300 + '{"type": "string"}' + "}}" * 300
    with pytest.raises(RingserveError, match=r"^tools\[0\]\.input_schema: the schema is nested too deeply$"):
        grammar.check_schema(text, WHERE)


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
        grammar.calls_grammar([ToolSpec("f", "", text)], False)
    with pytest.raises(RingserveError, match=r"^output\.schema: the schema has no finite value"):
        grammar.output_grammar(text, "output.schema")


def test_a_recursive_schema_with_optional_recursion_converts() -> None:
    node = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}
    tree = {"type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"], "$defs": {"node": node}}
    c = grammar.calls_grammar([ToolSpec("f", "", json.dumps(tree))], False)
    assert '"v": 1' in c.example


def test_not_json() -> None:
    with pytest.raises(RingserveError, match=r"^tools\[0\]\.input_schema: the schema is not valid JSON"):
        grammar.check_schema("{", WHERE)


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
    grammar.check_schema(text, WHERE)
    constraint = grammar.output_grammar(text, "output.schema")
    assert "root ::= " in constraint.grammar
    jsonschema.validate(json.loads(constraint.example), schema)


def test_string_characters_exclude_control_characters() -> None:
    g = grammar.output_grammar(json.dumps(obj(a={"type": "string"})), "o").grammar
    (char,) = [line for line in g.splitlines() if line.startswith("char ::= ")]
    assert r"\x00-\x1F" in char


def test_literals_escape_backslashes_and_quotes() -> None:
    name = 'a\\b"c'
    g = grammar.output_grammar(json.dumps(obj(**{name: {"const": "x\\y"}})), "o").grammar
    # The grammar literal for the key is the JSON text "a\\b\"c" with GBNF escapes on top.
    assert r'"\"a\\\\b\\\"c\""' in g
    assert r'"\"x\\\\y\""' in g


def test_refs_of_two_tools_with_the_same_def_name_get_their_own_rules() -> None:
    a = {"type": "object", "properties": {"p": {"$ref": "#/$defs/D"}}, "$defs": {"D": {"type": "integer"}}}
    b = {"type": "object", "properties": {"p": {"$ref": "#/$defs/D"}}, "$defs": {"D": {"type": "boolean"}}}
    c = grammar.calls_grammar([ToolSpec("a", "", json.dumps(a)), ToolSpec("b", "", json.dumps(b))], True)
    rules = dict(line.split(" ::= ", 1) for line in c.grammar.splitlines())
    assert rules["s0-p"] != rules["s1-p"]
    assert {rules[rules["s0-p"]], rules[rules["s1-p"]]} == {"integer", "boolean"}


def test_a_property_named_like_a_def_does_not_capture_the_ref() -> None:
    schema = {
        "type": "object",
        "properties": {"D": {"type": "string"}, "x": {"$ref": "#/$defs/D"}},
        "$defs": {"D": {"type": "integer"}},
    }
    rules = dict(line.split(" ::= ", 1) for line in grammar.output_grammar(json.dumps(schema), "o").grammar.splitlines())
    assert rules[rules["s0-x"]] == "integer"


def test_calls_grammar_one_call_or_up_to_max_calls() -> None:
    tool = ToolSpec("get_weather", "", json.dumps(obj(city={"type": "string"})))
    one = grammar.calls_grammar([tool], False)
    many = grammar.calls_grammar([tool], True)
    assert "root ::= call\n" in one.grammar + "\n"
    assert f'root ::= call ("\\n" call){{0,{grammar.MAX_CALLS - 1}}}' in many.grammar
    assert one.example.startswith(CALL_OPEN) and one.example.endswith(CALL_CLOSE)
    body = json.loads(one.example[len(CALL_OPEN) : -len(CALL_CLOSE)])
    assert body == {"name": "get_weather", "arguments": {"city": "example"}}


def test_grammars_are_cached_by_schema_text() -> None:
    grammar.output_grammar.cache_clear()
    text = json.dumps(obj(cached={"type": "integer"}))
    first = grammar.output_grammar(text, "o")
    assert grammar.output_grammar(text, "o") is first
    assert grammar.output_grammar.cache_info().hits == 1
    tools = [ToolSpec("t", "", text)]
    assert grammar.calls_grammar(tools, True) is grammar.calls_grammar(tools, True)


def request(**kw: object) -> GenerationRequest:
    return GenerationRequest((ChatMessage("user", "hi"),), 10, **kw)  # type: ignore[arg-type]


TOOLS = (
    ToolSpec("a", "", json.dumps(obj(x={"type": "integer"}))),
    ToolSpec("b", "", json.dumps({"type": "object", "patternProperties": {}}), strict=False),
)


def test_constraint_for() -> None:
    assert grammar.constraint_for(request()) is None
    assert grammar.constraint_for(request(tools=TOOLS)) is None  # auto, not strict: free
    assert grammar.constraint_for(request(tools=TOOLS, tool_choice=ToolChoice(ToolChoiceMode.NONE))) is None
    named = grammar.constraint_for(request(tools=TOOLS, tool_choice=ToolChoice(ToolChoiceMode.NAMED, "a")))
    assert named == grammar.calls_grammar([TOOLS[0]], False)
    with pytest.raises(RingserveError, match=r"tools\[1\]\.parameters: keyword 'patternProperties'"):
        grammar.constraint_for(request(tools=TOOLS, tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    with pytest.raises(RingserveError, match="tool_choice names 'zz'") as info:
        grammar.constraint_for(request(tools=TOOLS, tool_choice=ToolChoice(ToolChoiceMode.NAMED, "zz")))
    assert info.value.param == "tool_choice"
    strict = (TOOLS[0], ToolSpec("b", "", TOOLS[1].parameters, strict=True))
    with pytest.raises(RingserveError, match=r"tools\[1\]\.parameters"):
        grammar.constraint_for(request(tools=strict))
    any_object = grammar.constraint_for(request(output=OutputFormat(OutputKind.JSON_OBJECT)))
    assert any_object is not None and json.loads(any_object.example) == {}
    with pytest.raises(RingserveError, match=r"^output\.schema: "):
        grammar.constraint_for(request(output=OutputFormat(OutputKind.JSON_SCHEMA, '{"type": "array"}')))


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_random_schemas_convert_and_examples_validate(rng: object) -> None:
    schema = random_schema(rng)  # type: ignore[arg-type]
    constraint = grammar.calls_grammar([ToolSpec("t", "", json.dumps(schema))], False)
    body = json.loads(constraint.example[len(CALL_OPEN) : -len(CALL_CLOSE)])
    jsonschema.validate(body["arguments"], schema)


STRICT = (ToolSpec("a", "", json.dumps(obj(x={"type": "integer"})), strict=True), TOOLS[1])


def test_strict_auto_gets_lazy_calls_and_others_stay_free() -> None:
    assert grammar.constraint_for(request(tools=STRICT)) == grammar.LazyCalls(STRICT)
    json_out = request(tools=STRICT, output=OutputFormat(OutputKind.JSON_OBJECT))
    assert isinstance(grammar.constraint_for(json_out), grammar.Constraint)  # the output grammar: no calls


@pytest.mark.parametrize(
    ("tail", "head"),
    [("", '{"name": '), ("\n", '{"name": '), (" \n\t", '{"name": '), ("{", '"name": '), ('\n{"na', 'me": ')],
)
def test_lazy_calls_continue_what_the_marker_token_held(tail: str, head: str) -> None:
    constraint = grammar.LazyCalls(STRICT).after(tail)
    assert constraint is not None
    assert constraint.example == head + '"a", "arguments": {"x": 1}}' + CALL_CLOSE
    body = (tail + constraint.example)[: -len(CALL_CLOSE)]
    assert json.loads(body) == {"name": "a", "arguments": {"x": 1}}
    root = next(line for line in constraint.grammar.splitlines() if line.startswith("root ::= "))
    assert root.startswith("root ::= [ \\t\\n]{0,2} ") == (tail.strip() == "")
    # The non-strict tool's arguments are any object: its refused keyword is not converted.
    assert "patternProperties" not in constraint.grammar and '"\\"b\\", \\"arguments\\": " s1' in root


@pytest.mark.parametrize("tail", ['{ "name"', "x", '{"name": "a"'])
def test_lazy_calls_refuse_a_tail_the_grammar_cannot_continue(tail: str) -> None:
    assert grammar.LazyCalls(STRICT).after(tail) is None


def test_call_watch_switches_on_after_the_marker_and_off_after_the_call() -> None:
    watch = grammar.CallWatch(grammar.LazyCalls(STRICT))
    on = grammar.GrammarOn(grammar.LazyCalls(STRICT).after("\n"))  # type: ignore[arg-type]
    fed = [
        (b"I'll call <tool", None),
        (b"_call", None),
        (b">\n", on),
        (b'{"name": "a", "arguments": {"x": "</tool_call>', None),  # inside a string: not an end
        (b'"}}\n</tool_call', None),
        (b">", grammar.GrammarOff()),
        (b" then \xc3", None),
        (b"\xa9<tool_call>\n", on),  # a character split across pieces, the marker in one piece
    ]
    assert [watch.feed(piece) for piece, _ in fed] == [switch for _, switch in fed]


def test_call_watch_ends_on_a_call_it_cannot_constrain() -> None:
    watch = grammar.CallWatch(grammar.LazyCalls(STRICT))
    assert watch.feed(b'<tool_call>{ "name"') is None
    assert watch.feed(b': "a", "arguments": {}}\n</tool_call>') is None
    assert watch.feed(b"<tool_call>\n") is None  # the watch has ended


def test_constraint_for_refuses_bounds_over_the_grammar_limit_in_all() -> None:
    """The surface-neutral check (surfaces check first, in their own spelling): the total over
    every enforced schema counts, each bound as its maximum (or its minimum without one)."""
    def strings(n: int, bound: dict[str, int]) -> str:
        return json.dumps(obj(**{f"p{i}": {"type": "string", **bound} for i in range(n)}))

    half = grammar.MAX_REPEATS // 2
    two = (ToolSpec("a", "", strings(1, {"maxLength": 1000})), ToolSpec("b", "", strings(1, {"minLength": half})))
    assert grammar.constraint_for(request(tools=two, tool_choice=ToolChoice(ToolChoiceMode.REQUIRED))) is not None
    over = (*two, ToolSpec("c", "", strings(1, {"minLength": half - 999})))
    with pytest.raises(RingserveError, match=rf"^the schemas' .* add up to {grammar.MAX_REPEATS + 1} repetitions") as info:
        grammar.constraint_for(request(tools=over, tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    assert info.value.param == "tools"
    # under auto only strict tools are decoded under a grammar: these (not strict) are fine there
    assert grammar.constraint_for(request(tools=over)) is None
