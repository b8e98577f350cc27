"""core/schema.py: which schema keywords are refused, and the messages that name them."""

from __future__ import annotations

import json

import pytest

from ringserve.core.schema import REFUSED, check_schema
from ringserve.core.errors import ErrorKind, RingserveError

WHERE = "tools[0].input_schema"


def refused(value: object) -> str:
    with pytest.raises(RingserveError) as info:
        check_schema(json.dumps(value), WHERE)
    assert info.value.kind is ErrorKind.INVALID_REQUEST
    assert info.value.param == WHERE
    return info.value.message


def obj(**props: object) -> dict[str, object]:
    return {"type": "object", "properties": props}


@pytest.mark.parametrize("keyword", sorted(REFUSED))
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
        check_schema(text, WHERE)


def test_not_json() -> None:
    with pytest.raises(RingserveError, match=r"^tools\[0\]\.input_schema: the schema is not valid JSON"):
        check_schema("{", WHERE)
