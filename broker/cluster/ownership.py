"""Topic ownership with an epoch, and offset blocks reserved before they are acknowledged
(``docs/etcd-layout.md`` §1.4, §5.4, §5.5).

A broker owns a topic while its assignment key ``/cluster/brokers/{id}/{ns}/{topic}`` exists;
the key's create revision is the *owner epoch*. A key deleted and created again (the topic
failed over, or moved away and back) has a new create revision, so every write guarded by the
epoch this broker read when it loaded the topic fails once ownership changed hands: the broker
is *fenced*.

Offsets are fenced the same way. Before the WAL writes (and so before it acknowledges) an
offset above the reserved block, :meth:`Ownership.reserve_through` extends the block in
``.../reservation`` (§5.4) with a transaction guarded by the owner epoch. A broker cut off from
etcd, or one whose topic was given to another broker, can therefore acknowledge offsets only
up to the end of the block it reserved while it was the owner; the next owner starts past that
end (:func:`plan_takeover`). The part of the failed owner's block that was not in object
storage when the topic was taken over becomes an *unavailable range* (§5.5): the failed owner
holds those offsets on its disk. When that broker comes back, it finds the topic gone, keeps
its WAL as released segments (served for tiering) and records the last offset it wrote
(:func:`record_last_written`); offsets above it were never handed out.

Inside its block an owner also fences itself on its registration lease (§1.2, §1.4). The
leader fails a broker over only once its registration is gone, that is once its lease expired
in etcd; an owner cut off from etcd cannot learn that. So every append asks
:meth:`Ownership.covers` (and :meth:`Ownership.reserve_through` when it says no), which needs:

* the ownership not fenced;
* the broker's lease *fresh*: its last successful renewal was *sent* less than
  ``TTL - margin`` ago on the monotonic clock, ``margin = max(1 s, TTL / 3)`` (at most TTL / 2;
  :func:`danube_pipeline.metadata.lease.safety_margin_s`). etcd expires the lease no sooner
  than TTL after it processed that renewal, so the failover transaction comes after every
  acknowledgement allowed before the lease went stale; the margin covers the write and
  ``fdatasync`` between the check and the acknowledgement, and clock-rate differences;
* ownership confirmed under that same lease: a guarded write of the reservation (an
  extension, or a rewrite of the block as it is) succeeded after the broker registered under
  it. A lease that expired is replaced by a new one (re-registration); the topic may have been
  failed over in between, so the first append under the new lease writes the reservation
  again, guarded by the owner epoch, before anything is acknowledged.

Otherwise the append fails, unwritten, with the retriable
:class:`~danube_pipeline.errors.NotServedHereError` (the client looks the topic up again and
retries), and the owner resumes once a renewal succeeds and the confirming write shows it
still owns the topic.

Every write of the reservation is guarded by the owner epoch and by the reservation's mod
revision as this owner last wrote or read it (the takeover reads it, §5.4): a reservation that
someone else rewrote is never overwritten. A rewrite that left exactly this owner's block (its
own write retried) is adopted; anything else fences the owner.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from danube_pipeline.errors import MetadataStoreError, NotServedHereError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.etcd import KeyValue
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

from broker.cluster.takeover_reads import TakeoverReads
from broker.config import DEFAULT_OFFSET_BLOCK

log = logging.getLogger(__name__)

_TAKEOVER_ATTEMPTS = 5


def _parse(kv: KeyValue | None, cls: type[values.JsonRecord]) -> values.JsonRecord | None:
    if kv is None:
        return None
    try:
        return cls.from_json(kv.value)
    except (ValueError, TypeError):
        log.warning("ignoring malformed %s at %s", cls.__name__, kv.key)
        return None


def wal_has_records(directory: Path) -> bool:
    """Whether a WAL directory holds a segment file: the WAL knows where it stands (even when
    local retention left only an empty active segment, whose name is its start offset)."""
    if not directory.is_dir():
        return False
    return any(f.suffix in (".log", ".dnb1") for f in directory.iterdir())


@dataclasses.dataclass(frozen=True, slots=True)
class TakeoverPlan:
    """What :func:`plan_takeover` found.

    Attributes:
        epoch: this broker's owner epoch (§1.4).
        floor: the first offset an empty WAL starts at.
        continuing: the reservation is this broker's own and its WAL holds its records (a
            restart): the WAL goes on inside the same block.
        reservation: the reservation read, ``None`` when the topic never had one.
        reservation_revision: its ``mod_revision`` (0: absent), guarding the takeover write.
        unavailable: the range the failed owner may hold, or ``None``: the part of its block
            no recorded range covers (§5.5), starting past any range that covers its head.
        more_unavailable: further pieces of that range, split around recorded ranges inside
            it; written with ``unavailable``, and only when it is set.
        in_sync: this broker takes the topic over as a member of the previous owner's ISR
            (§5.9): its own log holds every acknowledged offset, so it goes on from its own log
            end and records no unavailable range.
    """

    epoch: int
    floor: int
    continuing: bool
    reservation: values.OffsetReservation | None
    reservation_revision: int
    unavailable: values.UnavailableRange | None
    more_unavailable: tuple[values.UnavailableRange, ...] = ()
    in_sync: bool = False


async def plan_takeover(
    store: MetadataStore, name: TopicName, broker_id: int, *, wal_holds_data: bool, tiered_end: int | None,
    in_sync: bool = False, reads: TakeoverReads | None = None,
) -> TakeoverPlan:
    """Decide where this broker's ownership of ``name`` starts, from etcd (linearizable reads).

    * No reservation yet: above the sealed state (§5.3) and the tiered offsets (§5.1).
    * The reservation is this broker's and its WAL holds records: go on in the same block.
    * The previous owner released the topic (the sealed state's ``last_committed_offset`` is at
      or above its reservation's end): right after it.
    * Otherwise the previous owner failed: past the end of its block, and the offsets of its
      block not in object storage form an unavailable range (§5.5); unless this broker was in
      its ISR (``in_sync``, §5.9) and its WAL holds records: then it goes on from its own log,
      which holds every offset the failed owner acknowledged (offsets above it were never
      acknowledged nor read).

    Args:
        store: etcd.
        name: the topic.
        broker_id: this broker.
        wal_holds_data: whether the local WAL directory holds records (:func:`wal_has_records`).
        tiered_end: the last offset in object storage (the last completed descriptor's end).
        in_sync: this broker is a member of the previous owner's ISR (§5.9).
        reads: the keys as the caller read them (one :meth:`TakeoverReads.read`); read here
            when ``None``.

    Raises:
        NotServedHereError: the topic is not assigned to this broker.
        MetadataStoreError: etcd unreachable.
    """
    if reads is None:
        reads = await TakeoverReads.read(store, name, broker_id)
    assignment = reads.assignment
    if assignment is None:
        raise NotServedHereError(name.path, broker_id)
    res_kv = reads.reservation
    res = _parse(res_kv, values.OffsetReservation)
    assert res is None or isinstance(res, values.OffsetReservation)
    sealed = _parse(reads.sealed, values.SealedState)
    assert sealed is None or isinstance(sealed, values.SealedState)
    base = 0
    if sealed is not None:
        base = sealed.last_committed_offset + 1
    if tiered_end is not None:
        base = max(base, tiered_end + 1)
    pieces: list[values.UnavailableRange] = []
    continuing = res is not None and res.broker_id == broker_id and wal_holds_data and res.last_written is None
    in_sync = in_sync and wal_holds_data and not continuing
    floor = base
    if res is not None and not continuing and not in_sync:
        released = sealed is not None and sealed.last_committed_offset >= res.end_offset
        if not released and res.end_offset >= base:
            floor = res.end_offset + 1
            start = max(res.first_offset, base)
            last = res.last_written
            if start <= res.end_offset and (last is None or last >= start):
                recorded = await recorded_ranges(store, name)
                since = int(time.time())
                pieces = [
                    values.UnavailableRange(
                        start_offset=first, end_offset=end, broker_id=res.broker_id, since=since, last_written=last,
                    )
                    for first, end in uncovered_pieces(start, res.end_offset, recorded)
                ]
    return TakeoverPlan(
        epoch=assignment.create_revision,
        floor=floor,
        continuing=continuing,
        reservation=res,
        reservation_revision=res_kv.mod_revision if res_kv is not None else 0,
        unavailable=pieces[0] if pieces else None,
        more_unavailable=tuple(pieces[1:]),
        in_sync=in_sync,
    )


async def recorded_ranges(store: MetadataStore, name: TopicName) -> list[values.UnavailableRange]:
    """The unavailable ranges of ``name`` in etcd (linearizable read, §5.5), ascending.

    Raises:
        MetadataStoreError: etcd unreachable.
    """
    kvs, _ = await store.get_prefix(keys.unavailable_prefix(name))
    return unavailable_ranges({kv.key: kv.value for kv in kvs})


def uncovered_pieces(start: int, end: int, recorded: list[values.UnavailableRange]) -> list[tuple[int, int]]:
    """The parts of ``start..end`` (inclusive) that no recorded range covers, ascending (§5.5).

    A range is keyed by its start offset and never overwritten, so a new range must neither
    start inside a recorded one nor claim its offsets: it starts past the end of a recorded
    range that covers its head, and is split around a recorded range inside it.
    """
    pieces: list[tuple[int, int]] = []
    cursor = start
    for rng in sorted(recorded, key=lambda r: r.start_offset):
        if rng.end_offset < cursor:
            continue
        if rng.start_offset > end or cursor > end:
            break
        if rng.start_offset > cursor:
            pieces.append((cursor, rng.start_offset - 1))
        cursor = max(cursor, rng.end_offset + 1)
    if cursor <= end:
        pieces.append((cursor, end))
    return pieces


class OwnerSession(Protocol):
    """The broker's registration, as topic owners see it
    (:class:`broker.cluster.membership.Membership`)."""

    def owner_lease(self) -> int | None:
        """The id of the lease the broker is registered under while that lease is fresh, else
        ``None`` (module docstring)."""
        ...


class Ownership:
    """This broker's ownership of one topic: the owner epoch and the reserved block.

    Args:
        store: etcd.
        name: the topic.
        broker_id: this broker.
        epoch: the owner epoch (§1.4).
        first_offset: the first offset of this ownership.
        reserved_end: the last offset reserved (inclusive).
        block: offsets reserved per extension.
        reservation_revision: the reservation key's mod revision as this owner wrote it.
        session: the registration whose lease this owner fences itself on (module docstring);
            ``None``: no lease check (tools and tests of the reservation alone).
        confirmed_lease: the lease under which the write of ``reservation_revision`` confirmed
            the ownership, or ``None``.

    Attributes:
        fenced: set once a guarded write failed because the topic changed hands.
        reservations: reservation writes since the takeover (extensions and confirmations).
    """

    def __init__(
        self, store: MetadataStore, name: TopicName, broker_id: int, *, epoch: int, first_offset: int,
        reserved_end: int, block: int = DEFAULT_OFFSET_BLOCK, reservation_revision: int = 0,
        session: OwnerSession | None = None, confirmed_lease: int | None = None,
    ) -> None:
        self.store = store
        self.name = name
        self.broker_id = broker_id
        self.epoch = epoch
        self.first_offset = first_offset
        self.reserved_end = reserved_end
        self.block = block
        self.reservation_revision = reservation_revision
        self.session = session
        self.fenced = False
        self.reservations = 0
        self._confirmed_lease = confirmed_lease
        self._stale = False
        self._lock = asyncio.Lock()

    @property
    def guard(self) -> dict[str, int]:
        """The comparison every owner write carries: the assignment key's create revision."""
        return {keys.topic_assignment(self.broker_id, self.name): self.epoch}

    def reservation(self, end_offset: int) -> values.OffsetReservation:
        return values.OffsetReservation(
            broker_id=self.broker_id, owner_epoch=self.epoch, first_offset=self.first_offset, end_offset=end_offset
        )

    def _fenced(self, what: str) -> NotServedHereError:
        if not self.fenced:
            self.fenced = True
            log.warning("topic %s: %s refused: broker %d no longer owns it (owner epoch %d changed)",
                        self.name, what, self.broker_id, self.epoch)
        return NotServedHereError(self.name.path, self.broker_id)

    def covers(self, offset: int) -> bool:
        """Whether an append up to ``offset`` may be written and acknowledged now without
        :meth:`reserve_through`: not fenced, inside the block, and (with a session) the lease
        fresh and the ownership confirmed under it (module docstring). Cheap: no etcd call."""
        if self.fenced or offset > self.reserved_end:
            return False
        if self.session is None:
            return True
        lease = self.session.owner_lease()
        return lease is not None and lease == self._confirmed_lease

    def refuse_ack(self, offset: int) -> NotServedHereError | None:
        """Checked after a write up to ``offset`` is durable, before it is acknowledged: the
        self-fencing rule holds at the acknowledgement too (module docstring), so a write that
        outlasted the lease's deadline (a slow ``fdatasync``) is not acknowledged.

        Returns:
            ``None`` when the acknowledgement is allowed (:meth:`covers`), else the error the
            appends fail with: the retriable :class:`~danube_pipeline.errors.NotServedHereError`
            (the data stays written; its offsets are never handed out again).
        """
        if self.covers(offset):
            return None
        if not self.fenced and not self._stale:
            self._stale = True
            log.warning(
                "topic %s: durable appends up to offset %d not acknowledged: broker %d's registration lease went "
                "stale during the write (it may be failed over); resuming once a renewal succeeds and it still "
                "owns the topic", self.name, offset, self.broker_id,
            )
        return NotServedHereError(self.name.path, self.broker_id)

    def _fresh_lease(self) -> int | None:
        """The session's fresh lease (``None`` without a session).

        Raises:
            NotServedHereError: the lease is not fresh: this broker may have been failed over.
        """
        if self.session is None:
            return None
        lease = self.session.owner_lease()
        if lease is None:
            if not self._stale:
                self._stale = True
                log.warning(
                    "topic %s: appends refused: broker %d's registration lease was not renewed in time "
                    "(it may be failed over); resuming once a renewal succeeds and it still owns the topic",
                    self.name, self.broker_id,
                )
            raise NotServedHereError(self.name.path, self.broker_id)
        return lease

    async def reserve_through(self, offset: int) -> None:
        """Make sure ``offset`` may be acknowledged: inside the reserved block, extended by
        whole blocks if needed, with the lease fresh and the ownership confirmed under it
        (module docstring). Called for every append :meth:`covers` does not allow.

        Raises:
            NotServedHereError: this broker no longer owns the topic (fenced), or its lease is
                not fresh (retriable: the topic may have been failed over).
            MetadataStoreError: etcd unreachable (nothing above the old end may be written).
        """
        async with self._lock:
            if self.fenced:
                raise NotServedHereError(self.name.path, self.broker_id)
            lease = self._fresh_lease()
            if offset <= self.reserved_end and (self.session is None or lease == self._confirmed_lease):
                return
            end = offset + self.block - 1 if offset > self.reserved_end else self.reserved_end
            await self._write_reservation(end)
            if self.session is not None:
                if self._fresh_lease() != lease:  # went stale during the write: confirm again later
                    raise NotServedHereError(self.name.path, self.broker_id)
                self._confirmed_lease = lease
                if self._stale:
                    self._stale = False
                    log.info("topic %s: lease renewed and ownership confirmed (epoch %d): appends resume",
                             self.name, self.epoch)

    async def _write_reservation(self, end: int) -> None:
        """Write the reservation with ``end``, guarded by the owner epoch and the reservation's
        mod revision; adopt a new revision whose value is still exactly this
        owner's block.

        Raises:
            NotServedHereError: fenced: the topic changed hands, or someone else rewrote the
                reservation.
            MetadataStoreError: etcd unreachable.
        """
        key = keys.offset_reservation(self.name)
        for _ in range(_TAKEOVER_ATTEMPTS):
            revision = await self.store.transaction(
                created=self.guard, modified={key: self.reservation_revision}, puts=[(key, self.reservation(end))]
            )
            if revision is not None:
                self.reservation_revision = revision
                self.reserved_end = end
                self.reservations += 1
                return
            assignment = await self.store.get(keys.topic_assignment(self.broker_id, self.name))
            if assignment is None or assignment.create_revision != self.epoch:
                raise self._fenced(f"reserving offsets up to {end}")
            res_kv = await self.store.get(key)
            if res_kv is None or _parse(res_kv, values.OffsetReservation) != self.reservation(self.reserved_end):
                log.warning("topic %s: the offset reservation was rewritten by someone else: %s",
                            self.name, res_kv.value if res_kv is not None else "deleted")
                raise self._fenced(f"reserving offsets up to {end}")
            self.reservation_revision = res_kv.mod_revision  # our own block, rewritten as it was
        raise MetadataStoreError("offset reservation", "the reservation kept changing")

    async def put(self, key: str, value: values.JsonValue | values.JsonRecord) -> None:
        """Write ``key`` only while this broker still owns the topic (cursors, §3.5).

        Raises:
            NotServedHereError: fenced.
            MetadataStoreError: etcd unreachable.
        """
        if await self.store.transaction(created=self.guard, puts=[(key, value)]) is None:
            raise self._fenced(f"writing {key}")


async def abandoned_pieces(
    store: MetadataStore, name: TopicName, broker_id: int, abandoned: Sequence[tuple[int, int]],
    planned: Sequence[values.UnavailableRange],
) -> list[values.UnavailableRange]:
    """The unavailable ranges (§5.5) to create for offsets this broker's WAL handed out and
    lost (:mod:`broker.storage.wal.abandoned`): ``abandoned`` set, ``last_written`` at the
    end (the offsets were handed out), only where no recorded or ``planned`` range covers them.

    Raises:
        MetadataStoreError: etcd unreachable.
    """
    if not abandoned:
        return []
    recorded = [*await recorded_ranges(store, name), *planned]
    since = int(time.time())
    return [
        values.UnavailableRange(
            start_offset=first, end_offset=end, broker_id=broker_id, since=since, last_written=end, abandoned=True,
        )
        for low, high in abandoned
        for first, end in uncovered_pieces(low, high, recorded)
    ]


async def commit_takeover(
    store: MetadataStore, name: TopicName, broker_id: int, plan: TakeoverPlan, next_offset: int, *,
    block: int = DEFAULT_OFFSET_BLOCK, wal_holds_data: bool, tiered_end: int | None,
    session: OwnerSession | None = None, abandoned: Sequence[tuple[int, int]] = (),
) -> tuple[Ownership, TakeoverPlan]:
    """Write this broker's reservation (and the unavailable range of the plan, created only
    where no range is recorded, §5.5) in one transaction guarded by the owner epoch and the
    reservation read; re-plan and retry when the reservation or the ranges changed meanwhile
    (a fenced owner recorded its last offset).

    Offsets the WAL recorded as abandoned (handed out once and lost) are published in the same
    transaction as abandoned unavailable ranges (:func:`abandoned_pieces`), so subscriptions
    skip them and tiering passes over them.

    Args:
        next_offset: the opened WAL's next offset (at or above ``plan.floor``).
        session: the registration the ownership fences itself on (:class:`Ownership`); the
            lease fresh before the write counts as confirmed by it.
        abandoned: the WAL's abandoned ranges, ``(first_offset, last_offset)`` inclusive.

    Returns:
        The ownership and the plan that was written.

    Raises:
        NotServedHereError: the topic is no longer assigned here.
        MetadataStoreError: etcd unreachable.
    """
    for _ in range(_TAKEOVER_ATTEMPTS):
        if plan.continuing and plan.reservation is not None:
            first = plan.reservation.first_offset
            end = max(plan.reservation.end_offset, next_offset - 1)
        else:
            first, end = next_offset, next_offset + block - 1
        lease = session.owner_lease() if session is not None else None
        ownership = Ownership(
            store, name, broker_id, epoch=plan.epoch, first_offset=first, reserved_end=end, block=block,
            session=session, confirmed_lease=lease,
        )
        puts: list[tuple[str, values.JsonValue | values.JsonRecord]] = [
            (keys.offset_reservation(name), ownership.reservation(end))
        ]
        guards = {keys.offset_reservation(name): plan.reservation_revision}
        planned = (plan.unavailable, *plan.more_unavailable) if plan.unavailable is not None else ()
        lost = await abandoned_pieces(store, name, broker_id, abandoned, planned)
        for piece in (*planned, *lost):
            range_key = keys.unavailable_range(name, piece.start_offset)
            puts.append((range_key, piece))
            guards[range_key] = 0  # created, never overwritten (§5.5)
        revision = await store.transaction(created=ownership.guard, modified=guards, puts=puts)
        if revision is not None:
            ownership.reservation_revision = revision
            for piece in lost:
                log.error(
                    "topic %s: offsets %d..%d were handed out and lost on this broker's disk; recorded as an "
                    "abandoned unavailable range: subscriptions skip them, tiering passes over them",
                    name, piece.start_offset, piece.end_offset,
                )
            if plan.unavailable is not None:
                u = plan.unavailable
                log.warning(
                    "topic %s taken over from failed broker %d: offsets %d..%d are unavailable until its disk "
                    "returns and they are tiered (last written: %s); this broker starts at %d",
                    name, u.broker_id, u.start_offset, (plan.more_unavailable or (u,))[-1].end_offset,
                    u.last_written, next_offset,
                )
            return ownership, plan
        plan = await plan_takeover(
            store, name, broker_id, wal_holds_data=wal_holds_data, tiered_end=tiered_end, in_sync=plan.in_sync
        )
        if not plan.continuing and plan.floor > next_offset:
            raise NotServedHereError(name.path, broker_id)  # reloaded at the new floor next time
    raise NotServedHereError(name.path, broker_id)


async def record_last_written(store: MetadataStore, name: TopicName, broker_id: int, last_written: int) -> bool:
    """A fenced owner records the last offset its WAL holds of ``name``: on its reservation if
    nobody took the topic over yet (§5.4), else on the unavailable ranges of its block (§5.5).

    Returns:
        Whether a key was updated.

    Raises:
        MetadataStoreError: etcd unreachable.
    """
    for _ in range(_TAKEOVER_ATTEMPTS):
        res_kv = await store.get(keys.offset_reservation(name))
        res = _parse(res_kv, values.OffsetReservation)
        if res_kv is not None and isinstance(res, values.OffsetReservation) and res.broker_id == broker_id:
            if res.last_written is not None:
                return False
            updated = dataclasses.replace(res, last_written=min(last_written, res.end_offset))
            if await store.transaction(modified={res_kv.key: res_kv.mod_revision}, puts=[(res_kv.key, updated)]):
                log.info("topic %s: recorded offset %d as the last this broker wrote (its reservation ends at %d)",
                         name, last_written, res.end_offset)
                return True
            continue
        kvs, _ = await store.get_prefix(keys.unavailable_prefix(name))
        changed = False
        retry = False
        for kv in kvs:
            rng = _parse(kv, values.UnavailableRange)
            if not isinstance(rng, values.UnavailableRange) or rng.broker_id != broker_id or rng.last_written is not None:
                continue
            updated_range = dataclasses.replace(rng, last_written=min(last_written, rng.end_offset))
            if await store.transaction(modified={kv.key: kv.mod_revision}, puts=[(kv.key, updated_range)]):
                changed = True
                log.info("topic %s: unavailable range %d..%d: this broker wrote up to offset %d",
                         name, rng.start_offset, rng.end_offset, last_written)
            else:
                retry = True
        if not retry:
            return changed
    return False


def unavailable_ranges(raw: dict[str, object]) -> list[values.UnavailableRange]:
    """Parse the cached values under ``.../unavailable/`` (§5.5), ascending by start offset."""
    out = []
    for value in raw.values():
        try:
            out.append(values.UnavailableRange.from_json(value))
        except (ValueError, TypeError):
            continue
    return sorted(out, key=lambda r: r.start_offset)


__all__ = [
    "OwnerSession",
    "abandoned_pieces",
    "Ownership",
    "TakeoverPlan",
    "commit_takeover",
    "plan_takeover",
    "record_last_written",
    "recorded_ranges",
    "uncovered_pieces",
    "unavailable_ranges",
    "wal_has_records",
]
