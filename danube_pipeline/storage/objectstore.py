"""Object storage for sealed segments, one fsspec URL for every backend.

``file://`` is the embedded default (``settings.object_store_url()``); ``s3://bucket/prefix``
reaches S3 or an S3-compatible store (MinIO, moto) through ``s3fs`` with ``storage_options``
such as ``{"endpoint_url": …, "key": …, "secret": …}``.

Segment objects keep the bytes of the sealed WAL segment unchanged (``docs/etcd-layout.md``
§5.1) and live at ``topics/{namespace}/{topic}/data-{start}-{end}.dnb1`` under the store's root.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from danube_pipeline.names import TopicName

__all__ = ["ObjectInfo", "ObjectStore", "segment_object_path"]


def segment_object_path(topic: TopicName, object_id: str) -> str:
    """Where a segment object lives in the store, relative to its root.

    Args:
        topic: the object's topic.
        object_id: the object's file name, ``data-{start}-{end}.dnb1``.

    Returns:
        ``topics/{namespace}/{topic}/{object_id}``.
    """
    return f"topics/{topic.namespace}/{topic.topic}/{object_id}"


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What the store knows about one object.

    Attributes:
        path: the object's path relative to the store's root.
        size_bytes: the object's length in bytes.
        etag: MD5 hex of the content (what S3 reports for a single-part PUT), or ``None``
            when the backend does not report one and it was not computed.
    """

    path: str
    size_bytes: int
    etag: str | None


class ObjectStore:
    """A root URL plus relative object paths, backed by an fsspec filesystem.

    Args:
        root_url: ``file:///abs/dir``, a plain local path, or ``s3://bucket/prefix``.
        storage_options: passed to the fsspec filesystem (S3 endpoint, credentials, …).
    """

    def __init__(self, root_url: str, *, storage_options: Mapping[str, Any] | None = None) -> None:
        self.root_url = root_url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        fs, root = fsspec.core.url_to_fs(self.root_url, **self.storage_options)
        self._fs: fsspec.AbstractFileSystem = fs
        self._root = root.rstrip("/")
        self._local = isinstance(fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"ObjectStore({self.root_url!r})"

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The underlying fsspec filesystem."""
        return self._fs

    def _full(self, path: str) -> str:
        path = path.lstrip("/")
        if not path or any(part in ("", ".", "..") for part in path.split("/")):
            raise ValueError(f"invalid object path {path!r}")
        return f"{self._root}/{path}"

    def url(self, path: str) -> str:
        """The object's full URL.

        Args:
            path: relative object path, e.g. ``topics/default/flights/data-0-99.dnb1``.

        Returns:
            ``{root_url}/{path}``, e.g. ``file:///…/topics/default/flights/data-0-99.dnb1``.

        Raises:
            ValueError: ``path`` is empty or has ``.``, ``..`` or empty parts.
        """
        self._full(path)
        return f"{self.root_url}/{path.lstrip('/')}"

    def put_bytes(self, path: str, data: bytes) -> ObjectInfo:
        """Write ``data`` at ``path``, replacing any previous object.

        Local filesystems get an atomic write (temporary file in the same directory, ``fsync``,
        then ``rename``), so a reader never sees a partial object. Object stores are atomic per
        PUT already.

        Args:
            path: relative object path.
            data: the object's content.

        Returns:
            The written object's :class:`ObjectInfo` (``size_bytes = len(data)``, etag = MD5
            hex of ``data``).

        Raises:
            ValueError: ``path`` is empty or has ``.``, ``..`` or empty parts.
            OSError: the backend refused the write (e.g. ``NotADirectoryError`` when the
                root lies under a regular file).
        """
        full = self._full(path)
        etag = hashlib.md5(data).hexdigest()
        if self._local:
            directory = os.path.dirname(full)
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(full)}.", suffix=".tmp", dir=directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, full)
            except BaseException:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        else:
            parent = full.rsplit("/", 1)[0]
            try:
                self._fs.makedirs(parent, exist_ok=True)
            except Exception:  # noqa: BLE001 - object stores have no real directories
                pass
            self._fs.pipe_file(full, data)
            self._fs.invalidate_cache(full)
        return ObjectInfo(path=path.lstrip("/"), size_bytes=len(data), etag=etag)

    def get_bytes(self, path: str) -> bytes:
        """The object's content.

        Args:
            path: relative object path.

        Returns:
            The whole object, ``size_bytes`` bytes.

        Raises:
            ValueError: ``path`` is empty or has ``.``, ``..`` or empty parts.
            FileNotFoundError: no object at ``path``.
        """
        data = self._fs.cat_file(self._full(path))
        return bytes(data)

    def get_range(self, path: str, start: int, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object (to its end when ``end`` is ``None``), in one
        ranged read (an HTTP ``Range`` GET on S3).

        Args:
            path: relative object path.
            start: first byte, 0-based.
            end: one past the last byte, or ``None`` for the rest of the object.

        Returns:
            The bytes; shorter than asked when the object is shorter.

        Raises:
            ValueError: ``path`` is empty or has ``.``, ``..`` or empty parts, or ``start`` is
                negative.
            FileNotFoundError: no object at ``path``.
        """
        if start < 0:
            raise ValueError(f"negative start {start}")
        data = self._fs.cat_file(self._full(path), start=start, end=end)
        return bytes(data)

    def info(self, path: str, *, compute_etag: bool = False) -> ObjectInfo | None:
        """Size and etag of the object at ``path``, or ``None`` if there is none.

        Args:
            path: relative object path.
            compute_etag: when the backend reports no etag (local files), read the object and
                compute its MD5.

        Returns:
            The object's :class:`ObjectInfo`, or ``None`` when nothing (or a directory) is
            at ``path``.

        Raises:
            ValueError: ``path`` is empty or has ``.``, ``..`` or empty parts.
        """
        full = self._full(path)
        try:
            self._fs.invalidate_cache(full)
            raw = self._fs.info(full)
        except FileNotFoundError:
            return None
        if raw.get("type") == "directory":
            return None
        etag = raw.get("ETag") or raw.get("etag")
        if isinstance(etag, str):
            etag = etag.strip('"')
            if "-" in etag:  # multipart etag is not an MD5 of the content
                etag = None
        if etag is None and compute_etag:
            etag = hashlib.md5(self.get_bytes(path)).hexdigest()
        return ObjectInfo(path=path.lstrip("/"), size_bytes=int(raw["size"]), etag=etag)

    def exists(self, path: str) -> bool:
        """Whether an object exists at ``path``.

        Args:
            path: relative object path.

        Returns:
            ``True`` if :meth:`info` finds an object there.
        """
        return self.info(path) is not None

    def delete(self, path: str) -> None:
        """Remove the object at ``path`` (no error if absent).

        Args:
            path: relative object path.

        Raises:
            ValueError: ``path`` is empty or has ``.``, ``..`` or empty parts.
        """
        full = self._full(path)
        try:
            self._fs.rm_file(full)
        except FileNotFoundError:
            pass

    def list(self, prefix: str = "") -> list[str]:
        """Every object under ``prefix``.

        Args:
            prefix: relative folder, e.g. ``topics/default/flights``; ``""`` for the whole store.

        Returns:
            Relative object paths, sorted; temporary files (names starting with ``.``) are left
            out.
        """
        base = f"{self._root}/{prefix.strip('/')}" if prefix.strip("/") else self._root
        try:
            found = self._fs.find(base)
        except FileNotFoundError:
            return []
        out = []
        for full in found:
            rel = full[len(self._root) :].lstrip("/") if full.startswith(self._root) else full
            if not os.path.basename(rel).startswith("."):
                out.append(rel)
        return sorted(out)

