"""What every schema format shares: the type names, the size limits, and :class:`ParsedSchema`.

Each format (:mod:`.avro`, :mod:`.json_schema`, :mod:`.protobuf`) subclasses
:class:`ParsedSchema` and checks a schema text against :data:`MAX_SCHEMA_BYTES` and
:data:`MAX_SCHEMA_DEPTH` (:func:`check_size`) before parsing it.
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import json
import re
from typing import Any, ClassVar, Final

from google.protobuf.descriptor import Descriptor

from danube_pipeline.errors import InvalidSchemaError

AVRO: Final = "Avro"
JSON_SCHEMA: Final = "JsonSchema"
PROTOBUF: Final = "Protobuf"
SCHEMA_TYPES: Final = (AVRO, JSON_SCHEMA, PROTOBUF)
"""The schema types, spelled as the key of ``schema_def`` (``docs/etcd-layout.md`` §4.3)."""

MAX_SCHEMA_BYTES: Final = 256 * 1024
"""Largest schema definition accepted, in bytes of UTF-8 (``docs/etcd-layout.md`` §4)."""
MAX_SCHEMA_DEPTH: Final = 64
"""Deepest nesting accepted: of JSON objects and arrays (Avro, JSON Schema), of ``{}`` blocks
(Protobuf)."""

Payload = bytes | bytearray | memoryview
"""A message payload as the broker or a decoder holds it."""

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_DEPTH_STEP = {"{": 1, "[": 1, "}": -1, "]": -1}


def nesting_depth(text: str, noise: re.Pattern[str], steps: dict[str, int]) -> int:
    """The deepest nesting of ``steps`` brackets in ``text`` once ``noise`` (strings,
    comments) is removed, found without recursion (malformed text gets some number, and fails
    to parse later)."""
    brackets = (steps[ch] for ch in noise.sub("", text) if ch in steps)
    return max(itertools.accumulate(brackets, initial=0))


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON ``text`` (0 for a scalar)."""
    return nesting_depth(text, _JSON_STRING, _JSON_DEPTH_STEP)


def check_size(subject: str, raw_schema: str, depth: int) -> None:
    size = len(raw_schema.encode("utf-8", errors="surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidSchemaError(subject, f"{size} bytes, more than the {MAX_SCHEMA_BYTES} allowed")
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidSchemaError(subject, f"nested {depth} levels deep, more than the {MAX_SCHEMA_DEPTH} allowed")


def sha256_fingerprint(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(text: str) -> Any:
    """``json.loads`` refusing ``NaN`` and ``Infinity`` (not JSON).

    Raises:
        ValueError: not JSON (or nested past Python's recursion limit).
    """
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise ValueError("nested too deeply") from exc


class ParsedSchema(abc.ABC):
    """A parsed, valid schema of one of :data:`SCHEMA_TYPES`; immutable and shared (cached).

    Attributes:
        schema_type: ``"Avro"``, ``"JsonSchema"`` or ``"Protobuf"``.
        raw_schema: the schema text as registered.
        fingerprint: ``"sha256:<hex>"`` (see the module docstring for what is hashed).

    The format-specific views raise ``AttributeError`` on a schema of another type:
    :attr:`avro` (Avro), :attr:`json_schema` (JSON Schema), :attr:`message_descriptor`
    (Protobuf).
    """

    schema_type: ClassVar[str]
    raw_schema: str
    fingerprint: str

    def _not(self, what: str) -> AttributeError:
        return AttributeError(f"a {self.schema_type} schema has no {what}")

    @property
    def avro(self) -> Any:
        """The Avro schema JSON as loaded (``dict`` for a record, ``str`` for a primitive,
        ``list`` for a union); Avro only."""
        raise self._not("avro")

    @property
    def json_schema(self) -> dict[str, Any]:
        """The JSON Schema object as loaded; JsonSchema only."""
        raise self._not("json_schema")

    @property
    def message_descriptor(self) -> Descriptor:
        """The record message's descriptor (the first top-level message); Protobuf only."""
        raise self._not("message_descriptor")

    @abc.abstractmethod
    def validate(self, payload: Payload) -> None:
        """Check that ``payload`` is one value of this schema.

        * Avro: decodes with the schema (``fastavro.schemaless_reader``) and no byte is left.
        * JsonSchema: UTF-8 JSON that validates against the schema.
        * Protobuf: parses as the record message and carries no unknown field (at any depth).

        Raises:
            ValueError: the payload is not a value of the schema; the message says why (and
                where, for JSON Schema and Protobuf).
        """

    @abc.abstractmethod
    def decode(self, payload: Payload) -> Any:
        """Decode one payload (which :meth:`validate` accepts).

        Returns:
            * Avro: fastavro's value: a ``dict`` for a record.
            * JsonSchema: the JSON value: a ``dict`` for an object.
            * Protobuf: a ``dict`` keyed by field name (see :meth:`ParsedProtobuf.decode`).

        Raises:
            ValueError: the payload does not decode.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fingerprint})"
