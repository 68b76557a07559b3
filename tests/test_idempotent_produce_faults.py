"""Idempotent produce under faults (issue 21 #1 and #2), against real processes and a real
full disk (a tmpfs mounted by the test; skipped where mounting is not allowed).

* #1: batches of one producer that fail together (one group commit on a full disk) are
  accepted when resent, in order; none is refused as a duplicate, and every acked message is
  stored once. Shown on the WAL and sequence state directly (a tmpfs filled to the last page)
  and end to end (a broker whose WAL is on a small tmpfs, an idempotent producer with 8
  batches in flight, the disk filled and freed).
* #2: a ``SendStream`` cancelled while its batch is being written does not make the broker
  forget the batch: the resend on a new stream is answered with the first write's offsets
  and not written a second time. The write is held back for real: etcd is paused (SIGSTOP)
  while the owner must extend its offset reservation (``--offset-block 4``).
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from helpers import eventually
from test_broker import Stubs, create_producer, next_offset

from broker.storage.wal.log import WriteAheadLog
from broker.topics.producer_sequences import ProducerSequences
from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer
from danube_pipeline.errors import DuplicateSequenceError, StorageFullError
from danube_pipeline.format.batches import BatchBuilder, parse_header
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


def _mount_tmpfs(mount: Path, size: str) -> None:
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs."""
    mount = tmp_path / "tiny"
    _mount_tmpfs(mount, "1m")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs."""
    mount = tmp_path / "small"
    _mount_tmpfs(mount, "8m")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(path: Path) -> None:
    """Write ``path`` until its file system has no page left."""
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * 4096
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass


def _batch(name: str, base_sequence: int, count: int, size_bytes: int = 4000) -> bytes:
    builder = BatchBuilder(time.time_ns() // 1000)
    for i in range(count):
        payload = (base_sequence + i).to_bytes(8, "big") + b"x" * size_bytes
        builder.append(payload, timestamp_us=builder.first_timestamp_us)
    return builder.build(producer_id=1, producer_name=name, base_sequence=base_sequence)


def _publish(wal: WriteAheadLog, sequences: ProducerSequences, batch: bytes) -> asyncio.Future[tuple[int, int]]:
    """What ``Topic.publish`` does with a checked batch: the sequence check, then the WAL."""
    header = parse_header(batch)
    written = sequences.check(header)
    if written is not None:
        return written
    offset = wal.next_offset
    fut = wal.enqueue(batch, header.record_count)
    sequences.record(header, fut, offset)
    return fut


# ---------------------------------------------------------------------------- #1, WAL level


def test_batches_failing_in_one_group_commit_are_accepted_when_resent(tiny_disk: Path) -> None:
    """Batches N and N+1 of one producer fail in the same group commit (ENOSPC on a real full
    tmpfs): both resends are new batches to the sequence state, and are written once each."""

    async def go() -> None:
        wal = await WriteAheadLog.open(tiny_disk / "wal", segment_max_bytes=1024 * 1024)
        sequences = ProducerSequences("/default/t")
        try:
            first = _batch("p", 0, 2)
            first_fut = wal.enqueue(first, 2)
            sequences.record(parse_header(first), first_fut, 0)
            assert await first_fut == (0, 1)
            _fill(tiny_disk / "filler")

            def publish(batch: bytes) -> asyncio.Future[tuple[int, int]]:
                return _publish(wal, sequences, batch)

            n, n1 = _batch("p", 2, 3), _batch("p", 5, 3)
            futures = [publish(n), publish(n1)]  # one group commit: both are queued before it runs
            results = await asyncio.gather(*futures, return_exceptions=True)
            assert all(isinstance(r, StorageFullError) for r in results), results

            (tiny_disk / "filler").unlink()
            resent = [publish(n), publish(n1)]  # refused as duplicates before the fix
            assert await asyncio.gather(*resent) == [(2, 4), (5, 7)]
            assert await publish(n1) == (5, 7)  # a resend of a written batch: its offsets
            assert [b.base_offset for b in wal.read(0, 100)] == [0, 2, 5]
        finally:
            await wal.close()

    asyncio.run(go())


def test_a_failed_batch_resent_while_a_later_one_is_being_written_is_accepted(tiny_disk: Path) -> None:
    """Batches N and N+1 fail together (real ENOSPC); a later batch N+2 of the same producer
    (sent on another stream before it learnt of the failure) is queued after it; the resends of
    N and N+1 arrive while N+2 is still being written: they are accepted, not refused as
    duplicates (written after N+2; nothing is lost or written twice)."""

    async def go() -> None:
        wal = await WriteAheadLog.open(tiny_disk / "wal", segment_max_bytes=1024 * 1024)
        sequences = ProducerSequences("/default/t")
        try:
            assert await _publish(wal, sequences, _batch("p", 0, 2)) == (0, 1)
            _fill(tiny_disk / "filler")
            n, n1, n2 = _batch("p", 2, 3), _batch("p", 5, 3), _batch("p", 8, 3)
            failed = [_publish(wal, sequences, n), _publish(wal, sequences, n1)]
            assert all(isinstance(r, StorageFullError) for r in await asyncio.gather(*failed, return_exceptions=True))
            (tiny_disk / "filler").unlink()
            later = _publish(wal, sequences, n2)  # queued after the failure, not written yet
            resent = [_publish(wal, sequences, n), _publish(wal, sequences, n1)]
            with pytest.raises(DuplicateSequenceError):
                _publish(wal, sequences, _batch("p", 9, 3))  # overlaps N+2 in part, being written
            assert await asyncio.gather(later, *resent) == [(2, 4), (5, 7), (8, 10)]
            assert await _publish(wal, sequences, n) == (5, 7)
            with pytest.raises(DuplicateSequenceError):
                _publish(wal, sequences, _batch("p", 3, 3))  # an old resend, not as written
        finally:
            await wal.close()

    asyncio.run(go())


# ---------------------------------------------------------------------------- #1, end to end


def test_a_full_disk_under_pipelined_produce_loses_and_duplicates_nothing(
    small_disk: Path, start_broker: Callable[..., BrokerProcess]
) -> None:
    """An idempotent producer keeps 8 batches in flight while the WAL's disk fills up, stays
    full for a second (resends keep failing, many batches at once), and is freed: every
    message is acked, none is refused as a duplicate, and each is stored exactly once."""
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (6 * 1024 * 1024))  # leaves about 2 MiB for the WAL
    broker = start_broker(
        data_dir=small_disk / "broker", segment_max_bytes=1024 * 1024, log_path=small_disk.parent / "broker.log"
    )
    topic = "/default/full_pipelined"

    def disk_full_logged() -> bool:
        return "appends refused until space is freed" in broker.log_path.read_text(errors="replace")

    async def produce() -> tuple[int, list[int | BaseException]]:
        async with DanubeClient([broker.address], metadata_retries=10_000, retry_backoff_ms=20) as client:
            producer = await client.producer(
                topic, producer_name="p", max_batch_messages=16, max_in_flight_batches=8, linger_ms=5
            ).open()
            futures: list[asyncio.Future[int]] = []
            full_since: float | None = None
            checked = 0.0
            deadline = time.monotonic() + 20
            i = 0
            # Send until the disk has been full for one second (resends fail meanwhile).
            while True:
                now = time.monotonic()
                assert now < deadline, "the disk never filled up"
                if full_since is None and now > checked + 0.02:
                    checked = now
                    if disk_full_logged():
                        full_since = now
                if full_since is not None and now > full_since + 1.0:
                    break
                if sum(not f.done() for f in futures[-512:]) >= 400:
                    await asyncio.sleep(0.005)
                    continue
                futures.append(producer.send_nowait(i.to_bytes(8, "big") + b"x" * 8000))
                i += 1
                if i % 16 == 0:
                    await asyncio.sleep(0)
            filler.unlink()
            results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 30)
            await producer.close()
            return i, list(results)

    sent, results = asyncio.run(produce())
    duplicates = [r for r in results if isinstance(r, DuplicateSequenceError)]
    assert not duplicates, f"{len(duplicates)} of {sent} messages refused as duplicates: {duplicates[0]}"
    together = [int(n) for n in re.findall(r"the write of (\d+) batches", broker.log_path.read_text(errors="replace"))]
    assert max(together, default=0) >= 2, f"no write failed with two batches of the producer or more: {together}"
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {sent} messages failed: {failed[0]!r}"
    acked = [r for r in results if isinstance(r, int)]
    assert len(set(acked)) == sent

    stubs = Stubs(broker.address)
    try:
        stored = next_offset(stubs, topic)
    finally:
        stubs.close()

    async def read_all() -> collections.Counter[int]:
        async with DanubeClient([broker.address]) as client:
            consumer = await client.consumer(
                topic, subscription="check", initial_position=InitialPosition.EARLIEST
            ).open()
            seen: collections.Counter[int] = collections.Counter()
            for _ in range(stored):
                message = await consumer.receive(timeout_ms=10_000)
                seen[int.from_bytes(message.payload[:8], "big")] += 1
                await consumer.ack(message)
            await consumer.close()
            return seen

    seen = asyncio.run(read_all())
    assert stored == sent, f"{stored} messages stored for {sent} sent"
    assert seen == collections.Counter(range(sent))


# ---------------------------------------------------------------------------- #2, SendStream cancelled


def test_a_cancelled_send_stream_does_not_make_the_resend_a_second_write(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    """A batch is sent on a ``SendStream`` while its write waits for an offset reservation
    (etcd paused), and the client cancels the stream. The broker writes the batch once etcd
    answers; its resend on a new stream gets the same offsets and is not written again."""
    broker = BrokerProcess(
        etcd_endpoints=own_etcd.endpoints, data_dir=tmp_path / "b", extra_args=["--offset-block", "4"]
    )
    broker.start()
    topic = "/default/cancelled_stream"
    stubs = Stubs(broker.address)
    try:
        pid = create_producer(stubs, topic, name="p")
        records = 8  # more than the reserved block of 4: the write must extend the reservation
        builder = BatchBuilder(time.time_ns() // 1000)
        for i in range(records):
            builder.append(i.to_bytes(8, "big"), timestamp_us=builder.first_timestamp_us)
        request = pb.SendBatchRequest(
            producer_id=pid,
            batch=builder.build(producer_id=pid, producer_name="p", base_sequence=1_000),
            sequence_id=1,
        )

        async def cancel_then_resend() -> pb.SendBatchResponse:
            async with grpc.aio.insecure_channel(broker.address) as channel:
                stub = pb_grpc.ProducerServiceStub(channel)
                os.kill(own_etcd.pid, signal.SIGSTOP)
                try:
                    call = stub.SendStream()
                    await call.write(request)
                    # Enqueued (offsets handed out), not written: the reservation waits for etcd.
                    await eventually(lambda: next_offset(stubs, topic) == records, timeout_s=5, what="enqueued")
                    call.cancel()
                    # The cancellation reaches the broker while the write still waits for etcd
                    # (the request timeout is 10 s): hold etcd for half a second more.
                    await asyncio.sleep(0.5)
                finally:
                    os.kill(own_etcd.pid, signal.SIGCONT)
                again = stub.SendStream()
                await again.write(request)
                response: pb.SendBatchResponse = await asyncio.wait_for(again.read(), 15)
                await again.done_writing()
                return response

        response = asyncio.run(cancel_then_resend())
        assert not response.HasField("error"), response.error
        assert (response.first_offset, response.last_offset) == (0, records - 1), "the resend was written again"
        assert next_offset(stubs, topic) == records, "the resend was written a second time"
    finally:
        stubs.close()
        broker.stop()
