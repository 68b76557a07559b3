"""The object store's identity: the brokers and the assets must use one and the same store.

A broker reads the segment objects the assets tiered (a subscription below its WAL, a topic
loaded with an empty WAL), and local retention deletes WAL segments whose objects the
descriptors in etcd vouch for. Pointed at another store, a broker would find none of them,
and the assets would tier into a store no broker reads. Each therefore checks, when it starts,
that its store is the cluster's:

* the store holds a marker object, ``_danube/store-id`` (:data:`MARKER_PATH`), whose content
  is the store's id (32 hex digits);
* etcd holds the cluster's store id at ``/danube-data/storage/store_id`` (:data:`STORE_ID_KEY`,
  ``docs/etcd-layout.md`` §5.7): ``{"store_id": ..., "marked": bool, "created_by": ...,
  "object_store": ...}``.

:func:`check_store_identity` passes when the marker equals the recorded id, and raises
:class:`~danube_pipeline.errors.ObjectStoreMismatchError` (naming the store, the id found and
the id expected) when it does not.

**Creation.** The first process to find no key creates it in one create-if-absent
transaction, so the first writer wins and every other process adopts its id:

* a store that already has a marker (etcd was replaced under it) gives its id, already marked;
* otherwise a new random id, with ``marked: false``; the process then writes the marker into
  its store and sets ``marked: true`` (compare-and-put on the key's revision).

A process that finds ``marked: false`` and a store without marker finishes that work (the
creator died before marking, or runs beside it): all write the same id, so concurrent starts
agree. Once ``marked`` is true, a store without the marker is refused: that is another (empty)
store. The one window is a cluster's very first start, while ``marked`` is false: a process
pointed at another empty store then marks that store too. Stores are compared by the id in
their marker only, never by URL, so the same store reached under two URLs (a MinIO endpoint and
its alias) passes.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from danube_pipeline.errors import ObjectStoreMismatchError
from danube_pipeline.metadata import keys

if TYPE_CHECKING:
    from danube_pipeline.metadata.store import MetadataStore
    from danube_pipeline.storage.objectstore import ObjectStore

__all__ = ["MARKER_PATH", "STORE_ID_KEY", "check_store_identity", "read_marker"]

log = logging.getLogger(__name__)

MARKER_PATH = "_danube/store-id"
"""The identity marker object, relative to the store's root."""

STORE_ID_KEY = f"{keys.DANUBE_DATA}/storage/store_id"
"""The etcd key holding the cluster's store id (``docs/etcd-layout.md`` §5.7)."""


def read_marker(objects: ObjectStore) -> str | None:
    """The id in the store's marker, ``None`` when the store has none.

    Raises:
        OSError: the store cannot be read.
    """
    try:
        return objects.get_bytes(MARKER_PATH).decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None


def _record(value: object) -> tuple[str, bool]:
    if isinstance(value, dict) and isinstance(value.get("store_id"), str):
        return value["store_id"], bool(value.get("marked", True))
    raise ValueError(f"{STORE_ID_KEY} holds {value!r}, not a store id record")


async def check_store_identity(store: MetadataStore, objects: ObjectStore, *, who: str) -> str:
    """Check that ``objects`` is the cluster's object store, creating the identity when the
    cluster has none yet (module docstring).

    Args:
        store: the connected metadata store.
        objects: this process's object store.
        who: the process, for the error and the log (``broker 7``, ``assets``).

    Returns:
        The store id.

    Raises:
        ObjectStoreMismatchError: the store's marker is missing or holds another id.
        MetadataStoreError: etcd failed.
        OSError: the store cannot be read or written.
        ValueError: the etcd key holds no store id record (written by hand).
    """
    current = await store.get(STORE_ID_KEY)
    if current is None:
        marker = read_marker(objects)
        created = {
            "store_id": marker or uuid.uuid4().hex,
            "marked": marker is not None,
            "created_by": who,
            "object_store": objects.root_url,
        }
        if await store.put_if_absent(STORE_ID_KEY, created):
            log.info("%s: object store %s has cluster store id %s", who, objects.root_url, created["store_id"])
        current = await store.get(STORE_ID_KEY)
        assert current is not None, "a store id key is never deleted"
    expected, marked = _record(current.value)
    found = read_marker(objects)
    if found is None and not marked:
        objects.put_bytes(MARKER_PATH, expected.encode())
        found = expected
        done = {**(current.value if isinstance(current.value, dict) else {}), "marked": True}
        # a lost race means another process set it first: the same value
        await store.compare_and_put(STORE_ID_KEY, done, expected_mod_revision=current.mod_revision)
    if found != expected:
        raise ObjectStoreMismatchError(who, objects.root_url, found, expected)
    return expected
