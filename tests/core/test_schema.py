"""core/schema.py: which schema keywords are refused, what a schema may cost, and the messages that name them."""

from __future__ import annotations

import json

import pytest

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.schema import (
    MAX_DEPTH,
    MAX_GRAMMAR_BYTES,
    MAX_NODES,
    MAX_OPTIONAL_PROPERTIES,
    MAX_REPEAT_PRODUCT,
    REFUSED,
    check_repeats,
    check_schema,
)

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


# -- what a schema may cost (issue 36 item 1) ------------------------------------------------

#: The issue's schema: about 300 bytes, 2,200 repetitions in the grammar, 200 million characters in any value.
BOMB = {
    "type": "object",
    "properties": {"a": {"type": "array", "minItems": 1000, "items": {
        "type": "array", "minItems": 1000, "items": {"type": "string", "minLength": 200}}}},
    "required": ["a"],
}


def test_bounds_that_multiply_past_the_limit_are_refused_where_they_multiply() -> None:
    assert len(json.dumps(BOMB)) < 300
    assert refused(BOMB) == (
        f"{WHERE}.properties.a.items: 'minItems' 1000 times the 200 repetitions each item holds at the least"
        f" is 200000, over the limit of {MAX_REPEAT_PRODUCT} for any value (bounds multiply along the nesting)"
    )
    # what multiplies to the limit is fine, optional or not
    at = {"type": "array", "minItems": 100, "items": {"type": "string", "minLength": MAX_REPEAT_PRODUCT // 100}}
    check_schema(json.dumps(obj(a=at)), WHERE)
    check_schema(json.dumps({**obj(a=at), "required": ["a"]}), WHERE)


def test_a_ref_used_by_many_required_properties_multiplies_too() -> None:
    """Ten required properties of a definition of ten required properties of ... : 10**5 values."""
    defs = {f"d{k}": {"type": "object", "properties": {f"p{i}": {"$ref": f"#/$defs/d{k + 1}"} for i in range(10)},
                      "required": [f"p{i}" for i in range(10)]} for k in range(5)}
    defs["d5"] = {"type": "integer"}
    schema = {"type": "object", "$defs": defs, "properties": {"x": {"$ref": "#/$defs/d0"}}}
    assert refused(schema) == (
        f"{WHERE}.$defs.d0: the 10 values 'required' asks for hold 100000 repetitions at the least, over the"
        f" limit of {MAX_REPEAT_PRODUCT} for any value (bounds multiply along the nesting)"
    )


def nested(levels: int) -> dict[str, object]:
    return json.loads('{"type": "object", "properties": {"a": ' * (levels - 1) + '{"type": "string"}' + "}}" * (levels - 1))


def test_nesting_is_bounded() -> None:
    check_schema(json.dumps(nested(MAX_DEPTH)), WHERE)
    assert refused(nested(MAX_DEPTH + 1)) == f"{WHERE}: the schema is nested too deeply"


def test_optional_properties_of_one_object_are_bounded() -> None:
    props = {f"p{i}": {"type": "integer"} for i in range(MAX_OPTIONAL_PROPERTIES + 1)}
    check_schema(json.dumps({**obj(**props), "required": ["p0"]}), WHERE)
    assert refused(obj(a=obj(**props))) == (
        f"{WHERE}.properties.a: {MAX_OPTIONAL_PROPERTIES + 1} optional properties (in 'properties', not in"
        f" 'required'), over the limit of {MAX_OPTIONAL_PROPERTIES} for one object"
    )


def refused_request(schemas: list[dict[str, object]]) -> str:
    texts = [json.dumps(s) for s in schemas]
    for text in texts:
        check_schema(text, WHERE)
    with pytest.raises(RingserveError) as info:
        check_repeats(texts, "tools")
    assert info.value.param == "tools"
    return info.value.message


def test_the_schema_nodes_of_a_request_are_bounded() -> None:
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(999)},
            "required": [f"p{i}" for i in range(999)]}  # 1,000 nodes
    check_repeats([json.dumps(wide)] * 2, "tools")
    assert refused_request([wide, wide, obj()]) == (
        f"the schemas hold 2001 schemas in all (each {{...}} in them is one), over the limit of {MAX_NODES}"
        " for one request's grammar"
    )
    assert refused({**wide, "properties": {**wide["properties"], "q": obj(**{f"r{i}": {} for i in range(MAX_NODES)})}}) == (
        f"{WHERE}: the schema holds more than {MAX_NODES} schemas (each {{...}} below it is one), over the limit"
        " for one request's grammar"
    )


def test_long_property_names_count_into_the_grammar_size() -> None:
    """Rule names are paths: a 100 KB name over 100 properties made a 60 MB grammar."""
    long = obj(**{"A" * 100_000: obj(**{f"c{i}": {"type": "string"} for i in range(100)})})
    message = refused_request([long])
    assert message.startswith("the schemas make a grammar of about ")
    assert message.endswith(f" bytes (each rule is named after its property names, nested), over the limit of"
                            f" {MAX_GRAMMAR_BYTES} for one request")


# -- a $ref names a schema of the document (issue 36 item 3) -----------------------------------


@pytest.mark.parametrize(
    ("ref", "what"),
    [("#/required", "a list"), ("#/properties", "an object"), ("#/properties/a/description", "a string"),
     ("#/properties/k/const", "an object"), ("#/properties/b/anyOf", "a list")],
)
def test_a_ref_to_what_is_not_a_schema_is_named(ref: str, what: str) -> None:
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string", "description": "d"}, "b": {"anyOf": [{"type": "null"}]}, "k": {"const": {"type": "string"}},
        "c": {"$ref": ref}}}
    assert refused(schema) == f"{WHERE}.properties.c: '$ref' {ref!r} names {what} that is not a schema (a keyword's value)"


def test_refs_name_every_kind_of_schema_position() -> None:
    schema = {"type": "object", "$defs": {"d": {"type": "integer"}}, "properties": {
        "a": {"type": "array", "items": {"type": "string"}}, "m": {"type": "object", "additionalProperties": {"type": "null"}},
        "r1": {"$ref": "#/$defs/d"}, "r2": {"$ref": "#/properties/a/items"}, "r3": {"$ref": "#/properties/m/additionalProperties"},
        "r4": {"$ref": "#/properties/a"}}}
    check_schema(json.dumps(schema), WHERE)


def test_a_ref_that_leads_back_to_itself_before_any_character_is_refused() -> None:
    """``ref0 ::= ref0-0 | integer``: llama.cpp's grammar parser refuses left recursion, so the
    engine could not start such a request (a 500); a recursion behind a character is fine."""
    schema = {"type": "object", "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "integer"}]}},
              "properties": {"x": {"$ref": "#/$defs/a"}}}
    assert refused(schema) == (f"{WHERE}.$defs.a.anyOf[0]: '$ref' '#/$defs/a' leads back to itself through '$ref'"
                               " and 'anyOf' alone (left recursion, which llama.cpp's grammar parser refuses)")
    behind = {"type": "object", "$defs": {"a": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/a"}},
                                                          {"type": "integer"}]}}, "properties": {"x": {"$ref": "#/$defs/a"}}}
    check_schema(json.dumps(behind), WHERE)
