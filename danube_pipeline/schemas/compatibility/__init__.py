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

The rules of each format, in the words of its specification, are listed in
:mod:`~danube_pipeline.schemas.compatibility.avro`,
:mod:`~danube_pipeline.schemas.compatibility.json_schema` and
:mod:`~danube_pipeline.schemas.compatibility.protobuf`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.schemas.compatibility.avro import AvroCheck
from danube_pipeline.schemas.compatibility.findings import Found, Side
from danube_pipeline.schemas.compatibility.json_schema import JsonSchemaCheck
from danube_pipeline.schemas.compatibility.protobuf import ProtobufCheck
from danube_pipeline.schemas.formats import AVRO, JSON_SCHEMA, PROTOBUF, ParsedProtobuf, ParsedSchema

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
        rule: a short rule name, e.g. ``"TYPE_CHANGED"`` (see the format's module: :mod:`.avro`,
            :mod:`.json_schema`, :mod:`.protobuf`).
        message: what is wrong, naming both schemas.
        version: the earlier version it conflicts with.
    """

    path: str
    rule: str
    message: str
    version: int


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
            side = Side("the new schema", f"data written with version {number}", True)
            out.extend(Incompatibility(f.path, f.rule, f.message, number) for f in _can_read(new, old, side))
        if mode.startswith(("Forward", "Full")):
            side = Side(f"version {number}", "data written with the new schema", False)
            out.extend(Incompatibility(f.path, f.rule, f.message, number) for f in _can_read(old, new, side))
    return out


def _can_read(reader: ParsedSchema, writer: ParsedSchema, side: Side) -> list[Found]:
    if reader.schema_type == AVRO:
        return AvroCheck(side).run(reader.avro, writer.avro)
    if reader.schema_type == JSON_SCHEMA:
        return JsonSchemaCheck(side, reader.json_schema, writer.json_schema).run()
    if reader.schema_type == PROTOBUF:
        assert isinstance(reader, ParsedProtobuf) and isinstance(writer, ParsedProtobuf)
        return ProtobufCheck(side, reader.file_descriptor_proto, writer.file_descriptor_proto).run()
    raise ValueError(f"unknown schema type {reader.schema_type!r}")

