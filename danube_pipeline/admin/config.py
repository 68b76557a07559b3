"""The root options every ``danube-admin`` verb receives, and the connections it opens from them.

:class:`Config` holds the root options; :func:`metadata_store` and :func:`danube_client` open
etcd and the brokers for one verb, inside the one ``asyncio.run`` of :func:`run`.
:class:`AdminError` is a refusal that is not about the arguments (exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import click

from danube_pipeline.client import DanubeClient
from danube_pipeline.metadata.store import MetadataStore

T = TypeVar("T")

REQUEST_TIMEOUT_MS = 15_000
"""Deadline of each unary broker RPC the CLI makes (``DrainBroker`` has none)."""


class AdminError(click.ClickException):
    """A refusal that is not about the arguments (exit 1): e.g. a policy changed meanwhile."""

    exit_code = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """The root options, shared by every verb.

    Attributes:
        etcd_endpoints: ``host:port`` etcd endpoints.
        brokers: ``host:port`` bootstrap brokers.
        output: ``"text"`` or ``"json"``.
    """

    etcd_endpoints: list[str]
    brokers: list[str]
    output: str


@contextlib.asynccontextmanager
async def metadata_store(cfg: Config) -> AsyncIterator[MetadataStore]:
    """A connected :class:`MetadataStore`, closed on exit.

    Raises:
        MetadataStoreError: no endpoint answered.
    """
    store = await MetadataStore.connect(cfg.etcd_endpoints)
    try:
        yield store
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def danube_client(cfg: Config) -> AsyncIterator[DanubeClient]:
    """A connected :class:`DanubeClient`, closed on exit (also when connecting failed).

    Raises:
        BrokerUnavailableError: no bootstrap broker answered.
    """
    client = DanubeClient(cfg.brokers, request_timeout_ms=REQUEST_TIMEOUT_MS, metadata_retries=2)
    try:
        await client.connect()
        yield client
    finally:
        await client.close()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one verb's coroutine to its end (``asyncio.run``) and return its result."""
    return asyncio.run(coro)
