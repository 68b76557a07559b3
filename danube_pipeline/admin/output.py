"""How ``danube-admin`` prints: one JSON document (``--output json``) or aligned text for people.

Every verb builds one :data:`Json` document and hands it to :func:`emit` with the function that
renders it as text; the helpers here format tables, label/value lines, owners and cells.
"""

from __future__ import annotations

import getpass
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import click

from danube_pipeline.admin.config import Config
from danube_pipeline.client import BrokerAddress, SubscriptionType

Json = dict[str, Any]
"""A JSON document a verb prints."""


def emit(cfg: Config, document: Json, text: Callable[[Json], str]) -> None:
    """Print ``document`` as one JSON document, or ``text(document)`` for people."""
    if cfg.output == "json":
        click.echo(json.dumps(document, indent=2))
    else:
        click.echo(text(document))


def cell(value: object) -> str:
    """One table or field cell: ``-`` for ``None``, ``yes``/``no`` for booleans, else ``str``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An aligned table: numbers right-aligned, ``None`` as ``-``; ``(none)`` when empty."""
    cells = [[cell(v) for v in row] for row in rows]
    numeric = [
        bool(rows) and all(isinstance(r[i], int) and not isinstance(r[i], bool) or r[i] is None for r in rows)
        for i in range(len(headers))
    ]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    out = [line(headers)]
    out += [line(r) for r in cells] if cells else ["(none)"]
    return "\n".join(out)


def field_lines(pairs: Sequence[tuple[str, object]]) -> str:
    """``label  value`` lines, the labels padded to one width."""
    width = max(len(label) for label, _ in pairs)
    return "\n".join(f"{label.ljust(width)}  {cell(value)}" for label, value in pairs)


def owner_json(address: BrokerAddress) -> Json:
    """The ``owner`` object of a document: ``{"broker_id": int, "address": "host:port"}``."""
    return {"broker_id": address.broker_id, "address": address.address}


def owner_text(owner: Json | None) -> str:
    """An ``owner`` object as ``ID (host:port)``, or ``-`` when there is none."""
    return "-" if owner is None else f"{owner['broker_id']} ({owner['address']})"


def subscription_type_name(number: object) -> str | None:
    """``Exclusive``, ``Shared`` or ``Failover`` for a stored type number (§3.4), else ``None``."""
    value = as_int(number)
    if value is None or value not in SubscriptionType._value2member_map_:
        return None
    return SubscriptionType(value).name.capitalize()


def as_int(value: object) -> int | None:
    """``value`` when it is an ``int`` (not a ``bool``), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def audit(change: str, resource: str, result: str, **fields: object) -> None:
    """Print one structured audit line for a change ``danube-admin`` makes straight in etcd
    (the brokers audit the changes that go through them, on their ``danube.audit`` logger), on
    stderr: ``{"audit": "danube-admin", "principal", "change", "resource", "result", ...}``.
    The principal is the etcd user (``DANUBE_ETCD_USER``) or, without one, the OS user."""
    principal = os.environ.get("DANUBE_ETCD_USER") or getpass.getuser()
    line = {"audit": "danube-admin", "principal": principal, "change": change, "resource": resource, "result": result}
    click.echo(json.dumps({**line, **fields}), err=True)
