"""The base of every JSON value of :mod:`danube_pipeline.metadata.values` (``docs/etcd-layout.md``):
:class:`JsonRecord` and the compact JSON encoding of :func:`encode` and :func:`decode`. Imported
from :mod:`danube_pipeline.metadata.values`, which re-exports them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, Self, TypeVar

JsonValue = None | bool | int | float | str | list[Any] | dict[str, Any]

T = TypeVar("T", bound="JsonRecord")


def encode(value: JsonValue | JsonRecord) -> bytes:
    """Compact JSON bytes for an etcd value (``null`` for ``None``)."""
    if isinstance(value, JsonRecord):
        value = value.to_json()
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def decode(raw: bytes | str) -> JsonValue:
    """Parse an etcd value written by :func:`encode` (or by Danube itself).

    Raises:
        ValueError: if ``raw`` is not JSON.
    """
    value: JsonValue = json.loads(raw)
    return value


class JsonRecord:
    """Base of the structured values: ``to_json`` keeps the dataclass field order."""

    _nested: ClassVar[dict[str, type[JsonRecord]]] = {}
    # Every subclass is a dataclass: declared (not set) here so that dataclasses.fields() takes it.
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, JsonRecord):
                v = v.to_json()
            elif isinstance(v, list):
                v = [x.to_json() if isinstance(x, JsonRecord) else x for x in v]
            out[f.name] = v
        return out

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Build from a decoded JSON object.

        Raises:
            ValueError: if ``data`` is not an object or lacks a required field.
        """
        return cls._from_fields(data)

    @classmethod
    def _from_fields(cls, data: Any) -> Self:
        """:meth:`from_json` without a subclass's own checks, for the subclasses to call (the
        dataclasses are made with ``slots=True``, which makes new classes, so a zero-argument
        ``super()`` does not work in them)."""
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                raise ValueError(f"{cls.__name__}: missing field {f.name!r}")
            v = data[f.name]
            nested = cls._nested.get(f.name)
            if nested is not None and v is not None:
                v = [nested.from_json(x) for x in v] if isinstance(v, list) else nested.from_json(v)
            kwargs[f.name] = v
        return cls(**kwargs)

    @classmethod
    def decode(cls, raw: bytes | str) -> Self:
        """:func:`decode` then :meth:`from_json`."""
        return cls.from_json(decode(raw))
