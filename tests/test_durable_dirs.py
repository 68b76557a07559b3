"""Durability of the broker's id file and of the WAL's directories (issue 21 #17, #18).

A power cut cannot be produced here, so these tests use a FAKE: :class:`SyncRecorder` wraps
``os.mkdir``, ``os.replace`` and ``os.fsync`` and records, in order, each directory created,
each rename, and the path of each fd synced (``/proc/self/fd/{fd}``). A directory entry (a new
directory, a renamed file or directory) survives a power cut only once its parent directory was
synced after it was made, so that is what the tests assert.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, cast

import pytest

from danube_pipeline.errors import BrokerIdUnreadableError
from danube_pipeline.names import TopicName

from broker.config import BrokerConfig
from broker.rpc.server import BrokerServer, load_or_create_broker_id
from broker.storage.wal.recovery import LogLoader
from broker.storage.wal.segment import make_dirs_durable
from broker.topics.released import ReleasedSegments

pytestmark = pytest.mark.unit


class SyncRecorder:
    """FAKE power-cut observer: records ``("mkdir", path)``, ``("replace", src, dst)`` and
    ``("fsync", path, is_dir)`` events in order (the real calls still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[Any, ...]] = []
        real_mkdir, real_replace, real_fsync = os.mkdir, os.replace, os.fsync

        def mkdir(path: Any, mode: int = 0o777, *args: Any, **kwargs: Any) -> None:
            real_mkdir(path, mode, *args, **kwargs)
            self.events.append(("mkdir", os.path.abspath(path)))

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            real_replace(src, dst, *args, **kwargs)
            self.events.append(("replace", os.path.abspath(src), os.path.abspath(dst)))

        def fsync(fd: Any) -> None:
            real_fsync(fd)
            n = fd if isinstance(fd, int) else fd.fileno()
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{n}"), stat.S_ISDIR(os.fstat(n).st_mode)))

        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "fsync", fsync)

    def created(self) -> list[str]:
        return [e[1] for e in self.events if e[0] == "mkdir"]

    def dir_synced_after(self, index: int, directory: str) -> bool:
        """Whether ``directory`` was fsynced after event ``index``."""
        return any(e[0] == "fsync" and e[2] and e[1] == directory for e in self.events[index + 1:])

    def assert_entries_durable(self) -> None:
        """Every directory created and every rename is followed by an fsync of the parent
        directory (both parents for a rename)."""
        for i, event in enumerate(self.events):
            if event[0] == "mkdir":
                parents = [os.path.dirname(event[1])]
            elif event[0] == "replace":
                parents = [os.path.dirname(event[1]), os.path.dirname(event[2])]
            else:
                continue
            for parent in parents:
                assert self.dir_synced_after(i, parent), f"{event}: parent {parent} never synced after it"


def released_segments(data_dir: Path) -> ReleasedSegments:
    """A ReleasedSegments whose move() is all that is used (no cache or object store)."""
    none = cast(Any, None)
    return ReleasedSegments(
        BrokerConfig(data_dir=data_dir), cache=none, objects=none, object_cache=none, local_retention=none
    )


def test_wal_load_makes_every_new_directory_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    rec = SyncRecorder(monkeypatch)
    LogLoader(data_dir / "wal" / "ns" / "t1", index_interval_bytes=4096).load(0)
    wal = str(data_dir / "wal")
    assert rec.created() == [wal, f"{wal}/ns", f"{wal}/ns/t1"]
    rec.assert_entries_durable()

    # A second topic of the same namespace creates (and syncs the parent of) its own directory only.
    rec.events.clear()
    LogLoader(data_dir / "wal" / "ns" / "t2", index_interval_bytes=4096).load(0)
    assert rec.created() == [f"{wal}/ns/t2"]
    rec.assert_entries_durable()
    assert not any(e[0] == "fsync" and e[1] == str(data_dir) for e in rec.events)  # existed already


def test_release_move_makes_the_rename_and_new_directories_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "data"
    LogLoader(data_dir / "wal" / "ns" / "t", index_interval_bytes=4096).load(0)
    released = released_segments(data_dir)
    rec = SyncRecorder(monkeypatch)
    target = released.move(TopicName.parse("/ns/t"))
    assert target is not None and target.is_dir() and not (data_dir / "wal" / "ns" / "t").exists()
    base = str(data_dir / "released")
    assert rec.created() == [base, f"{base}/ns", f"{base}/ns/t"]
    assert [e[0] for e in rec.events].count("replace") == 1
    rec.assert_entries_durable()

    # A second release of the same topic: only the rename's two parents need a sync.
    LogLoader(data_dir / "wal" / "ns" / "t", index_interval_bytes=4096).load(0)
    rec.events.clear()
    monkeypatch.setattr("time.time_ns", lambda: (int(target.name) + 1) * 1_000_000)
    assert released.move(TopicName.parse("/ns/t")) is not None
    assert rec.created() == []
    rec.assert_entries_durable()


def test_release_move_survives_retain_removing_its_empty_target_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``move`` runs in a worker thread while ``retain`` may remove the topic's (empty)
    released directory between its creation and the rename, as it did once under load. FAKE
    interleaving: the race is too narrow to hit on purpose, so the first creation of the
    directory is followed by retain's ``rmdir``; the move must still land, durably."""
    data_dir = tmp_path / "data"
    LogLoader(data_dir / "wal" / "ns" / "t", index_interval_bytes=4096).load(0)
    released = released_segments(data_dir)
    removed: list[Path] = []

    def make_then_lose(path: Path) -> None:
        make_dirs_durable(path)
        if not removed:  # retain, on the event loop, finds it empty and removes it
            path.rmdir()
            removed.append(path)

    monkeypatch.setattr("broker.topics.released.make_dirs_durable", make_then_lose)
    target = released.move(TopicName.parse("/ns/t"))
    assert removed == [data_dir / "released" / "ns" / "t"]
    assert target is not None and target.is_dir() and not (data_dir / "wal" / "ns" / "t").exists()


def test_fresh_data_dir_gets_a_durable_id_that_survives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = tmp_path / "a" / "data"
    rec = SyncRecorder(monkeypatch)
    first = BrokerServer(BrokerConfig(data_dir=data_dir)).broker_id
    path = str(data_dir / "broker_id")
    replaces = [i for i, e in enumerate(rec.events) if e[0] == "replace"]
    assert len(replaces) == 1 and rec.events[replaces[0]][2] == path
    tmp = rec.events[replaces[0]][1]
    assert ("fsync", tmp, False) in rec.events[: replaces[0]], "the id was renamed into place before it was synced"
    rec.assert_entries_durable()  # the data directory (and its new parent) and the rename
    assert (data_dir / "broker_id").read_text() == f"{first}\n"
    assert not os.path.exists(tmp)

    rec.events.clear()
    assert BrokerServer(BrokerConfig(data_dir=data_dir)).broker_id == first  # the next start
    assert load_or_create_broker_id(data_dir) == first
    assert not any(e[0] in ("replace", "mkdir") for e in rec.events)


@pytest.mark.parametrize(
    "content",
    [b"", b"\n", b"not a number\n", b"12ab\n", b"-5\n", b"0\n", str(2**64).encode(), b"\xff\xfe\x00"],
    ids=["empty", "newline", "words", "junk", "negative", "zero", "over-u64", "binary"],
)
def test_an_unreadable_id_file_stops_the_broker(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "broker_id").write_bytes(content)
    with pytest.raises(BrokerIdUnreadableError) as info:
        load_or_create_broker_id(tmp_path)
    assert info.value.path == str(tmp_path / "broker_id") and str(tmp_path / "broker_id") in str(info.value)
    assert not info.value.retriable
    assert (tmp_path / "broker_id").read_bytes() == content  # never replaced by a new id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broker_id"]


def test_an_id_file_that_cannot_be_read_stops_the_broker(tmp_path: Path) -> None:
    (tmp_path / "broker_id").mkdir()  # reading it fails with EISDIR
    with pytest.raises(BrokerIdUnreadableError, match="broker_id"):
        load_or_create_broker_id(tmp_path)
    assert (tmp_path / "broker_id").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["broker_id"]


def test_a_valid_id_file_is_read_as_written(tmp_path: Path) -> None:
    (tmp_path / "broker_id").write_text(f"{2**64 - 1}\n")
    assert load_or_create_broker_id(tmp_path) == 2**64 - 1
    (tmp_path / "broker_id").write_text(" 42 ")
    assert load_or_create_broker_id(tmp_path) == 42
