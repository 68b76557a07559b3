"""The root :class:`DanubeError` and the bound on strings that travel in errors.

Part of :mod:`danube_pipeline.errors`, which re-exports every name."""

from __future__ import annotations

from typing import ClassVar

import grpc


class DanubeError(Exception):
    """Root of every Danube Pipeline error."""

    # Class-level flags; an error of no known class that came over the wire sets them on the
    # instance from its status code (error_codec.RemoteError.from_status).
    retriable: bool = False
    invalid_metadata: bool = False
    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL


MAX_WIRE_STRING_CHARS = 256
"""A string field longer than this travels as its first characters plus a note of its length,
so an error quoting bad input (a 10 KB name) stays small on the wire and in logs."""


def bounded(value: str, limit: int = MAX_WIRE_STRING_CHARS) -> str:
    """``value`` if short, else its first ``limit`` characters and ``…(N chars)``."""
    return value if len(value) <= limit else f"{value[:limit]}…({len(value)} chars)"
