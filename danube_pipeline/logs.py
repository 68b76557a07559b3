"""Log output of every long-running process: the broker, the continuous writer, ``danube-pipeline dev``.

Two formats, chosen with ``--log-format``:

* ``text`` (the default): ``2026-11-26 16:33:30,123 INFO broker: message``, one line per record;
* ``json``: one JSON object per line with ``ts`` (ISO 8601, UTC, milliseconds), ``level``,
  ``logger`` and ``message``, plus ``broker``, ``topic`` and ``subscription`` where they apply,
  and ``exc`` (the traceback) when the record carries an exception. A log collector reads it
  without parsing the message.

The three context fields come, first to last, from the record's ``extra``
(``log.info("...", extra={"topic": "/default/t"})``), from the context variables a task set with
:func:`bind` (``with logs.bind(topic=..., subscription=...):``; asyncio tasks inherit them from
the task that created them), and from the process-wide values of :func:`set_process_fields` (a
broker sets its ``broker`` id once at start). In the JSON format a field without a value is
left out, except ``broker`` in a process that declared it (``null`` until the id is known).

Standard library only: part of the base install.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Final, Literal, TextIO

__all__ = [
    "CONTEXT_FIELDS",
    "LOG_FORMATS",
    "TEXT_FORMAT",
    "ContextFilter",
    "JsonFormatter",
    "LogFormat",
    "bind",
    "configure",
    "set_process_fields",
]

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final = ("text", "json")
"""The values of ``--log-format``."""
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The ``text`` format's line (the format of every process before ``--log-format`` existed)."""
CONTEXT_FIELDS: Final = ("broker", "topic", "subscription")
"""The fields a JSON line takes from the record's ``extra``, the context or the process."""

_context: dict[str, contextvars.ContextVar[str | None]] = {
    name: contextvars.ContextVar(f"danube_log_{name}", default=None) for name in CONTEXT_FIELDS
}
_process_fields: dict[str, str | None] = {}


def set_process_fields(**fields: str | int | None) -> None:
    """Set fields every record of this process carries (``set_process_fields(broker=broker_id)``).

    A field set here, even to ``None``, is written on every JSON line (as ``null`` while it is
    ``None``), so a reader can rely on its key.

    Args:
        **fields: names from :data:`CONTEXT_FIELDS` and their values (ints are written as text,
            so a 64-bit broker id survives JSON readers that parse numbers as doubles).

    Raises:
        ValueError: a name is not one of :data:`CONTEXT_FIELDS`.
    """
    for name, value in fields.items():
        if name not in CONTEXT_FIELDS:
            raise ValueError(f"unknown log field {name!r}; expected one of {', '.join(CONTEXT_FIELDS)}")
        _process_fields[name] = None if value is None else str(value)


@contextmanager
def bind(**fields: str | None) -> Iterator[None]:
    """Set context fields for the records logged inside the block (and by the asyncio tasks
    created inside it).

    Args:
        **fields: ``topic`` and/or ``subscription`` (or ``broker``), e.g. ``topic="/default/t"``.

    Raises:
        ValueError: a name is not one of :data:`CONTEXT_FIELDS`.
    """
    tokens: list[tuple[contextvars.ContextVar[str | None], contextvars.Token[str | None]]] = []
    for name, value in fields.items():
        var = _context.get(name)
        if var is None:
            raise ValueError(f"unknown log field {name!r}; expected one of {', '.join(CONTEXT_FIELDS)}")
        tokens.append((var, var.set(value)))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class ContextFilter(logging.Filter):
    """Puts the context fields on every record that lacks them (from :func:`bind`, then from
    :func:`set_process_fields`); it never drops a record. Installed on the handlers by
    :func:`configure`."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name in CONTEXT_FIELDS:
            if getattr(record, name, None) is None:
                value = _context[name].get()
                if value is None:
                    value = _process_fields.get(name)
                setattr(record, name, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record (module docstring): ``ts``, ``level``, ``logger``,
    ``message``, the context fields that have a value (``broker`` always when the process set
    it), and ``exc`` with the formatted exception."""

    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds")
        out: dict[str, object] = {
            "ts": ts.replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = str(value)
            elif name in _process_fields:
                out[name] = None
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(
    level: str | int = "INFO",
    fmt: str = "text",
    *,
    stream: TextIO | None = None,
    process_fields: Mapping[str, str | int | None] | None = None,
) -> logging.Handler | None:
    """Configure the root logger: one handler on ``stream`` (default stderr) in ``fmt``.

    As ``logging.basicConfig``, it adds no handler when the root logger has one already (a
    test runner's, or an embedding application's): then it only sets the level.

    Args:
        level: a level name (``"INFO"``, case-insensitive) or number; an unknown name means INFO.
        fmt: ``"text"`` or ``"json"`` (:data:`LOG_FORMATS`).
        stream: where the lines go; default ``sys.stderr``.
        process_fields: fields for :func:`set_process_fields` (e.g. ``{"broker": None}`` in a
            broker before its id is known).

    Returns:
        The handler installed, ``None`` when the root logger had handlers.

    Raises:
        ValueError: ``fmt`` is not a known format, or a process field's name is unknown.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; expected one of {', '.join(LOG_FORMATS)}")
    if process_fields:
        set_process_fields(**process_fields)
    resolved = level if isinstance(level, int) else logging.getLevelName(level.upper())
    root = logging.getLogger()
    root.setLevel(resolved if isinstance(resolved, int) else logging.INFO)
    if root.handlers:
        return None
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(ContextFilter())
    root.addHandler(handler)
    return handler
