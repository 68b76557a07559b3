"""JSON Schema compatibility: can one JSON Schema read what another allowed?

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
"""

from __future__ import annotations

import json
from typing import Any

from danube_pipeline.schemas.compatibility.findings import Found, Side, join_path
from danube_pipeline.schemas.formats.json_schema import resolve_json_pointer


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


class JsonSchemaCheck:
    """Whether a JSON Schema reader accepts every value a writer schema allows, with the
    rules of this module.

    Args:
        side: how the reader and the writer are named in messages.
        reader_root: the reader's JSON Schema object (its local ``$ref`` resolve in it).
        writer_root: the writer's JSON Schema object.
    """

    def __init__(self, side: Side, reader_root: dict[str, Any], writer_root: dict[str, Any]) -> None:
        self.side = side
        self.reader_root = reader_root
        self.writer_root = writer_root
        self.seen: set[tuple[int, int]] = set()

    def run(self) -> list[Found]:
        """Every incompatibility of the reader with the writer."""
        out: list[Found] = []
        self.compare(self.writer_root, self.reader_root, "", out)
        return out

    def fits(self, writer: Any, reader: Any, path: str) -> bool:
        trial: list[Found] = []
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

    def found(self, out: list[Found], path: str, rule: str, what: str) -> None:
        out.append(Found(path, rule, f"{self.side.reader} cannot read {self.side.writer}: {what}"))

    def compare(self, writer: Any, reader: Any, path: str, out: list[Found]) -> None:
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

    def _sum(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[Found]) -> None:
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

    def _compare_types(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[Found]) -> bool:
        w_types, r_types = self._types(writer), self._types(reader)
        lost = sorted(t for t in w_types if not self._accepts(r_types, t))
        if not lost:
            return True
        narrowed = all(self._accepts(w_types, t) for t in r_types)
        self.found(out, path, "TYPE_NARROWED" if narrowed else "TYPE_CHANGED",
                   f"{path or 'the value'} may be {', '.join(lost)}, which the reader's type "
                   f"{sorted(r_types)} does not accept")  # fmt: skip
        return False

    def _compare_values(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[Found]) -> None:
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

    def _compare_bounds(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[Found]) -> None:
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

    def _compare_items(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[Found]) -> None:
        w_items, r_items = writer.get("items", True), reader.get("items", True)
        tuples = "prefixItems" in writer or "prefixItems" in reader or isinstance(w_items, list) or isinstance(r_items, list)
        if tuples:
            for k in ("prefixItems", "items"):
                if _canonical(writer.get(k)) != _canonical(reader.get(k)):
                    self.found(out, path, "ITEMS_CHANGED", f"the tuple {k!r} of {path or 'the value'} differs")
            return
        self.compare(w_items, r_items, join_path(path, "[]"), out)

    @staticmethod
    def _model(node: dict[str, Any]) -> tuple[str, Any]:
        """("open", None), ("closed", None) or ("partial", schema) (Confluent's content models)."""
        extra = node.get("additionalProperties", True)
        if extra is False:
            return "closed", None
        if extra is True or (isinstance(extra, dict) and not extra):
            return "open", None
        return "partial", extra

    def _compare_object(self, writer: dict[str, Any], reader: dict[str, Any], path: str, out: list[Found]) -> None:
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
            prop = join_path(path, name)
            if r_model == "closed" and self._resolve(w_schema, self.writer_root) is not False:
                self.found(out, prop, "PROPERTY_REMOVED_FROM_CLOSED_CONTENT_MODEL",
                           f"property {prop!r} may be present, and the reader allows no other property")  # fmt: skip
            elif r_model == "partial" and not self.fits(w_schema, r_extra, prop):
                self.found(out, prop, "PROPERTY_REMOVED_NOT_COVERED_BY_PARTIALLY_OPEN_CONTENT_MODEL",
                           f"property {prop!r} may be present, and the reader's additionalProperties "
                           "does not accept it")  # fmt: skip
        for name, r_schema in r_props.items():
            prop = join_path(path, name)
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
        where = join_path(path, "{}")
        if w_model == "closed" or r_model == "open":
            return
        if r_model == "closed":
            self.found(out, where, "ADDITIONAL_PROPERTIES_REMOVED",
                       f"additionalProperties is false at {path or 'the top level'}, and the writer allows "
                       "other properties")  # fmt: skip
        elif w_model == "open" or not self.fits(w_extra, r_extra, where):
            self.found(out, where, "ADDITIONAL_PROPERTIES_NARROWED",
                       f"additionalProperties at {path or 'the top level'} is narrower than the writer's")  # fmt: skip
