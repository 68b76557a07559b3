"""etcd wire helpers shared by the metadata modules, and the values they return.

:class:`KeyValue` and :class:`WatchEvent` are what :class:`~danube_pipeline.metadata.store.MetadataStore`
reads and watches return. The functions build ``aetcd`` (etcd v3 API) requests and turn every
failure to reach etcd into :class:`~danube_pipeline.errors.MetadataStoreError`; they are used by
:mod:`.store`, :mod:`.cache` and :mod:`.lease` only.

Values are JSON (:mod:`danube_pipeline.metadata.values`). An empty etcd value reads as ``None``
(``null``); a value that is not JSON (written by some other tool) reads as its text and is
logged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
from collections.abc import Iterator
from typing import Any

import aetcd
import grpc
from aetcd import rpc

from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.metadata import values
from danube_pipeline.metadata.values import JsonRecord, JsonValue

log = logging.getLogger(__name__)

ALL_KEYS = b"\0"
"""``key = range_end = b"\\0"`` selects the whole key space in etcd range requests."""


@dataclasses.dataclass(frozen=True, slots=True)
class KeyValue:
    """One etcd key with its decoded JSON value.

    Attributes:
        key: the etcd key, e.g. ``/cluster/register/625722408599041316``.
        value: the decoded JSON value (``None`` for a ``null`` marker).
        create_revision: etcd revision that created the key.
        mod_revision: etcd revision of the last change to the key.
        version: number of writes since the key was created (1 after the first put).
    """

    key: str
    value: JsonValue
    create_revision: int
    mod_revision: int
    version: int


class WatchEventType(enum.Enum):
    """Kind of change a :class:`WatchEvent` reports."""

    PUT = "put"
    DELETE = "delete"


@dataclasses.dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change seen by a watch.

    Attributes:
        type: :attr:`WatchEventType.PUT` or :attr:`WatchEventType.DELETE`.
        key: the changed key.
        value: the new decoded value; ``None`` for a DELETE.
        mod_revision: the etcd revision of the change.
    """

    type: WatchEventType
    key: str
    value: JsonValue | None
    mod_revision: int


@contextlib.contextmanager
def wrap_errors(operation: str) -> Iterator[None]:
    """Turn aetcd / gRPC / socket failures into :class:`MetadataStoreError`."""
    try:
        yield
    except MetadataStoreError:
        raise
    except (aetcd.ClientError, grpc.RpcError, OSError, TimeoutError) as exc:
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, grpc.aio.AioRpcError):
            reason = f"{exc.code().name}: {exc.details()}"
        raise MetadataStoreError(operation, reason) from exc


def decode_value(key: str, raw: bytes) -> JsonValue:
    if not raw:
        return None
    try:
        return values.decode(raw)
    except ValueError:
        log.warning("etcd key %s holds a value that is not JSON; reading it as text", key)
        return raw.decode("utf-8", errors="replace")


def key_value(kv: Any) -> KeyValue:
    key = bytes(kv.key).decode()
    return KeyValue(
        key=key,
        value=decode_value(key, bytes(kv.value)),
        create_revision=int(kv.create_revision),
        mod_revision=int(kv.mod_revision),
        version=int(kv.version),
    )


def prefix_range_end(prefix: bytes) -> bytes:
    """etcd ``range_end`` selecting every key that starts with ``prefix``."""
    if not prefix:
        return ALL_KEYS
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return ALL_KEYS


def compare_mod(key: str, mod_revision: int) -> Any:
    return rpc.Compare(
        key=key.encode(),
        target=rpc.Compare.MOD,
        result=rpc.Compare.EQUAL,
        mod_revision=mod_revision,
    )


def compare_absent(key: str) -> Any:
    return rpc.Compare(
        key=key.encode(),
        target=rpc.Compare.CREATE,
        result=rpc.Compare.EQUAL,
        create_revision=0,
    )


def compare_create(key: str, create_revision: int) -> Any:
    """The key's ``create_revision`` equals ``create_revision`` (0: the key does not exist).
    A key deleted and created again has a new create revision: this tells incarnations apart."""
    return rpc.Compare(
        key=key.encode(),
        target=rpc.Compare.CREATE,
        result=rpc.Compare.EQUAL,
        create_revision=create_revision,
    )


def compare_exists(key: str) -> Any:
    """The key exists (its ``create_revision`` is above 0)."""
    return rpc.Compare(
        key=key.encode(),
        target=rpc.Compare.CREATE,
        result=rpc.Compare.GREATER,
        create_revision=0,
    )


def range_op(key: str) -> Any:
    """A transaction operation reading one key."""
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key.encode()))


def delete_op(key: str) -> Any:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key.encode()))


def put_op(key: str, value: JsonValue | JsonRecord, lease_id: int = 0) -> Any:
    return rpc.RequestOp(
        request_put=rpc.PutRequest(key=key.encode(), value=values.encode(value), lease=lease_id)
    )


def split_endpoint(endpoint: str) -> tuple[str, int]:
    address = endpoint.split("://", 1)[-1].rstrip("/")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise MetadataStoreError("connect", f"endpoint {endpoint!r} is not 'host:port'")
    return host.strip("[]"), int(port)


def watch_event(event: Any) -> WatchEvent:
    key = bytes(event.kv.key).decode()
    if event.kind == aetcd.EventKind.DELETE:
        return WatchEvent(WatchEventType.DELETE, key, None, int(event.kv.mod_revision))
    return WatchEvent(
        WatchEventType.PUT,
        key,
        decode_value(key, bytes(event.kv.value)),
        int(event.kv.mod_revision),
    )
