"""Parsing of the arguments several ``danube-admin`` verbs share: topic and namespace names
(the "Name grammar" of ``docs/etcd-layout.md``) and broker addresses; a malformed one is a
``click.BadParameter`` (exit 2)."""

from __future__ import annotations

import click

from danube_pipeline.errors import InvalidNameError
from danube_pipeline.names import TopicName, validate_part


def parse_topic(ctx: click.Context, param: click.Parameter, value: str) -> TopicName:
    """A click callback: ``value`` as a :class:`TopicName` (``/namespace/topic``).

    Raises:
        click.BadParameter: the name is malformed.
    """
    try:
        return TopicName.parse(value)
    except InvalidNameError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def parse_namespace(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback: ``value`` as a valid namespace name (``None`` stays ``None``).

    Raises:
        click.BadParameter: the name is malformed.
    """
    if value is None:
        return None
    try:
        return validate_part("namespace", value)
    except InvalidNameError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def is_address(value: str) -> bool:
    """Whether ``value`` is ``host:port`` (no scheme, no spaces, port 1-65535)."""
    host, sep, port = value.rpartition(":")
    return (
        bool(sep and host and port.isdigit())
        and 0 < int(port) < 65536
        and not any(c.isspace() or c == "/" for c in host)
    )
