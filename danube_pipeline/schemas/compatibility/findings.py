"""What a compatibility check of one format reports, and how the two schemas are named in it.

Each format's check (:mod:`.avro`, :mod:`.json_schema`, :mod:`.protobuf`) returns
:class:`Found` items; :func:`~danube_pipeline.schemas.compatibility.check_compatibility` adds
the version each conflicts with.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    """One incompatibility a check found, before the version it conflicts with is known.

    Attributes:
        path: the field, dotted, as in
            :class:`~danube_pipeline.schemas.compatibility.Incompatibility`.
        rule: the rule broken, e.g. ``"TYPE_CHANGED"``.
        message: what is wrong, naming both schemas (:class:`Side`).
    """

    path: str
    rule: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class Side:
    """How the reader and writer of one check are named in messages."""

    reader: str
    writer: str
    reader_is_new: bool


def join_path(path: str, name: str) -> str:
    """``path`` and a field ``name``, dotted; ``[]`` (an array item) and ``{}`` (a map value)
    are appended without a dot."""
    return name if not path else f"{path}{name}" if name in ("[]", "{}") else f"{path}.{name}"
