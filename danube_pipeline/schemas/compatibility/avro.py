"""Avro compatibility: can one Avro schema read what another wrote?

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
"""

from __future__ import annotations

from typing import Any

from danube_pipeline.schemas.compatibility.findings import Found, Side, join_path


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


class AvroCheck:
    """Whether an Avro reader schema reads what a writer schema wrote (Avro spec, "Schema
    Resolution"), with the rules of this module.

    Args:
        side: how the reader and the writer are named in messages.
    """

    def __init__(self, side: Side) -> None:
        self.side = side
        self.seen: set[tuple[int, int]] = set()

    def run(self, reader: Any, writer: Any) -> list[Found]:
        """Every incompatibility of ``reader`` with ``writer`` (Avro schema JSON as loaded)."""
        out: list[Found] = []
        self.resolve(_AvroTree().expand(reader, None), _AvroTree().expand(writer, None), "", out)
        return out

    def _names_match(self, r: dict[str, Any], w: dict[str, Any]) -> bool:
        if _short(r["name"]) == _short(w["name"]):
            return True
        return any(a == w["name"] or _short(a) == _short(w["name"]) for a in r["aliases"])

    def resolve(self, r: dict[str, Any], w: dict[str, Any], path: str, out: list[Found]) -> None:
        side = self.side
        rt, wt = r["type"], w["type"]
        if wt == "union":
            for branch in w["branches"]:
                self.resolve(r, branch, path, out)
            return
        if rt == "union":
            for branch in r["branches"]:
                trial: list[Found] = []
                self.resolve(branch, w, path, trial)
                if not trial:
                    return
            out.append(Found(path, "MISSING_UNION_BRANCH",
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
            self.resolve(r["items"], w["items"], join_path(path, "[]"), out)
        elif rt == "map":
            self.resolve(r["values"], w["values"], join_path(path, "{}"), out)
        elif rt in ("record", "enum", "fixed"):
            if not self._names_match(r, w):
                out.append(Found(path, "NAME_CHANGED",
                                  f"{side.reader} names the {rt} {r['name']!r} where {side.writer} has "
                                  f"{w['name']!r} (and no alias of the reader's names it)"))  # fmt: skip
                return
            if rt == "record":
                self._record(r, w, path, out)
            elif rt == "enum":
                self._enum(r, w, path, out)
            else:
                if r["size"] != w["size"]:
                    out.append(Found(path, "FIXED_SIZE_CHANGED",
                                      f"{side.reader} has fixed {r['name']} of {r['size']} bytes where "
                                      f"{side.writer} has {w['size']}"))  # fmt: skip
                else:
                    self._decimal(r, w, path, out)
        elif rt == "unknown":
            out.append(self._type_changed(r, w, path))

    def _type_changed(self, r: dict[str, Any], w: dict[str, Any], path: str) -> Found:
        return Found(path, "TYPE_CHANGED",
                      f"{self.side.reader} has {_avro_describe(r)} where {self.side.writer} has {_avro_describe(w)}, "
                      "which Avro does not promote")  # fmt: skip

    def _decimal(self, r: dict[str, Any], w: dict[str, Any], path: str, out: list[Found]) -> None:
        if r.get("logicalType") != "decimal" or w.get("logicalType") != "decimal":
            return
        if r.get("scale", 0) != w.get("scale", 0):
            out.append(Found(path, "DECIMAL_SCALE_CHANGED",
                              f"{self.side.reader} has {_avro_describe(r)} where {self.side.writer} has "
                              f"{_avro_describe(w)}: the scales differ"))  # fmt: skip
        elif isinstance(r.get("precision"), int) and isinstance(w.get("precision"), int) and r["precision"] < w["precision"]:
            out.append(Found(path, "DECIMAL_PRECISION_NARROWED",
                              f"{self.side.reader} has {_avro_describe(r)} where {self.side.writer} has "
                              f"{_avro_describe(w)}: values may not fit"))  # fmt: skip

    def _record(self, r: dict[str, Any], w: dict[str, Any], path: str, out: list[Found]) -> None:
        key = (id(r), id(w))
        if key in self.seen:
            return
        self.seen.add(key)
        writer_fields = {f["name"]: f for f in w["fields"]}
        for field in r["fields"]:
            found = writer_fields.get(field["name"])
            if found is None:
                found = next((writer_fields[a] for a in field["aliases"] if a in writer_fields), None)
            field_path = join_path(path, str(field["name"]))
            if found is not None:
                self.resolve(field["type"], found["type"], field_path, out)
            elif not field["has_default"]:
                if self.side.reader_is_new:
                    out.append(Found(field_path, "FIELD_ADDED_WITHOUT_DEFAULT",
                                      f"field {field_path!r} is new and has no default, so {self.side.reader} "
                                      f"cannot fill it in {self.side.writer}"))  # fmt: skip
                else:
                    out.append(Found(field_path, "FIELD_REMOVED_WITHOUT_DEFAULT",
                                      f"field {field_path!r} is removed, and {self.side.reader} has no default "
                                      f"for it in {self.side.writer}"))  # fmt: skip

    def _enum(self, r: dict[str, Any], w: dict[str, Any], path: str, out: list[Found]) -> None:
        if r["has_default"]:
            return
        missing = [s for s in w["symbols"] if s not in r["symbols"]]
        if missing:
            rule = "ENUM_SYMBOL_REMOVED" if self.side.reader_is_new else "ENUM_SYMBOL_ADDED"
            out.append(Found(path, rule,
                              f"{self.side.reader} lacks enum symbol(s) {', '.join(map(str, missing))} of "
                              f"{self.side.writer}, and its enum {r['name']} has no default"))  # fmt: skip
