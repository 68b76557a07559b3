"""The follower's side of a replicated topic: fetch the owner's WAL and append the same bytes at
the same offsets (Kafka's ``ReplicaFetcherThread``; ``docs/architecture.md`` "Replication").

One :class:`ReplicaFetcher` per topic this broker holds a replica of and does not own. Its loop:

1. **Truncate by epoch** (KIP-101, KIP-279) whenever it (re)starts or the owner changes: ask the
   owner, with ``OffsetForLeaderEpoch``, where the latest leader epoch of the local log ends in
   the owner's log; the owner answers the largest epoch it holds at or below it and where that
   epoch ends. The follower cuts its log at the lower of that end and where the same epoch ends
   locally, and asks again if the answered epoch was lower than its own. Never to its own high
   watermark: a follower's HW can lag the owner's, and cutting there could drop batches the
   owner already acknowledged (the KIP-101 lesson). A local log the owner has no epoch for
   (none at or below, or a log written before replication) is emptied and fetched again.
2. **Fetch** from its next offset (which tells the owner every offset below it is fsynced
   here), append the batches with :meth:`WriteAheadLog.append_replica` (one ``pwritev`` and one
   ``fdatasync``), and keep the owner's high watermark (a new owner starts its own there). A
   replica log rolls its segments by size and age alone: nothing reads it, and waiting for a
   watermark that only its next fetch can raise would stall it. A truncation that would cut
   into a sealed segment (a tail sealed just before its owner died) starts the log again from
   the owner's first local offset instead.
3. A follower below the owner's first local offset (new, or away while the owner's local
   retention deleted segments it never fetched) starts again at that offset: everything below
   is in object storage already (local retention deletes only verified-tiered segments). A
   replica that becomes the owner reads what lies below its own log from object storage, as
   every owner does.
4. **Local retention** follows the owner's: a sealed segment of the replica log whose offsets
   all lie below the owner's first local offset is deleted (the owner deletes a segment only
   once object storage verifiably holds it, so these offsets are there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from danube_pipeline.client.status import rpc_errors
from danube_pipeline.errors import DanubeError, LogTruncationError
from danube_pipeline.names import TopicName
from danube_pipeline.outages import OutageLog
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.config import BrokerConfig
from broker.rpc.tls import BrokerChannels
from broker.storage.wal.log import WriteAheadLog

log = logging.getLogger(__name__)

FETCH_MAX_BYTES = 1024 * 1024
"""Bytes of batches per fetch, at most (one batch more when the first is larger)."""
FETCH_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 256 * 1024 * 1024),)
"""The channels to owners take any fetch answer: a batch may be as large as the owner took."""
FETCH_MAX_WAIT_MS = 500
"""How long the owner holds a fetch that has nothing to send."""
RETRY_S = 0.2
"""The pause after a failed call (owner unreachable, not the owner yet)."""
CALL_TIMEOUT_S = 5.0
MAX_EPOCH_ROUNDS = 32
"""``OffsetForLeaderEpoch`` rounds of one truncation at most, one epoch lower each; past them
the replica log starts again from the owner's first local offset."""


class ReplicaFetcher:
    """Follows one topic's owner (module docstring).

    Args:
        name: the topic.
        config: the broker's configuration (WAL directory and segment limits).
        broker_id: this broker.
        owner_address: the address of the topic's owner now, ``None`` while it has none (or it
            is this broker).
        channels: the channels to the other brokers.
        dispose: removes the closed local log before it starts again: deleted, or kept as
            released segments when it may hold the only copy of offsets a non-ISR takeover
            left unavailable (:meth:`TopicReleaser.dispose_replica_log`).

    Attributes:
        high_watermark: the owner's HW as last fetched (never above the local log end);
            ``None`` before the first fetch. A new owner starts its HW there.
        fetches: fetches answered since the start.
    """

    def __init__(
        self,
        name: TopicName,
        config: BrokerConfig,
        *,
        broker_id: int,
        owner_address: Callable[[], Awaitable[str | None]],
        channels: BrokerChannels,
        dispose: Callable[[TopicName], Awaitable[None]],
    ) -> None:
        self.name = name
        self.config = config
        self.broker_id = broker_id
        self._owner_address = owner_address
        self._channels = channels
        self._dispose = dispose
        self.directory: Path = config.wal_dir / name.namespace / name.topic
        self.high_watermark: int | None = None
        self.fetches = 0
        self.wal: WriteAheadLog | None = None
        self._owner_epoch: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._outage = OutageLog(log, f"replicating topic {name} from its owner")

    def start(self) -> None:
        """Start following in the background."""
        self._task = asyncio.create_task(self._run(), name=f"replica:{self.name}")

    async def stop(self) -> int | None:
        """Stop following and close the WAL (everything appended is durable).

        Returns:
            The high watermark last fetched (``None`` before any fetch).
        """
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.wal is not None:
            await self.wal.close()
            self.wal = None
        return self.high_watermark

    async def _open(self, initial_offset: int = 0) -> WriteAheadLog:
        if self.wal is None:
            self.wal = await WriteAheadLog.open(
                self.directory,
                segment_max_bytes=self.config.segment_max_bytes,
                segment_max_age_s=self.config.segment_max_age_s,
                initial_offset=initial_offset,
            )
        return self.wal

    async def _restart_at(self, offset: int) -> WriteAheadLog:
        """Empty the local log and open it again at ``offset`` (module docstring, 1 and 3)."""
        if self.wal is not None:
            await self.wal.close()
            self.wal = None
        await self._dispose(self.name)
        await asyncio.to_thread(shutil.rmtree, self.directory, True)
        log.info("topic %s: replica log starts again at offset %d", self.name, offset)
        self._owner_epoch = None
        return await self._open(offset)

    async def _run(self) -> None:
        while True:
            try:
                address = await self._owner_address()
                if address is None:
                    await asyncio.sleep(RETRY_S)
                    continue
                stub = pb_grpc.ReplicationStub(await self._channels.channel(address))
                with rpc_errors(address):
                    await self._follow(stub)
            except asyncio.CancelledError:
                raise
            except DanubeError as exc:
                self._outage.failed(exc)
                await asyncio.sleep(RETRY_S)
            except Exception as exc:  # noqa: BLE001 - logged once per outage; the loop goes on
                self._outage.failed(exc)
                await asyncio.sleep(RETRY_S)

    async def _follow(self, stub: pb_grpc.ReplicationStub) -> None:
        wal = await self._open()
        if self._owner_epoch is None:
            wal = await self._truncate(stub, wal)
        while True:
            response = await stub.FetchLog(
                pb.FetchLogRequest(
                    topic=self.name.path, follower_id=self.broker_id, fetch_offset=wal.next_offset,
                    owner_epoch=self._owner_epoch or 0, max_bytes=FETCH_MAX_BYTES, max_wait_ms=FETCH_MAX_WAIT_MS,
                ),
                timeout=CALL_TIMEOUT_S + FETCH_MAX_WAIT_MS / 1000,
            )
            self._outage.succeeded()
            self.fetches += 1
            if response.stale:
                self._owner_epoch = None
                wal = await self._truncate(stub, wal)
                continue
            if wal.next_offset < response.log_start_offset:
                wal = await self._restart_at(response.log_start_offset)
                continue
            if response.batches:
                await wal.append_replica([(b.leader_epoch, b.data) for b in response.batches])
            self.high_watermark = min(response.high_watermark, wal.next_offset)
            await self._retain(wal, response.log_start_offset)

    async def _retain(self, wal: WriteAheadLog, owner_start: int) -> None:
        """Local retention of a replica log: the oldest sealed segments whose offsets all lie
        below the owner's first local offset go (module docstring, 4)."""
        for segment in wal.sealed_segments():
            if segment.end_offset >= owner_start:
                break
            freed = await wal.delete_oldest_sealed(segment.start_offset)
            log.info("topic %s: replica segment %d..%d deleted (%d bytes): below the owner's local log, so in "
                     "object storage", self.name, segment.start_offset, segment.end_offset, freed)

    async def _truncate(self, stub: pb_grpc.ReplicationStub, wal: WriteAheadLog) -> WriteAheadLog:
        """Truncate by epoch against the owner (module docstring, 1)."""
        for _ in range(MAX_EPOCH_ROUNDS):
            epoch = wal.latest_epoch
            response = await stub.OffsetForLeaderEpoch(
                pb.OffsetForLeaderEpochRequest(
                    topic=self.name.path, follower_id=self.broker_id, leader_epoch=-1 if epoch is None else epoch
                ),
                timeout=CALL_TIMEOUT_S,
            )
            self._owner_epoch = response.owner_epoch
            has_records = wal.next_offset > wal.first_offset
            if response.leader_epoch < 0 or (epoch is None and has_records):
                if has_records or wal.next_offset != response.log_start_offset:
                    wal = await self._restart_at(response.log_start_offset)
                self._owner_epoch = response.owner_epoch
                return wal
            if epoch is None:  # an empty log
                return wal
            _, local_end = wal.epochs.end_offset_for(response.leader_epoch, wal.next_offset)
            end = min(response.end_offset, local_end, wal.next_offset)
            if has_records and end <= wal.first_offset:
                wal = await self._restart_at(max(end, response.log_start_offset))
                self._owner_epoch = response.owner_epoch
                return wal
            if end < wal.next_offset or epoch != response.leader_epoch:
                if end < wal.next_offset:
                    log.warning("topic %s: replica log truncated from %d to %d (leader epoch %d ends there on the "
                                "owner)", self.name, wal.next_offset, end, response.leader_epoch)
                try:  # also drops the epochs that start at or after it, written to or not
                    await wal.truncate_to(end)
                except LogTruncationError as exc:  # a sealed segment holds offsets past it
                    log.warning("topic %s: %s; the replica log starts again", self.name, exc)
                    wal = await self._restart_at(response.log_start_offset)
                    self._owner_epoch = response.owner_epoch
                    return wal
            if wal.latest_epoch == response.leader_epoch:
                return wal
            # The owner holds an older epoch than this log's latest: ask again for the one below.
        log.warning("topic %s: no common leader epoch with the owner after %d rounds; the replica log starts again",
                    self.name, MAX_EPOCH_ROUNDS)
        wal = await self._restart_at(wal.first_offset)
        return wal
