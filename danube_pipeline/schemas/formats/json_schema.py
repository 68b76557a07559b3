"""JSON Schema (draft 2020-12, or draft 7): parsing a schema text, validating and decoding payloads.

Only local ``$ref`` (``#...``) are accepted, so validating never fetches anything; the
fingerprint hashes the canonical JSON (keys sorted, no spaces, UTF-8).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from typing import Any

from danube_pipeline.errors import InvalidSchemaError
from danube_pipeline.schemas.formats.parsed_schema import (
    JSON_SCHEMA,
    Payload,
    ParsedSchema,
    check_size,
    json_depth,
    load_json,
    sha256_fingerprint,
)


def _json_pointer(path: Iterable[Any]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "(root)"


class ParsedJsonSchema(ParsedSchema):
    """A JSON Schema (draft 2020-12, or draft 7 when ``$schema`` names it)."""

    schema_type = JSON_SCHEMA

    def __init__(self, raw_schema: str, loaded: dict[str, Any], validator: Any) -> None:
        self.raw_schema = raw_schema
        self._loaded = loaded
        self._validator = validator
        canonical = json.dumps(loaded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        self.fingerprint = sha256_fingerprint(canonical.encode("utf-8"))

    @property
    def json_schema(self) -> dict[str, Any]:
        return self._loaded

    @property
    def draft(self) -> str:
        """``"2020-12"`` or ``"7"``."""
        return "7" if type(self._validator).__name__ == "Draft7Validator" else "2020-12"

    def decode(self, payload: Payload) -> Any:
        try:
            return load_json(bytes(payload).decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8: {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from exc

    def validate(self, payload: Payload) -> None:
        value = self.decode(payload)
        try:
            error = next(iter(self._validator.iter_errors(value)), None)
        except RecursionError as exc:
            raise ValueError("the schema's references recurse without end on this value") from exc
        except Exception as exc:  # noqa: BLE001 - referencing errors and the like
            raise ValueError(f"cannot be validated: {type(exc).__name__}: {exc}") from exc
        if error is not None:
            from jsonschema.exceptions import best_match

            error = best_match([error, *itertools.islice(self._validator.iter_errors(value), 20)]) or error
            raise ValueError(f"at {_json_pointer(error.absolute_path)}: {error.message}")


def _json_refs(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None:
                yield ref
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def resolve_json_pointer(root: Any, ref: str) -> Any:
    """The part of ``root`` a local reference ``#/a/b`` names (RFC 6901 escapes honoured).

    Raises:
        KeyError: the reference is not local, or names nothing.
    """
    if not ref.startswith("#"):
        raise KeyError(ref)
    node = root
    for part in (p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(ref)
    return node


def parse_json_schema(subject: str, raw_schema: str) -> ParsedJsonSchema:
    """Parse a JSON Schema text (draft 2020-12 unless ``$schema`` names draft 7).

    Raises:
        InvalidSchemaError: too large or deep, not a JSON object, another draft, not valid
            against its draft's meta-schema, or a ``$ref`` that is not local or names nothing.
    """
    from jsonschema import exceptions, validators
    from jsonschema_specifications import REGISTRY

    check_size(subject, raw_schema, json_depth(raw_schema))
    try:
        loaded = load_json(raw_schema)
    except ValueError as exc:
        raise InvalidSchemaError(subject, f"not JSON: {exc}") from exc
    if not isinstance(loaded, dict):
        raise InvalidSchemaError(subject, f"a JSON Schema must be a JSON object here, not {type(loaded).__name__}")
    dialect = loaded.get("$schema")
    if dialect is None:
        cls: Any = validators.Draft202012Validator
    else:
        cls = validators.validator_for(loaded, default=None) if isinstance(dialect, str) else None
        if cls not in (validators.Draft202012Validator, validators.Draft7Validator):
            raise InvalidSchemaError(
                subject, f"$schema {dialect!r}: only JSON Schema draft 2020-12 (the default) and draft 7 are accepted"
            )
    try:
        cls.check_schema(loaded)
    except exceptions.SchemaError as exc:
        where = _json_pointer(exc.absolute_path)
        raise InvalidSchemaError(subject, f"not a valid JSON Schema at {where}: {exc.message}") from exc
    except RecursionError as exc:
        raise InvalidSchemaError(subject, "nested too deeply") from exc
    for ref in _json_refs(loaded):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise InvalidSchemaError(subject, f"$ref {ref!r}: only local references (#...) are accepted")
        try:
            resolve_json_pointer(loaded, ref)
        except KeyError:
            raise InvalidSchemaError(subject, f"$ref {ref!r} names nothing in the schema") from None
    return ParsedJsonSchema(raw_schema, loaded, cls(loaded, registry=REGISTRY))
