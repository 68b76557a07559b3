"""Schema compatibility: may a new version of a subject be registered?

The modes are Confluent Schema Registry's ("Schema Evolution and Compatibility"), checked
against the subject's versions in registration order:

=====================  ===============================  ==================================
mode (Danube, etcd)    Confluent name                   the new schema must ...
=====================  ===============================  ==================================
``None``               ``NONE``                         nothing is checked
``Backward``           ``BACKWARD``                     read data written with the last version
``BackwardTransitive`` ``BACKWARD_TRANSITIVE``          read data written with every version
``Forward``            ``FORWARD``                      write data the last version can read
``ForwardTransitive``  ``FORWARD_TRANSITIVE``           write data every version can read
``Full``               ``FULL``                         both, against the last version
``FullTransitive``     ``FULL_TRANSITIVE``              both, against every version
=====================  ===============================  ==================================

``docs/etcd-layout.md`` §4.2 stores the Danube spelling; :func:`normalize_mode` accepts either
spelling in any letter case (``BACKWARD_TRANSITIVE``, ``BackwardTransitive``,
``backward-transitive``). Whatever the mode, a version of another schema type than the
subject's is refused (rule ``SCHEMA_TYPE_CHANGED``).

A check is always "can ``reader`` read what ``writer`` wrote": BACKWARD checks the new schema
as reader of the old one, FORWARD the old one as reader of the new one. Every
:class:`Incompatibility` names the field (``path``, dotted: ``"nested.inner"``; ``[]`` is an
array's item or repeated element, ``{}`` a map's value; ``""`` the whole schema), a short
``rule`` and the ``version`` it conflicts with.

**Avro** follows the Avro specification 1.11, "Schema Resolution":

=================================  ===========================================================
rule                               when (reader vs writer)
=================================  ===========================================================
``TYPE_CHANGED``                   the types differ and no promotion applies (promotions:
                                   int to long, float or double; long to float or double;
                                   float to double; string to bytes; bytes to string)
``NAME_CHANGED``                   records, enums or fixed whose unqualified names differ and
                                   no reader alias names the writer's type
``FIELD_ADDED_WITHOUT_DEFAULT``    the new schema (reader) has a field the old one lacks, with
                                   no default (matched by name or by the reader field's aliases)
``FIELD_REMOVED_WITHOUT_DEFAULT``  the old schema (reader) has a field without default that
                                   the new one lacks
``ENUM_SYMBOL_REMOVED`` /          a writer symbol the reader lacks, and the reader's enum has
``ENUM_SYMBOL_ADDED``              no ``default`` (named from the new schema's side)
``FIXED_SIZE_CHANGED``             fixed types of different sizes
``MISSING_UNION_BRANCH``           a writer type that no branch of the reader's union can read
``DECIMAL_SCALE_CHANGED``          decimals (logical type) of different scales
``DECIMAL_PRECISION_NARROWED``     a reader decimal of smaller precision than the writer's
=================================  ===========================================================

A writer union must be readable branch by branch; a reader union reads a writer type with its
first branch that can. Arrays and maps are resolved by their items and values, records field by
field. Decimal: the specification says decimals match when scale *and* precision are equal;
here a wider reader precision (same scale) is accepted, since every written value fits (Iceberg
widens decimals the same way). Other logical types resolve by their underlying type.

**JSON Schema** follows Confluent's JSON Schema rules (``SchemaDiff``, the "strict" set); a
writer is "open" when ``additionalProperties`` is absent, ``true`` or ``{}``, "closed" when it
is ``false``, "partially open" when it is a schema. Implemented (only incompatible changes are
reported; every other difference is accepted):

==================================================  ==========================================
rule                                                when (reader vs writer)
==================================================  ==========================================
``TYPE_CHANGED`` / ``TYPE_NARROWED``                a writer ``type`` the reader does not accept
                                                    (``integer`` to ``number`` widens: fine)
``PROPERTY_ADDED_TO_OPEN_CONTENT_MODEL``            the reader has a property (not ``{}``) that
                                                    an open writer lacks
``PROPERTY_ADDED_NOT_COVERED_BY_PARTIALLY_OPEN_``   ... that a partially open writer lacks, and
``CONTENT_MODEL``                                   its ``additionalProperties`` does not fit it
``REQUIRED_PROPERTY_ADDED_TO_UNOPEN_CONTENT_MODEL`` the reader requires (without default) a
                                                    property that a closed writer lacks
``PROPERTY_REMOVED_FROM_CLOSED_CONTENT_MODEL``      a writer property that a closed reader lacks
``PROPERTY_REMOVED_NOT_COVERED_BY_PARTIALLY_OPEN_`` ... that a partially open reader lacks and
``CONTENT_MODEL``                                   its ``additionalProperties`` cannot read
``REQUIRED_ATTRIBUTE_ADDED``                        an optional property made required (no
                                                    default)
``ADDITIONAL_PROPERTIES_REMOVED``                   ``additionalProperties`` made ``false``
``ADDITIONAL_PROPERTIES_NARROWED``                  ``additionalProperties`` made narrower
``ENUM_ARRAY_NARROWED``                             a writer ``enum``/``const`` value the
                                                    reader's lacks, or an ``enum`` added
``<BOUND>_ADDED``, ``<MAX>_DECREASED``,             a bound added or tightened: ``maxLength``,
``<MIN>_INCREASED``                                 ``minLength``, ``maximum``, ``minimum``,
                                                    ``exclusiveMaximum``, ``exclusiveMinimum``,
                                                    ``maxItems``, ``minItems``,
                                                    ``maxProperties``, ``minProperties``
``MULTIPLE_OF_ADDED`` / ``MULTIPLE_OF_CHANGED``     ``multipleOf`` added, or not a divisor of
                                                    the writer's
``PATTERN_ADDED`` / ``PATTERN_CHANGED``             ``pattern`` added or changed
``UNIQUE_ITEMS_ADDED``                              ``uniqueItems`` added
``SUM_TYPE_NARROWED``                               a writer ``anyOf``/``oneOf`` branch (or the
                                                    whole writer) that no reader branch reads
``COMBINED_TYPE_CHANGED``                           ``allOf`` or ``not`` changed (equality)
``ITEMS_CHANGED``                                   tuple ``items``/``prefixItems`` changed
                                                    (equality)
==================================================  ==========================================

Local ``$ref`` are followed (a reference cycle is compared once). ``patternProperties``,
``dependencies`` and ``if``/``then``/``else`` are not compared.

**Protobuf** follows Confluent's Protobuf rules, on the compiled ``FileDescriptorProto``:

===================================  =========================================================
rule                                 when (reader vs writer)
===================================  =========================================================
``MESSAGE_REMOVED``                  a message of the writer's file is not in the reader's
                                     (names relative to the package, so a package change is fine)
``MESSAGE_NAME_CHANGED``             the record message (the first one) has another name
``FIELD_SCALAR_KIND_CHANGED``        a field number's scalar type changes group; the groups
                                     read each other's bytes: int32/uint32/int64/uint64/bool;
                                     sint32/sint64; fixed32/sfixed32; fixed64/sfixed64;
                                     string/bytes (float and double stand alone)
``FIELD_KIND_CHANGED``               scalar to message or enum (or back), message to enum, map
                                     to non-map
``FIELD_NAMED_TYPE_CHANGED``         another message or enum type
``FIELD_LABEL_CHANGED``              singular to ``repeated`` or back (Confluent accepts this
                                     for numeric and string/bytes scalars; refused here, as the
                                     value's shape changes)
``ONEOF_FIELD_REMOVED``              a field leaves a ``oneof`` that both have
``MULTIPLE_FIELDS_MOVED_TO_ONEOF``   a new ``oneof`` takes in more than one existing field
===================================  =========================================================

Accepted: adding or removing a field, renaming a field (the number is what counts), adding a
``oneof`` or a field to a ``oneof``, removing a ``oneof``, enum value changes, package
changes. Fields are compared along the record message and every message type its fields
reach (proto3 ``optional`` is not a ``oneof`` here).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any, Final

from google.protobuf import descriptor_pb2

from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.schemas.formats import (
    AVRO,
    JSON_SCHEMA,
    PROTOBUF,
    ParsedProtobuf,
    ParsedSchema,
    resolve_json_pointer,
)

__all__ = [
    "BACKWARD",
    "BACKWARD_TRANSITIVE",
    "COMPATIBILITY_MODES",
    "DEFAULT_MODE",
    "FORWARD",
    "FORWARD_TRANSITIVE",
    "FULL",
    "FULL_TRANSITIVE",
    "NONE",
    "Incompatibility",
    "check_compatibility",
    "normalize_mode",
]

NONE: Final = "None"
BACKWARD: Final = "Backward"
BACKWARD_TRANSITIVE: Final = "BackwardTransitive"
FORWARD: Final = "Forward"
FORWARD_TRANSITIVE: Final = "ForwardTransitive"
FULL: Final = "Full"
FULL_TRANSITIVE: Final = "FullTransitive"
COMPATIBILITY_MODES: Final = (NONE, BACKWARD, BACKWARD_TRANSITIVE, FORWARD, FORWARD_TRANSITIVE, FULL, FULL_TRANSITIVE)
"""The modes, in Danube's spelling (the value of ``compatibility_mode``, ``docs/etcd-layout.md`` §4.2)."""
DEFAULT_MODE: Final = BACKWARD
"""The mode of a subject created without one (Confluent's default too)."""

_BY_FOLDED = {mode.lower(): mode for mode in COMPATIBILITY_MODES}


def normalize_mode(mode: str) -> str:
    """The Danube spelling of ``mode`` (``"BACKWARD_TRANSITIVE"`` -> ``"BackwardTransitive"``).

    Raises:
        MalformedRequestError: ``mode`` is none of :data:`COMPATIBILITY_MODES` in either
            spelling.
    """
    folded = mode.replace("_", "").replace("-", "").lower() if isinstance(mode, str) else ""
    found = _BY_FOLDED.get(folded)
    if found is None:
        raise MalformedRequestError(
            f"unknown compatibility mode {mode!r}; one of {', '.join(COMPATIBILITY_MODES)} "
            "(or Confluent's NONE, BACKWARD, BACKWARD_TRANSITIVE, ...)"
        )
    return found


@dataclasses.dataclass(frozen=True, slots=True)
class Incompatibility:
    """Why a new schema cannot be registered after an earlier version.

    Attributes:
        path: the field, dotted (``"flight"``, ``"nested.inner"``); ``[]`` marks an array item
            (repeated element), ``{}`` a map value; ``""`` is the whole schema.
        rule: a short rule name, e.g. ``"TYPE_CHANGED"`` (see the module docstring).
        message: what is wrong, naming both schemas.
        version: the earlier version it conflicts with.
    """

    path: str
    rule: str
    message: str
    version: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Found:
    path: str
    rule: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class _Side:
    """How the reader and writer of one check are named in messages."""

    reader: str
    writer: str
    reader_is_new: bool


def _join(path: str, name: str) -> str:
    return name if not path else f"{path}{name}" if name in ("[]", "{}") else f"{path}.{name}"


def check_compatibility(
    mode: str, new: ParsedSchema, previous: Sequence[ParsedSchema], *, versions: Sequence[int] | None = None
) -> list[Incompatibility]:
    """Check ``new`` against earlier versions of its subject under ``mode``.

    Args:
        mode: a compatibility mode, either spelling (:func:`normalize_mode`).
        new: the schema about to be registered.
        previous: the subject's versions, oldest first (empty for a new subject).
        versions: the version number of each of ``previous``; default ``1, 2, 3...``.

    Returns:
        Every incompatibility found, ``[]`` when ``new`` may be registered. A schema type other
        than the last version's is refused in every mode (``SCHEMA_TYPE_CHANGED``, alone).

    Raises:
        MalformedRequestError: ``mode`` is unknown.
        ValueError: ``versions`` is not as long as ``previous``.
    """
    mode = normalize_mode(mode)
    numbers = list(versions) if versions is not None else list(range(1, len(previous) + 1))
    if len(numbers) != len(previous):
        raise ValueError(f"{len(numbers)} version numbers for {len(previous)} schemas")
    if not previous:
        return []
    last, last_version = previous[-1], numbers[-1]
    if last.schema_type != new.schema_type:
        return [
            Incompatibility(
                "", "SCHEMA_TYPE_CHANGED",
                f"the subject holds {last.schema_type} schemas (version {last_version}); a {new.schema_type} "
                "schema must go under another subject",
                last_version,
            )
        ]  # fmt: skip
    if mode == NONE:
        return []
    pairs = list(zip(previous, numbers, strict=True))
    against = pairs if mode.endswith("Transitive") else pairs[-1:]
    out: list[Incompatibility] = []
    for old, number in reversed(against):
        if mode.startswith(("Backward", "Full")):
            side = _Side("the new schema", f"data written with version {number}", True)
            out.extend(Incompatibility(f.path, f.rule, f.message, number) for f in _can_read(new, old, side))
        if mode.startswith(("Forward", "Full")):
            side = _Side(f"version {number}", "data written with the new schema", False)
            out.extend(Incompatibility(f.path, f.rule, f.message, number) for f in _can_read(old, new, side))
    return out


def _can_read(reader: ParsedSchema, writer: ParsedSchema, side: _Side) -> list[_Found]:
    if reader.schema_type == AVRO:
        return _AvroCheck(side).run(reader.avro, writer.avro)
    if reader.schema_type == JSON_SCHEMA:
        return _JsonCheck(side, reader.json_schema, writer.json_schema).run()
    if reader.schema_type == PROTOBUF:
        assert isinstance(reader, ParsedProtobuf) and isinstance(writer, ParsedProtobuf)
        return _ProtoCheck(side, reader.file_descriptor_proto, writer.file_descriptor_proto).run()
    raise ValueError(f"unknown schema type {reader.schema_type!r}")


# ======================================================================== Avro

_AVRO_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_AVRO_NAMED = frozenset({"record", "error", "enum", "fixed"})
_AVRO_PROMOTIONS = frozenset({
    ("int", "long"), ("int", "float"), ("int", "double"), ("long", "float"), ("long", "double"),
    ("float", "double"), ("string", "bytes"), ("bytes", "string"),
})  # fmt: skip
"""(writer, reader) pairs the reader promotes (Avro spec, "Schema Resolution")."""


def _full_name(name: str, namespace: str | None) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _short(full_name: str) -> str:
    return full_name.rsplit(".", 1)[-1]


class _AvroTree:
    """An Avro schema with named references resolved: each node is a ``dict`` with ``type``;
    a reference to a named type is the named type's own node (so records may be cyclic)."""

    def __init__(self) -> None:
        self.names: dict[str, dict[str, Any]] = {}

    def expand(self, schema: Any, namespace: str | None) -> dict[str, Any]:
        if isinstance(schema, list):
            return {"type": "union", "branches": [self.expand(s, namespace) for s in schema]}
        if isinstance(schema, str):
            if schema in _AVRO_PRIMITIVES:
                return {"type": schema}
            return self._named(schema, namespace)
        if not isinstance(schema, dict):
            return {"type": "null"}
        kind = schema.get("type")
        if isinstance(kind, dict | list):
            return self.expand(kind, namespace)
        if kind in _AVRO_PRIMITIVES:
            node = {"type": kind}
            for key in ("logicalType", "precision", "scale"):
                if key in schema:
                    node[key] = schema[key]
            return node
        if kind == "array":
            return {"type": "array", "items": self.expand(schema.get("items"), namespace)}
        if kind == "map":
            return {"type": "map", "values": self.expand(schema.get("values"), namespace)}
        if kind in _AVRO_NAMED:
            full = _full_name(str(schema.get("name", "")), schema.get("namespace") or namespace)
            own_ns = full.rsplit(".", 1)[0] if "." in full else None
            node = {
                "type": "record" if kind == "error" else kind,
                "name": full,
                "aliases": [_full_name(str(a), own_ns) for a in schema.get("aliases") or []],
            }
            self.names[full] = node
            if kind in ("record", "error"):
                node["fields"] = [
                    {
                        "name": f.get("name"),
                        "aliases": list(f.get("aliases") or []),
                        "has_default": "default" in f,
                        "type": self.expand(f.get("type"), own_ns),
                    }
                    for f in schema.get("fields") or []
                ]
            elif kind == "enum":
                node["symbols"] = list(schema.get("symbols") or [])
                node["has_default"] = "default" in schema
            else:
                node["size"] = schema.get("size")
                for key in ("logicalType", "precision", "scale"):
                    if key in schema:
                        node[key] = schema[key]
            return node
        if isinstance(kind, str):
            return self._named(kind, namespace)
        return {"type": "null"}

    def _named(self, name: str, namespace: str | None) -> dict[str, Any]:
        found = self.names.get(_full_name(name, namespace)) or self.names.get(name)
        return found if found is not None else {"type": "unknown", "name": name}


def _avro_describe(node: dict[str, Any]) -> str:
    kind = node["type"]
    if kind in _AVRO_NAMED or kind == "unknown":
        return f"{kind} {node.get('name')}"
    if kind == "union":
        return "union [" + ", ".join(_avro_describe(b) for b in node["branches"]) + "]"
    if node.get("logicalType") == "decimal":
        return f"{kind} decimal({node.get('precision')}, {node.get('scale', 0)})"
    return str(kind)


class _AvroCheck:
    def __init__(self, side: _Side) -> None:
        self.side = side
        self.seen: set[tuple[int, int]] = set()

    def run(self, reader: Any, writer: Any) -> list[_Found]:
        out: list[_Found] = []
        self.resolve(_AvroTree().expand(reader, None), _AvroTree().expand(writer, None), "", out)
        return out

    def _names_match(self, r: dict[str, Any], w: dict[str, Any]) -> bool:
        if _short(r["name"]) == _short(w["name"]):
            return True
        return any(a == w["name"] or _short(a) == _short(w["name"]) for a in r["aliases"])

    def resolve(self, r: dict[str, Any], w: dict[str, Any], path: str, out: list[_Found]) -> None:
        side = self.side
        rt, wt = r["type"], w["type"]
        if wt == "union":
            for branch in w["branches"]:
                self.resolve(r, branch, path, out)
            return
        if rt == "union":
            for branch in r["branches"]:
                trial: list[_Found] = []
                self.resolve(branch, w, path, trial)
                if not trial:
                    return
            out.append(_Found(path, "MISSING_UNION_BRANCH",
                              f"{side.reader} has no branch of {_avro_describe(r)} that reads the "
                              f"{_avro_describe(w)} of {side.writer}"))  # fmt: skip
            return
        if rt in _AVRO_PRIMITIVES and wt in _AVRO_PRIMITIVES:
            if rt != wt and (wt, rt) not in _AVRO_PROMOTIONS:
                out.append(self._type_changed(r, w, path))
            elif rt == wt == "bytes":
                self._decimal(r, w, path, out)
            return
        if rt != wt:
            out.append(self._type_changed(r, w, path))
            return
        if rt == "array":
            self.resolve(r["items"], w["items"], _join(path, "[]"), out)
        elif rt == "map":
            self.resolve(r["values"], w["values"], _join(path, "{}"), out)
        elif rt in ("record", "enum", "fixed"):
            if not self._names_match(r, w):
                out.append(_Found(path, "NAME_CHANGED",
                                  f"{side.reader} names the {rt} {r['name']!r} where {side.writer} has "
                                  f"{w['name']!r} (and no alias of the reader's names it)"))  # fmt: skip
                return
            if rt == "record":
                self._record(r, w, path, out)
            elif rt == "enum":
                self._enum(r, w, path, out)
            else:
                if r["size"] != w["size"]:
                    out.append(_Found(path, "FIXED_SIZE_CHANGED",
                                      f"{side.reader} has fixed {r['name']} of {r['size']} bytes where "
                                      f"{side.writer} has {w['size']}"))  # fmt: skip
                else:
                    self._decimal(r, w, path, out)
        elif rt == "unknown":
            out.append(self._type_changed(r, w, path))

    def _type_changed(self, r: dict[str, Any], w: dict[str, Any], path: str) -> _Found:
        return _Found(path, "TYPE_CHANGED",
                      f"{self.side.reader} has {_avro_describe(r)} where {self.side.writer} has {_avro_describe(w)}, "
                      "which Avro does not promote")  # fmt: skip

    def _decimal(self, r: dict[str, Any], w: dict[str, Any], path: str, out: list[_Found]) -> None:
        if r.get("logicalType") != "decimal" or w.get("logicalType") != "decimal":
            return
        if r.get("scale", 0) != w.get("scale", 0):
            out.append(_Found(path, "DECIMAL_SCALE_CHANGED",
                              f"{self.side.reader} has {_avro_describe(r)} where {self.side.writer} has "
                              f"{_avro_describe(w)}: the scales differ"))  # fmt: skip
        elif isinstance(r.get("precision"), int) and isinstance(w.get("precision"), int) and r["precision"] < w["precision"]:
            out.append(_Found(path, "DECIMAL_PRECISION_NARROWED",
                              f"{self.side.reader} has {_avro_describe(r)} where {self.side.writer} has "
                              f"{_avro_describe(w)}: values may not fit"))  # fmt: skip

    def _record(self, r: dict[str, Any], w: dict[str, Any], path: str, out: list[_Found]) -> None:
        key = (id(r), id(w))
        if key in self.seen:
            return
        self.seen.add(key)
        writer_fields = {f["name"]: f for f in w["fields"]}
        for field in r["fields"]:
            found = writer_fields.get(field["name"])
            if found is None:
                found = next((writer_fields[a] for a in field["aliases"] if a in writer_fields), None)
            field_path = _join(path, str(field["name"]))
            if found is not None:
                self.resolve(field["type"], found["type"], field_path, out)
            elif not field["has_default"]:
                if self.side.reader_is_new:
                    out.append(_Found(field_path, "FIELD_ADDED_WITHOUT_DEFAULT",
                                      f"field {field_path!r} is new and has no default, so {self.side.reader} "
                                      f"cannot fill it in {self.side.writer}"))  # fmt: skip
                else:
                    out.append(_Found(field_path, "FIELD_REMOVED_WITHOUT_DEFAULT",
                                      f"field {field_path!r} is removed, and {self.side.reader} has no default "
                                      f"for it in {self.side.writer}"))  # fmt: skip

    def _enum(self, r: dict[str, Any], w: dict[str, Any], path: str, out: list[_Found]) -> None:
        if r["has_default"]:
            return
        missing = [s for s in w["symbols"] if s not in r["symbols"]]
        if missing:
            rule = "ENUM_SYMBOL_REMOVED" if self.side.reader_is_new else "ENUM_SYMBOL_ADDED"
            out.append(_Found(path, rule,
                              f"{self.side.reader} lacks enum symbol(s) {', '.join(map(str, missing))} of "
                              f"{self.side.writer}, and its enum {r['name']} has no default"))  # fmt: skip


# ======================================================================== JSON Schema

_JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})
_UPPER_BOUNDS = {"maxLength": "MAX_LENGTH", "maximum": "MAXIMUM", "exclusiveMaximum": "EXCLUSIVE_MAXIMUM",
                 "maxItems": "MAX_ITEMS", "maxProperties": "MAX_PROPERTIES"}  # fmt: skip
_LOWER_BOUNDS = {"minLength": "MIN_LENGTH", "minimum": "MINIMUM", "exclusiveMinimum": "EXCLUSIVE_MINIMUM",
                 "minItems": "MIN_ITEMS", "minProperties": "MIN_PROPERTIES"}  # fmt: skip
_SUM = ("anyOf", "oneOf")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class _JsonCheck:
    def __init__(self, side: _Side, reader_root: dict[str, Any], writer_root: dict[str, Any]) -> None:
        self.side = side
        self.reader_root = reader_root
        self.writer_root = writer_root
        self.seen: set[tuple[int, int]] = set()

    def run(self) -> list[_Found]:
        out: list[_Found] = []
        self.compare(self.writer_root, self.reader_root, "", out)
        return out

    def fits(self, writer: Any, reader: Any, path: str) -> bool:
        trial: list[_Found] = []
        self.compare(writer, reader, path, trial)
        return not trial

    @staticmethod
    def _resolve(node: Any, root: dict[str, Any]) -> Any:
        hops = 0
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and hops < 64:
            try:
                target = resolve_json_pointer(root, node["$ref"])
            except KeyError:
                return {}
            rest = {k: v for k, v in node.items() if k not in ("$ref", "$defs", "definitions")}
            node = {**target, **rest} if isinstance(target, dict) and rest else target
            hops += 1
        return node

    @staticmethod
    def _empty(node: Any) -> bool:
        if node is True:
            return True
        return isinstance(node, dict) and not any(
            k not in ("$schema", "$id", "$comment", "title", "description", "default", "examples", "$defs", "definitions")
            for k in node
        )

    @staticmethod
    def _types(node: dict[str, Any]) -> set[str]:
        kind = node.get("type")
        if isinstance(kind, str):
            return {kind}
        if isinstance(kind, list):
            return {k for k in kind if isinstance(k, str)}
        return set(_JSON_TYPES)

    @staticmethod
    def _accepts(types: set[str], kind: str) -> bool:
        return kind in types or (kind == "integer" and "number" in types)

    def found(self, out: list[_Found], path: str, rule: str, what: str) -> None:
        out.append(_Found(path, rule, f"{self.side.reader} cannot read {self.side.writer}: {what}"))

    def compare(self, writer: Any, reader: Any, path: str, out: list[_Found]) -> None:
        writer = self._resolve(writer, self.writer_root)
        reader = self._resolve(reader, self.reader_root)
        if writer is False or self._empty(reader):
            return
        if reader is False:
            self.found(out, path, "TYPE_CHANGED", f"{path or 'the value'} accepts nothing")
            return
        if writer is True:
            writer = {}
        if not isinstance(writer, dict) or not isinstance(reader, dict):
            return
        key = (id(writer), id(reader))
        if key in self.seen:
            return
        self.seen.add(key)
        if any(k in writer or k in reader for k in _SUM):
            self._sum(writer, reader, path, out)
            return
        for k in ("allOf", "not"):
            if _canonical(writer.get(k)) != _canonical(reader.get(k)):
                self.found(out, path, "COMBINED_TYPE_CHANGED", f"{k!r} at {path or 'the top level'} differs")
        if not self._compare_types(writer, reader, path, out):
            return
        self._compare_values(writer, reader, path, out)
        self._compare_bounds(writer, reader, path, out)
        w_types, r_types = self._types(writer), self._types(reader)
        if "array" in w_types and "array" in r_types:
            self._compare_items(writer, reader, path, out)
        if "object" in w_types and "object" in r_types:
            self._compare_object(writer, reader, path, out)

    def _sum(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[_Found]) -> None:
        def branches(node: dict[str, Any]) -> list[Any]:
            for k in _SUM:
                if isinstance(node.get(k), list):
                    rest = {key: v for key, v in node.items() if key not in _SUM}
                    return [{**rest, **b} if isinstance(b, dict) and rest else b for b in node[k]] or [False]
            return [node]

        readers = branches(reader)
        for i, w_branch in enumerate(branches(writer)):
            if not any(self.fits(w_branch, r_branch, path) for r_branch in readers):
                what = f"branch {i} of the writer's anyOf/oneOf" if any(k in writer for k in _SUM) else "the value"
                self.found(out, path, "SUM_TYPE_NARROWED", f"{what} at {path or 'the top level'} fits no reader branch")

    def _compare_types(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[_Found]) -> bool:
        w_types, r_types = self._types(writer), self._types(reader)
        lost = sorted(t for t in w_types if not self._accepts(r_types, t))
        if not lost:
            return True
        narrowed = all(self._accepts(w_types, t) for t in r_types)
        self.found(out, path, "TYPE_NARROWED" if narrowed else "TYPE_CHANGED",
                   f"{path or 'the value'} may be {', '.join(lost)}, which the reader's type "
                   f"{sorted(r_types)} does not accept")  # fmt: skip
        return False

    def _compare_values(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[_Found]) -> None:
        def allowed(node: dict[str, Any]) -> list[Any] | None:
            if "const" in node:
                return [node["const"]]
            return node["enum"] if isinstance(node.get("enum"), list) else None

        w_values, r_values = allowed(writer), allowed(reader)
        if r_values is None:
            return
        r_set = {_canonical(v) for v in r_values}
        missing = [v for v in w_values if _canonical(v) not in r_set] if w_values is not None else None
        if missing is None:
            self.found(out, path, "ENUM_ARRAY_NARROWED", f"{path or 'the value'} is limited to {r_values!r}")
        elif missing:
            self.found(out, path, "ENUM_ARRAY_NARROWED", f"{path or 'the value'} may be {missing!r}, not allowed")

    def _compare_bounds(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[_Found]) -> None:
        where = path or "the value"
        for bounds, tighter, word in ((_UPPER_BOUNDS, -1, "DECREASED"), (_LOWER_BOUNDS, 1, "INCREASED")):
            for keyword, name in bounds.items():
                r_value: Any = reader.get(keyword)
                w_value: Any = writer.get(keyword)
                if not _is_number(r_value):
                    continue
                if not _is_number(w_value):
                    self.found(out, path, f"{name}_ADDED", f"{keyword} {r_value} is added at {where}")
                elif (r_value - w_value) * tighter > 0:
                    self.found(out, path, f"{name}_{word}", f"{keyword} goes from {w_value} to {r_value} at {where}")
        r_multiple, w_multiple = reader.get("multipleOf"), writer.get("multipleOf")
        if _is_number(r_multiple) and r_multiple:
            if not _is_number(w_multiple):
                self.found(out, path, "MULTIPLE_OF_ADDED", f"multipleOf {r_multiple} is added at {where}")
            elif (w_multiple / r_multiple) != int(w_multiple / r_multiple):
                self.found(out, path, "MULTIPLE_OF_CHANGED", f"multipleOf goes from {w_multiple} to {r_multiple} at {where}")
        if isinstance(reader.get("pattern"), str) and reader.get("pattern") != writer.get("pattern"):
            rule = "PATTERN_ADDED" if "pattern" not in writer else "PATTERN_CHANGED"
            self.found(out, path, rule, f"pattern {reader['pattern']!r} at {where}")
        if reader.get("uniqueItems") is True and writer.get("uniqueItems") is not True:
            self.found(out, path, "UNIQUE_ITEMS_ADDED", f"uniqueItems is added at {where}")

    def _compare_items(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[_Found]) -> None:
        w_items, r_items = writer.get("items", True), reader.get("items", True)
        tuples = "prefixItems" in writer or "prefixItems" in reader or isinstance(w_items, list) or isinstance(r_items, list)
        if tuples:
            for k in ("prefixItems", "items"):
                if _canonical(writer.get(k)) != _canonical(reader.get(k)):
                    self.found(out, path, "ITEMS_CHANGED", f"the tuple {k!r} of {path or 'the value'} differs")
            return
        self.compare(w_items, r_items, _join(path, "[]"), out)

    @staticmethod
    def _model(node: dict[str, Any]) -> tuple[str, Any]:
        """("open", None), ("closed", None) or ("partial", schema) (Confluent's content models)."""
        extra = node.get("additionalProperties", True)
        if extra is False:
            return "closed", None
        if extra is True or (isinstance(extra, dict) and not extra):
            return "open", None
        return "partial", extra

    def _compare_object(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[_Found]) -> None:
        w_props: dict[str, Any] = writer["properties"] if isinstance(writer.get("properties"), dict) else {}
        r_props: dict[str, Any] = reader["properties"] if isinstance(reader.get("properties"), dict) else {}
        w_required = set(writer.get("required") or []) if isinstance(writer.get("required"), list) else set()
        r_required = set(reader.get("required") or []) if isinstance(reader.get("required"), list) else set()
        w_model, w_extra = self._model(writer)
        r_model, r_extra = self._model(reader)

        def has_default(schema: Any) -> bool:
            schema = self._resolve(schema, self.reader_root)
            return isinstance(schema, dict) and "default" in schema

        for name, w_schema in w_props.items():
            if name in r_props:
                continue
            prop = _join(path, name)
            if r_model == "closed" and self._resolve(w_schema, self.writer_root) is not False:
                self.found(out, prop, "PROPERTY_REMOVED_FROM_CLOSED_CONTENT_MODEL",
                           f"property {prop!r} may be present, and the reader allows no other property")  # fmt: skip
            elif r_model == "partial" and not self.fits(w_schema, r_extra, prop):
                self.found(out, prop, "PROPERTY_REMOVED_NOT_COVERED_BY_PARTIALLY_OPEN_CONTENT_MODEL",
                           f"property {prop!r} may be present, and the reader's additionalProperties "
                           "does not accept it")  # fmt: skip
        for name, r_schema in r_props.items():
            prop = _join(path, name)
            required_new = name in r_required and not has_default(r_schema)
            if name in w_props:
                self.compare(w_props[name], r_schema, prop, out)
                if required_new and name not in w_required:
                    self.found(out, prop, "REQUIRED_ATTRIBUTE_ADDED", f"property {prop!r} is now required, with no default")
                continue
            if w_model == "closed":
                if required_new:
                    self.found(out, prop, "REQUIRED_PROPERTY_ADDED_TO_UNOPEN_CONTENT_MODEL",
                               f"property {prop!r} is required (no default) and the writer never writes it")  # fmt: skip
            elif w_model == "open":
                if not self._empty(self._resolve(r_schema, self.reader_root)):
                    self.found(out, prop, "PROPERTY_ADDED_TO_OPEN_CONTENT_MODEL",
                               f"property {prop!r} is new, and the writer's open content model may have "
                               "written anything under that name")  # fmt: skip
                elif required_new:
                    self.found(out, prop, "REQUIRED_ATTRIBUTE_ADDED", f"property {prop!r} is required, with no default")
            else:
                if not self.fits(w_extra, r_schema, prop):
                    self.found(out, prop, "PROPERTY_ADDED_NOT_COVERED_BY_PARTIALLY_OPEN_CONTENT_MODEL",
                               f"property {prop!r} is new, and the writer's additionalProperties may have "
                               "written something else under that name")  # fmt: skip
                elif required_new:
                    self.found(out, prop, "REQUIRED_ATTRIBUTE_ADDED", f"property {prop!r} is required, with no default")
        where = _join(path, "{}")
        if w_model == "closed" or r_model == "open":
            return
        if r_model == "closed":
            self.found(out, where, "ADDITIONAL_PROPERTIES_REMOVED",
                       f"additionalProperties is false at {path or 'the top level'}, and the writer allows "
                       "other properties")  # fmt: skip
        elif w_model == "open" or not self.fits(w_extra, r_extra, where):
            self.found(out, where, "ADDITIONAL_PROPERTIES_NARROWED",
                       f"additionalProperties at {path or 'the top level'} is narrower than the writer's")  # fmt: skip


# ======================================================================== Protobuf

_FDP = descriptor_pb2.FieldDescriptorProto
_SCALAR_GROUPS: dict[int, str] = {
    _FDP.TYPE_INT32: "varint", _FDP.TYPE_UINT32: "varint", _FDP.TYPE_INT64: "varint", _FDP.TYPE_UINT64: "varint",
    _FDP.TYPE_BOOL: "varint", _FDP.TYPE_SINT32: "zigzag", _FDP.TYPE_SINT64: "zigzag",
    _FDP.TYPE_FIXED32: "fixed32", _FDP.TYPE_SFIXED32: "fixed32", _FDP.TYPE_FIXED64: "fixed64",
    _FDP.TYPE_SFIXED64: "fixed64", _FDP.TYPE_STRING: "length-delimited", _FDP.TYPE_BYTES: "length-delimited",
    _FDP.TYPE_FLOAT: "float", _FDP.TYPE_DOUBLE: "double",
}  # fmt: skip
_NAMED_KINDS = {_FDP.TYPE_MESSAGE: "message", _FDP.TYPE_ENUM: "enum", _FDP.TYPE_GROUP: "group"}


def _proto_type(field: descriptor_pb2.FieldDescriptorProto) -> str:
    if field.type in _NAMED_KINDS:
        return f"{_NAMED_KINDS[field.type]} {field.type_name.lstrip('.')}"
    return _FDP.Type.Name(field.type).removeprefix("TYPE_").lower()


class _ProtoFile:
    """A ``FileDescriptorProto``'s messages by name relative to its package (``Outer.Inner``)."""

    def __init__(self, file: descriptor_pb2.FileDescriptorProto) -> None:
        self.package = file.package
        self.messages: dict[str, descriptor_pb2.DescriptorProto] = {}
        self.map_entries: set[str] = set()
        self.root = file.message_type[0].name if file.message_type else ""
        stack = [("", m) for m in file.message_type]
        while stack:
            prefix, message = stack.pop()
            name = f"{prefix}{message.name}"
            self.messages[name] = message
            if message.options.map_entry:
                self.map_entries.add(name)
            stack.extend((f"{name}.", nested) for nested in message.nested_type)

    def relative(self, type_name: str) -> str:
        name = type_name.lstrip(".")
        return name[len(self.package) + 1 :] if self.package and name.startswith(self.package + ".") else name


class _ProtoCheck:
    def __init__(
        self, side: _Side, reader: descriptor_pb2.FileDescriptorProto, writer: descriptor_pb2.FileDescriptorProto
    ) -> None:
        self.side = side
        self.reader = _ProtoFile(reader)
        self.writer = _ProtoFile(writer)
        self.seen: set[tuple[str, str]] = set()

    def found(self, out: list[_Found], path: str, rule: str, what: str) -> None:
        out.append(_Found(path, rule, f"{self.side.reader} cannot read {self.side.writer}: {what}"))

    def run(self) -> list[_Found]:
        out: list[_Found] = []
        renamed = self.reader.root != self.writer.root
        if renamed:
            self.found(out, "", "MESSAGE_NAME_CHANGED",
                       f"the record message is {self.reader.root!r} in the reader and {self.writer.root!r} "
                       "in the writer")  # fmt: skip
        for name in self.writer.messages:
            missing = name not in self.reader.messages and name not in self.writer.map_entries
            if missing and not (renamed and name == self.writer.root):
                self.found(out, name, "MESSAGE_REMOVED", f"message {name!r} is missing from the reader")
        self.message(self.writer.messages[self.writer.root], self.reader.messages[self.reader.root], "", out)
        return out

    def _name(self, r: descriptor_pb2.FieldDescriptorProto | None, w: descriptor_pb2.FieldDescriptorProto | None) -> str:
        """The field's name in the new schema (or in whichever side has it)."""
        new, old = (r, w) if self.side.reader_is_new else (w, r)
        chosen = new if new is not None else old
        assert chosen is not None
        return chosen.name

    @staticmethod
    def _real_oneofs(message: descriptor_pb2.DescriptorProto) -> dict[str, set[int]]:
        members: dict[int, list[descriptor_pb2.FieldDescriptorProto]] = {}
        for field in message.field:
            if field.HasField("oneof_index"):
                members.setdefault(field.oneof_index, []).append(field)
        return {
            message.oneof_decl[i].name: {f.number for f in fields}
            for i, fields in members.items()
            if not (len(fields) == 1 and fields[0].proto3_optional)
        }

    def message(
        self, w: descriptor_pb2.DescriptorProto, r: descriptor_pb2.DescriptorProto, path: str, out: list[_Found]
    ) -> None:
        w_fields = {f.number: f for f in w.field}
        r_fields = {f.number: f for f in r.field}
        for number, wf in w_fields.items():
            rf = r_fields.get(number)
            if rf is not None:
                self.field(wf, rf, _join(path, self._name(rf, wf)), out)
        w_oneofs, r_oneofs = self._real_oneofs(w), self._real_oneofs(r)
        in_w_oneof = set().union(*w_oneofs.values()) if w_oneofs else set()
        for name, r_numbers in r_oneofs.items():
            if name in w_oneofs:
                for number in sorted(w_oneofs[name] - r_numbers):
                    field_name = self._name(r_fields.get(number), w_fields.get(number))
                    self.found(out, _join(path, field_name), "ONEOF_FIELD_REMOVED",
                               f"field {field_name!r} is in the writer's oneof {name!r} and not in the "
                               "reader's")  # fmt: skip
            else:
                moved = sorted(n for n in r_numbers if n in w_fields and n not in in_w_oneof)
                if len(moved) > 1:
                    names = ", ".join(self._name(r_fields[n], w_fields[n]) for n in moved)
                    self.found(out, _join(path, name), "MULTIPLE_FIELDS_MOVED_TO_ONEOF",
                               f"fields {names} moved into the new oneof {name!r}")  # fmt: skip

    def _map_entry(self, file: _ProtoFile, field: descriptor_pb2.FieldDescriptorProto) -> descriptor_pb2.DescriptorProto | None:
        if field.type != _FDP.TYPE_MESSAGE:
            return None
        name = file.relative(field.type_name)
        return file.messages.get(name) if name in file.map_entries else None

    def field(
        self, wf: descriptor_pb2.FieldDescriptorProto, rf: descriptor_pb2.FieldDescriptorProto, path: str, out: list[_Found]
    ) -> None:
        w_map, r_map = self._map_entry(self.writer, wf), self._map_entry(self.reader, rf)
        if (w_map is None) != (r_map is None):
            self.found(out, path, "FIELD_KIND_CHANGED",
                       f"{path!r} is {'a map' if r_map else _proto_type(rf)} in the reader and "
                       f"{'a map' if w_map else _proto_type(wf)} in the writer")  # fmt: skip
            return
        if w_map is not None and r_map is not None:
            w_entry = {f.number: f for f in w_map.field}
            r_entry = {f.number: f for f in r_map.field}
            if 1 in w_entry and 1 in r_entry:
                self.types(w_entry[1], r_entry[1], path, out, what="map key")
            if 2 in w_entry and 2 in r_entry:
                self.types(w_entry[2], r_entry[2], _join(path, "{}"), out, what="map value")
            return
        w_repeated = wf.label == _FDP.LABEL_REPEATED
        if w_repeated != (rf.label == _FDP.LABEL_REPEATED):
            self.found(out, path, "FIELD_LABEL_CHANGED",
                       f"{path!r} is {'repeated' if not w_repeated else 'singular'} in the reader and "
                       f"{'repeated' if w_repeated else 'singular'} in the writer")  # fmt: skip
            return
        self.types(wf, rf, _join(path, "[]") if w_repeated and wf.type == _FDP.TYPE_MESSAGE else path, out)

    def types(
        self,
        wf: descriptor_pb2.FieldDescriptorProto,
        rf: descriptor_pb2.FieldDescriptorProto,
        path: str,
        out: list[_Found],
        *,
        what: str = "field",
    ) -> None:
        w_named, r_named = wf.type in _NAMED_KINDS, rf.type in _NAMED_KINDS
        if not w_named and not r_named:
            if _SCALAR_GROUPS.get(wf.type) != _SCALAR_GROUPS.get(rf.type):
                self.found(out, path, "FIELD_SCALAR_KIND_CHANGED",
                           f"{what} {path!r} is {_proto_type(rf)} in the reader and {_proto_type(wf)} in the writer, "
                           "whose encodings differ")  # fmt: skip
            return
        if w_named != r_named or wf.type != rf.type:
            self.found(out, path, "FIELD_KIND_CHANGED",
                       f"{what} {path!r} is {_proto_type(rf)} in the reader and {_proto_type(wf)} in the writer")  # fmt: skip
            return
        w_name, r_name = self.writer.relative(wf.type_name), self.reader.relative(rf.type_name)
        if w_name != r_name:
            self.found(out, path, "FIELD_NAMED_TYPE_CHANGED",
                       f"{what} {path!r} is {_proto_type(rf)} in the reader and {_proto_type(wf)} in the writer")  # fmt: skip
            return
        if wf.type == _FDP.TYPE_MESSAGE and (w_name, r_name) not in self.seen:
            self.seen.add((w_name, r_name))
            w_message, r_message = self.writer.messages.get(w_name), self.reader.messages.get(r_name)
            if w_message is not None and r_message is not None:
                self.message(w_message, r_message, path, out)

