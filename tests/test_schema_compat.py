"""Compatibility modes for Avro, JSON Schema and Protobuf (``danube_pipeline.schemas.compatibility``).

For each format, four changes of one base schema:

* ``backward``: the new schema reads old data, old readers cannot read new data;
* ``forward``: the other way round;
* ``full``: both ways;
* ``breaking``: neither way.

Every mode is checked with a change it accepts and one it refuses, the refusal's path, rule and
conflicting version asserted. The transitive modes are checked with two earlier versions where
the new schema fits the last one but not the first. Then each format's rules one by one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.schemas.compatibility import (
    BACKWARD,
    BACKWARD_TRANSITIVE,
    COMPATIBILITY_MODES,
    FORWARD,
    FORWARD_TRANSITIVE,
    FULL,
    FULL_TRANSITIVE,
    NONE,
    Incompatibility,
    check_compatibility,
    normalize_mode,
)
from danube_pipeline.schemas.formats import ParsedSchema, parse_schema

pytestmark = pytest.mark.unit


def avro(*fields: dict[str, Any], name: str = "Flight", **extra: Any) -> ParsedSchema:
    return parse_schema("Avro", json.dumps({"type": "record", "name": name, "fields": list(fields), **extra}), subject="s")


def jsonschema(properties: dict[str, Any], required: Sequence[str] = (), **extra: Any) -> ParsedSchema:
    schema = {"type": "object", "properties": properties, "required": list(required), **extra}
    return parse_schema("JsonSchema", json.dumps(schema), subject="s")


def proto(body: str, *, name: str = "Flight", more: str = "", package: str = "demo") -> ParsedSchema:
    text = f'syntax = "proto3";\npackage {package};\nmessage {name} {{\n{body}\n}}\n{more}'
    return parse_schema("Protobuf", text, subject="s")


@dataclass(frozen=True)
class Format:
    """A base schema and four changes of it, with the finding each direction reports."""

    name: str
    base: ParsedSchema
    backward: ParsedSchema  # read-old-data only; FORWARD finds forward_finding
    forward: ParsedSchema  # written-data-readable-by-old only; BACKWARD finds backward_finding
    full: ParsedSchema
    breaking: ParsedSchema
    forward_finding: tuple[str, str]
    backward_finding: tuple[str, str]
    breaking_finding: tuple[str, str]
    other_type: ParsedSchema


S = {"type": "string"}
CLOSED = {"additionalProperties": False}
OPEN_PROTO_BASE = "string carrier = 1;\nint32 flight = 2;\noneof delay { int32 minutes = 3; string reason = 4; }"

FORMATS = [
    Format(
        "Avro",
        base=avro({"name": "carrier", "type": "string"}, {"name": "flight", "type": "int"}),
        backward=avro({"name": "carrier", "type": "string"}, {"name": "flight", "type": "long"}),
        forward=avro({"name": "carrier", "type": "string"}, {"name": "flight", "type": "int"}, {"name": "gate", "type": "string"}),
        full=avro({"name": "carrier", "type": "string"}, {"name": "flight", "type": "int"},
                  {"name": "gate", "type": "string", "default": ""}),
        breaking=avro({"name": "carrier", "type": "string"}, {"name": "flight", "type": "string"}),
        forward_finding=("flight", "TYPE_CHANGED"),
        backward_finding=("gate", "FIELD_ADDED_WITHOUT_DEFAULT"),
        breaking_finding=("flight", "TYPE_CHANGED"),
        other_type=jsonschema({"carrier": S}),
    ),
    Format(
        "JsonSchema",
        base=jsonschema({"carrier": S, "flight": {"type": "integer"}}, ["carrier"], **CLOSED),
        backward=jsonschema({"carrier": S, "flight": {"type": "number"}}, ["carrier"], **CLOSED),
        forward=jsonschema({"carrier": S, "flight": {"type": "integer"}}, ["carrier", "flight"], **CLOSED),
        full=jsonschema({"carrier": {"type": "string", "description": "IATA code"}, "flight": {"type": "integer"}},
                        ["carrier"], title="Flight", **CLOSED),
        breaking=jsonschema({"carrier": S, "flight": {"type": "string"}}, ["carrier"], **CLOSED),
        forward_finding=("flight", "TYPE_NARROWED"),
        backward_finding=("flight", "REQUIRED_ATTRIBUTE_ADDED"),
        breaking_finding=("flight", "TYPE_CHANGED"),
        other_type=proto("string carrier = 1;"),
    ),
    Format(
        "Protobuf",
        base=proto(OPEN_PROTO_BASE),
        backward=proto("string carrier = 1;\nint32 flight = 2;\noneof delay { int32 minutes = 3; string reason = 4; bool none = 5; }"),
        forward=proto("string carrier = 1;\nint32 flight = 2;\noneof delay { int32 minutes = 3; }"),
        full=proto("string airline = 1;\nint64 flight = 2;\noneof delay { int32 minutes = 3; string reason = 4; }\nstring gate = 6;"),
        breaking=proto("string carrier = 1;\nstring flight = 2;\noneof delay { int32 minutes = 3; string reason = 4; }"),
        forward_finding=("none", "ONEOF_FIELD_REMOVED"),
        backward_finding=("reason", "ONEOF_FIELD_REMOVED"),
        breaking_finding=("flight", "FIELD_SCALAR_KIND_CHANGED"),
        other_type=avro({"name": "carrier", "type": "string"}),
    ),
]


def findings(result: list[Incompatibility]) -> list[tuple[str, str, int]]:
    return [(i.path, i.rule, i.version) for i in result]


@pytest.fixture(params=FORMATS, ids=lambda f: f.name)
def fmt(request: pytest.FixtureRequest) -> Format:
    return request.param  # type: ignore[no-any-return]


def test_none_accepts_any_change_of_the_same_type_only(fmt: Format) -> None:
    assert check_compatibility(NONE, fmt.breaking, [fmt.base]) == []
    assert findings(check_compatibility(NONE, fmt.other_type, [fmt.base, fmt.breaking])) == [("", "SCHEMA_TYPE_CHANGED", 2)]


def test_backward(fmt: Format) -> None:
    assert check_compatibility(BACKWARD, fmt.backward, [fmt.base]) == []
    assert check_compatibility(BACKWARD, fmt.full, [fmt.base]) == []
    assert findings(check_compatibility(BACKWARD, fmt.forward, [fmt.base])) == [(*fmt.backward_finding, 1)]
    assert findings(check_compatibility(BACKWARD, fmt.breaking, [fmt.base])) == [(*fmt.breaking_finding, 1)]


def test_forward(fmt: Format) -> None:
    assert check_compatibility(FORWARD, fmt.forward, [fmt.base]) == []
    assert check_compatibility(FORWARD, fmt.full, [fmt.base]) == []
    assert findings(check_compatibility(FORWARD, fmt.backward, [fmt.base])) == [(*fmt.forward_finding, 1)]
    assert findings(check_compatibility(FORWARD, fmt.breaking, [fmt.base])) == [(*fmt.breaking_finding, 1)]


def test_full(fmt: Format) -> None:
    assert check_compatibility(FULL, fmt.full, [fmt.base]) == []
    assert findings(check_compatibility(FULL, fmt.backward, [fmt.base])) == [(*fmt.forward_finding, 1)]
    assert findings(check_compatibility(FULL, fmt.forward, [fmt.base])) == [(*fmt.backward_finding, 1)]
    assert (*fmt.breaking_finding, 1) in findings(check_compatibility(FULL, fmt.breaking, [fmt.base]))


def test_backward_transitive(fmt: Format) -> None:
    """Version 2 broke BACKWARD (it was registered under NONE); the same shape again fits
    version 2 but not version 1."""
    history = [fmt.base, fmt.forward]
    assert check_compatibility(BACKWARD, fmt.forward, history) == []
    assert findings(check_compatibility(BACKWARD_TRANSITIVE, fmt.forward, history)) == [(*fmt.backward_finding, 1)]
    assert check_compatibility(BACKWARD_TRANSITIVE, fmt.full, [fmt.base, fmt.full]) == []


def test_forward_transitive(fmt: Format) -> None:
    history = [fmt.base, fmt.backward]
    assert check_compatibility(FORWARD, fmt.backward, history) == []
    assert findings(check_compatibility(FORWARD_TRANSITIVE, fmt.backward, history)) == [(*fmt.forward_finding, 1)]
    assert check_compatibility(FORWARD_TRANSITIVE, fmt.full, [fmt.base, fmt.full]) == []


def test_full_transitive(fmt: Format) -> None:
    history = [fmt.base, fmt.breaking]
    assert check_compatibility(FULL, fmt.breaking, history) == []
    found = findings(check_compatibility(FULL_TRANSITIVE, fmt.breaking, history))
    assert found and all(f == (*fmt.breaking_finding, 1) for f in found)
    assert check_compatibility(FULL_TRANSITIVE, fmt.full, [fmt.base, fmt.full]) == []


def test_versions_are_named_as_given(fmt: Format) -> None:
    found = check_compatibility(BACKWARD_TRANSITIVE, fmt.forward, [fmt.base, fmt.forward], versions=[3, 7])
    assert findings(found) == [(*fmt.backward_finding, 3)]
    assert found[0].message  # says what is wrong


def test_modes_in_either_spelling() -> None:
    assert normalize_mode("BACKWARD_TRANSITIVE") == BACKWARD_TRANSITIVE == "BackwardTransitive"
    assert normalize_mode("full") == FULL and normalize_mode("forward-transitive") == FORWARD_TRANSITIVE
    assert [normalize_mode(m) for m in COMPATIBILITY_MODES] == list(COMPATIBILITY_MODES)
    with pytest.raises(MalformedRequestError):
        normalize_mode("SIDEWAYS")
    assert check_compatibility("BACKWARD", FORMATS[0].backward, []) == []


# ------------------------------------------------------------------ Avro, rule by rule


def rules(mode: str, new: ParsedSchema, old: ParsedSchema) -> list[tuple[str, str]]:
    return [(i.path, i.rule) for i in check_compatibility(mode, new, [old])]


def rec(name: str, *fields: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "record", "name": name, "fields": list(fields), **extra}


@pytest.mark.parametrize(
    ("old_fields", "new_fields", "expected"),
    [
        # promotions the reader makes (BACKWARD: the new schema reads)
        ([{"name": "a", "type": "int"}], [{"name": "a", "type": "double"}], []),
        ([{"name": "a", "type": "long"}], [{"name": "a", "type": "float"}], []),
        ([{"name": "a", "type": "float"}], [{"name": "a", "type": "double"}], []),
        ([{"name": "a", "type": "string"}], [{"name": "a", "type": "bytes"}], []),
        ([{"name": "a", "type": "bytes"}], [{"name": "a", "type": "string"}], []),
        ([{"name": "a", "type": "long"}], [{"name": "a", "type": "int"}], [("a", "TYPE_CHANGED")]),
        ([{"name": "a", "type": "double"}], [{"name": "a", "type": "float"}], [("a", "TYPE_CHANGED")]),
        # a field renamed through an alias of the reader
        ([{"name": "a", "type": "int"}], [{"name": "b", "type": "int", "aliases": ["a"]}], []),
        ([{"name": "a", "type": "int"}], [{"name": "b", "type": "int"}], [("b", "FIELD_ADDED_WITHOUT_DEFAULT")]),
        # unions
        ([{"name": "a", "type": "int"}], [{"name": "a", "type": ["null", "int"]}], []),
        ([{"name": "a", "type": "int"}], [{"name": "a", "type": ["null", "long"]}], []),
        ([{"name": "a", "type": ["null", "int"]}], [{"name": "a", "type": "int"}], [("a", "TYPE_CHANGED")]),
        ([{"name": "a", "type": "string"}], [{"name": "a", "type": ["null", "int"]}], [("a", "MISSING_UNION_BRANCH")]),
        # enums
        ([{"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}}],
         [{"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}}], []),
        ([{"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}}],
         [{"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"]}}], [("e", "ENUM_SYMBOL_REMOVED")]),
        ([{"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}}],
         [{"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "Z"], "default": "Z"}}], []),
        ([{"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"]}}],
         [{"name": "e", "type": {"type": "enum", "name": "F", "symbols": ["A"]}}], [("e", "NAME_CHANGED")]),
        ([{"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"]}}],
         [{"name": "e", "type": {"type": "enum", "name": "F", "aliases": ["E"], "symbols": ["A"]}}], []),
        # nested records, arrays and maps: the path names the field
        ([{"name": "n", "type": rec("Inner", {"name": "x", "type": "int"})}],
         [{"name": "n", "type": rec("Inner", {"name": "x", "type": "string"})}], [("n.x", "TYPE_CHANGED")]),
        ([{"name": "l", "type": {"type": "array", "items": rec("I", {"name": "x", "type": "int"})}}],
         [{"name": "l", "type": {"type": "array", "items": rec("I", {"name": "x", "type": "int"}, {"name": "y", "type": "int"})}}],
         [("l[].y", "FIELD_ADDED_WITHOUT_DEFAULT")]),
        ([{"name": "m", "type": {"type": "map", "values": "int"}}], [{"name": "m", "type": {"type": "map", "values": "long"}}], []),
        ([{"name": "m", "type": {"type": "map", "values": "long"}}], [{"name": "m", "type": {"type": "map", "values": "int"}}],
         [("m{}", "TYPE_CHANGED")]),
        ([{"name": "f", "type": {"type": "fixed", "name": "F", "size": 4}}],
         [{"name": "f", "type": {"type": "fixed", "name": "F", "size": 8}}], [("f", "FIXED_SIZE_CHANGED")]),
        # decimals: same scale, wider precision reads; another scale does not
        ([{"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}}],
         [{"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}}], []),
        ([{"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}}],
         [{"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}}],
         [("d", "DECIMAL_PRECISION_NARROWED")]),
        ([{"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}}],
         [{"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 3}}],
         [("d", "DECIMAL_SCALE_CHANGED")]),
    ],
)  # fmt: skip
def test_avro_schema_resolution(old_fields: list[Any], new_fields: list[Any], expected: list[tuple[str, str]]) -> None:
    assert rules(BACKWARD, avro(*new_fields), avro(*old_fields)) == expected


def test_avro_record_names_and_recursion() -> None:
    assert rules(BACKWARD, avro({"name": "a", "type": "int"}, name="Other"), avro({"name": "a", "type": "int"})) == [
        ("", "NAME_CHANGED")
    ]
    assert rules(BACKWARD, avro({"name": "a", "type": "int"}, name="Other", aliases=["Flight"]), avro({"name": "a", "type": "int"})) == []
    linked = {"name": "next", "type": ["null", "Flight"], "default": None}
    old = avro({"name": "a", "type": "int"}, linked)
    new = avro({"name": "a", "type": "long"}, linked, {"name": "b", "type": "int", "default": 0})
    assert rules(FULL, new, old) == [("a", "TYPE_CHANGED")]  # FORWARD: long is not read as int


def test_avro_forward_names_the_removed_field() -> None:
    old = avro({"name": "a", "type": "int"}, {"name": "b", "type": "string"})
    assert rules(FORWARD, avro({"name": "a", "type": "int"}), old) == [("b", "FIELD_REMOVED_WITHOUT_DEFAULT")]
    with_default = avro({"name": "a", "type": "int"}, {"name": "b", "type": "string", "default": ""})
    assert rules(FORWARD, avro({"name": "a", "type": "int"}), with_default) == []
    enum_old = avro({"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"]}})
    enum_new = avro({"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}})
    assert rules(FORWARD, enum_new, enum_old) == [("e", "ENUM_SYMBOL_ADDED")]


# ------------------------------------------------------------------ JSON Schema, rule by rule


def js(schema: dict[str, Any]) -> ParsedSchema:
    return parse_schema("JsonSchema", json.dumps(schema), subject="s")


def obj(props: dict[str, Any], required: list[str] | None = None, extra: Any = None) -> ParsedSchema:
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    if extra is not None:
        schema["additionalProperties"] = extra
    return js(schema)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # open content model (additionalProperties absent): old data may hold any property
        (obj({"a": S}), obj({"a": S, "b": S}), [("b", "PROPERTY_ADDED_TO_OPEN_CONTENT_MODEL")]),
        (obj({"a": S}), obj({"a": S, "b": {}}), []),
        (obj({"a": S, "b": S}), obj({"a": S}), []),
        # closed content model
        (obj({"a": S}, extra=False), obj({"a": S, "b": S}, extra=False), []),
        (obj({"a": S}, extra=False), obj({"a": S, "b": S}, ["b"], extra=False),
         [("b", "REQUIRED_PROPERTY_ADDED_TO_UNOPEN_CONTENT_MODEL")]),
        (obj({"a": S}, extra=False), obj({"a": S, "b": {"type": "string", "default": ""}}, ["b"], extra=False), []),
        (obj({"a": S, "b": S}, extra=False), obj({"a": S}, extra=False), [("b", "PROPERTY_REMOVED_FROM_CLOSED_CONTENT_MODEL")]),
        # partially open
        (obj({"a": S}, extra=S), obj({"a": S, "b": S}, extra=S), []),
        (obj({"a": S}, extra=S), obj({"a": S, "b": {"type": "integer"}}, extra=S),
         [("b", "PROPERTY_ADDED_NOT_COVERED_BY_PARTIALLY_OPEN_CONTENT_MODEL")]),
        (obj({"a": S, "b": {"type": "integer"}}, extra=S), obj({"a": S}, extra=S),
         [("b", "PROPERTY_REMOVED_NOT_COVERED_BY_PARTIALLY_OPEN_CONTENT_MODEL")]),
        # required
        (obj({"a": S}), obj({"a": S}, ["a"]), [("a", "REQUIRED_ATTRIBUTE_ADDED")]),
        (obj({"a": S}, ["a"]), obj({"a": S}), []),
        # additionalProperties
        (obj({"a": S}), obj({"a": S}, extra=False), [("{}", "ADDITIONAL_PROPERTIES_REMOVED")]),
        (obj({"a": S}), obj({"a": S}, extra=S), [("{}", "ADDITIONAL_PROPERTIES_NARROWED")]),
        (obj({"a": S}, extra=False), obj({"a": S}, extra=True), []),
        (obj({"a": S}, extra={"type": "integer"}), obj({"a": S}, extra={"type": "number"}), []),
        (obj({"a": S}, extra={"type": "number"}), obj({"a": S}, extra={"type": "integer"}),
         [("{}", "ADDITIONAL_PROPERTIES_NARROWED")]),
        # types: widening and narrowing
        (obj({"a": {"type": "integer"}}), obj({"a": {"type": "number"}}), []),
        (obj({"a": {"type": "number"}}), obj({"a": {"type": "integer"}}), [("a", "TYPE_NARROWED")]),
        (obj({"a": S}), obj({"a": {"type": ["string", "null"]}}), []),
        (obj({"a": {"type": ["string", "null"]}}), obj({"a": S}), [("a", "TYPE_NARROWED")]),
        (obj({"a": S}), obj({"a": {"type": "boolean"}}), [("a", "TYPE_CHANGED")]),
        # enums
        (obj({"a": {"enum": ["x", "y"]}}), obj({"a": {"enum": ["x", "y", "z"]}}), []),
        (obj({"a": {"enum": ["x", "y"]}}), obj({"a": {"enum": ["x"]}}), [("a", "ENUM_ARRAY_NARROWED")]),
        (obj({"a": S}), obj({"a": {"type": "string", "enum": ["x"]}}), [("a", "ENUM_ARRAY_NARROWED")]),
        # bounds
        (obj({"a": {"type": "string", "maxLength": 5}}), obj({"a": {"type": "string", "maxLength": 9}}), []),
        (obj({"a": {"type": "string", "maxLength": 9}}), obj({"a": {"type": "string", "maxLength": 5}}), [("a", "MAX_LENGTH_DECREASED")]),
        (obj({"a": {"type": "integer"}}), obj({"a": {"type": "integer", "minimum": 0}}), [("a", "MINIMUM_ADDED")]),
        # nested objects and arrays name the path; local $ref are followed
        (obj({"n": {"type": "object", "properties": {"x": {"type": "integer"}}}}),
         obj({"n": {"type": "object", "properties": {"x": S}}}), [("n.x", "TYPE_CHANGED")]),
        (obj({"l": {"type": "array", "items": {"type": "integer"}}}), obj({"l": {"type": "array", "items": S}}),
         [("l[]", "TYPE_CHANGED")]),
        (obj({"r": {"type": "integer"}}), js({"type": "object", "properties": {"r": {"$ref": "#/$defs/y"}},
                                              "$defs": {"y": {"type": "number"}}}), []),
        # anyOf: a branch added reads old data; a writer branch no reader branch reads does not
        (obj({"a": S}), obj({"a": {"anyOf": [S, {"type": "integer"}]}}), []),
        (obj({"a": {"anyOf": [S, {"type": "integer"}]}}), obj({"a": S}), [("a", "SUM_TYPE_NARROWED")]),
    ],
)  # fmt: skip
def test_json_schema_rules(old: ParsedSchema, new: ParsedSchema, expected: list[tuple[str, str]]) -> None:
    assert rules(BACKWARD, new, old) == expected


def test_json_schema_ref_with_defs() -> None:
    old = js({"type": "object", "properties": {"r": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "integer"}}})
    new = js({"type": "object", "properties": {"r": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "string"}}})
    assert rules(BACKWARD, new, old) == [("r", "TYPE_CHANGED")]
    looped = js({"type": "object", "properties": {"next": {"$ref": "#"}, "a": {"type": "integer"}}})
    assert rules(FULL, looped, looped) == []


# ------------------------------------------------------------------ Protobuf, rule by rule


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # the wire-compatible scalar groups
        ("int32 a = 1;", "uint64 a = 1;", []),
        ("int32 a = 1;", "bool a = 1;", []),
        ("sint32 a = 1;", "sint64 a = 1;", []),
        ("fixed32 a = 1;", "sfixed32 a = 1;", []),
        ("fixed64 a = 1;", "sfixed64 a = 1;", []),
        ("string a = 1;", "bytes a = 1;", []),
        ("int32 a = 1;", "sint32 a = 1;", [("a", "FIELD_SCALAR_KIND_CHANGED")]),
        ("float a = 1;", "double a = 1;", [("a", "FIELD_SCALAR_KIND_CHANGED")]),
        ("fixed32 a = 1;", "fixed64 a = 1;", [("a", "FIELD_SCALAR_KIND_CHANGED")]),
        # names do not count, numbers do
        ("int32 a = 1;", "int32 renamed = 1;", []),
        ("int32 a = 1; string b = 2;", "int32 a = 1;", []),
        ("int32 a = 1;", "int32 a = 1; string b = 2;", []),
        # kinds and labels
        ("int32 a = 1;", "E a = 1; enum E { Z = 0; }", [("a", "FIELD_KIND_CHANGED")]),
        ("Inner a = 1; message Inner { int32 x = 1; }", "string a = 1; message Inner { int32 x = 1; }",
         [("a", "FIELD_KIND_CHANGED")]),
        ("Inner a = 1; message Inner { int32 x = 1; } message Other { int32 x = 1; }",
         "Other a = 1; message Inner { int32 x = 1; } message Other { int32 x = 1; }", [("a", "FIELD_NAMED_TYPE_CHANGED")]),
        ("int32 a = 1;", "repeated int32 a = 1;", [("a", "FIELD_LABEL_CHANGED")]),
        ("repeated Inner a = 1; message Inner { int32 x = 1; }", "Inner a = 1; message Inner { int32 x = 1; }",
         [("a", "FIELD_LABEL_CHANGED")]),
        ("optional int32 a = 1;", "int32 a = 1;", []),
        # nested messages: the path follows the fields
        ("Inner n = 1; message Inner { int32 x = 1; }", "Inner n = 1; message Inner { string x = 1; }",
         [("n.x", "FIELD_SCALAR_KIND_CHANGED")]),
        ("repeated Inner n = 1; message Inner { int32 x = 1; }", "repeated Inner n = 1; message Inner { double x = 1; }",
         [("n[].x", "FIELD_SCALAR_KIND_CHANGED")]),
        ("map<string, int32> m = 1;", "map<string, int64> m = 1;", []),
        ("map<string, int32> m = 1;", "map<string, string> m = 1;", [("m{}", "FIELD_SCALAR_KIND_CHANGED")]),
        ("map<string, int32> m = 1;", "repeated int32 m = 1;", [("m", "FIELD_KIND_CHANGED")]),
        # oneofs
        ("int32 a = 1; int32 b = 2;", "oneof o { int32 a = 1; } int32 b = 2;", []),
        ("int32 a = 1; int32 b = 2;", "oneof o { int32 a = 1; int32 b = 2; }", [("o", "MULTIPLE_FIELDS_MOVED_TO_ONEOF")]),
        ("oneof o { int32 a = 1; int32 b = 2; }", "oneof o { int32 a = 1; } int32 b = 2;", [("b", "ONEOF_FIELD_REMOVED")]),
        ("oneof o { int32 a = 1; }", "oneof o { int32 a = 1; int32 b = 2; }", []),
        ("oneof o { int32 a = 1; }", "int32 a = 1;", []),
    ],
)  # fmt: skip
def test_protobuf_rules(old: str, new: str, expected: list[tuple[str, str]]) -> None:
    assert rules(BACKWARD, proto(new), proto(old)) == expected


def test_protobuf_messages() -> None:
    base = proto("int32 a = 1;")
    assert rules(BACKWARD, proto("int32 a = 1;", name="Renamed"), base) == [("", "MESSAGE_NAME_CHANGED")]
    assert rules(BACKWARD, proto("int32 a = 1;", package="other"), base) == []  # a package change is fine
    with_extra = proto("int32 a = 1;", more="message Extra { int32 x = 1; }")
    assert rules(BACKWARD, base, with_extra) == [("Extra", "MESSAGE_REMOVED")]
    assert rules(FORWARD, with_extra, base) == [("Extra", "MESSAGE_REMOVED")]
    assert rules(BACKWARD, with_extra, base) == []
