"""What the cluster leader does to even out the load: move topics off busy brokers
(``docs/etcd-layout.md`` §1.6, §1.8).

While this broker is the leader (§1.7), :class:`Rebalancer` runs one *round* every
``interval_s`` seconds:

1. It waits while the unassigned queue (§1.5) holds a topic: a move or a failover is under way,
   and the brokers' loads are about to change.
2. It reads, from the cache, every registered broker (§1.2) whose state (§1.3) is ``active``,
   its load report (§1.6: ``CPU``, ``Memory``, ``MsgRate``, ``ByteRate``) and its topics, taken
   from the assignment keys (§1.4), which the cache has before the broker's next report.
   Draining brokers are left out: a drain releases every topic itself (``DrainBroker``).
3. It calls :func:`broker.cluster.load_manager.plan_rebalance` with the configured strategy, CV
   threshold, round cool-down and ``max_moves``. The plan moves topics only when the coefficient
   of variation of the brokers' scores is above the threshold and ``cooldown_s`` has passed
   since the last round that moved topics; a topic moved (or tried) less than
   ``topic_cooldown_s`` ago stays where it is, so a failing move is not retried in a loop.
4. A plan with moves is written to ``/cluster/load_balance`` as a
   :class:`~broker.cluster.load_manager.LoadBalanceDecision`, in a transaction guarded by the leader's
   epoch, so a deposed leader writes nothing and moves nothing.
5. Each move, in order: the destination is recorded in ``LeaderDuties.preferred``, then the
   owner is asked to release the topic gracefully (``Admin.UnloadTopic``: it seals the WAL and
   puts the topic in the unassigned queue with ``from_broker``); the leader's assignment pass
   then gives it to the destination, and clients follow it. A replicated topic's destination
   outside its replica set first becomes a replica and catches up
   (:mod:`broker.cluster.replica_moves`), so ownership only ever passes to an in-sync replica. A
   move whose source no longer owns the topic is skipped; one whose unload fails (or whose
   destination does not catch up) is logged and counted, and not retried before the topic's
   cool-down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from danube_pipeline.client.status import rpc_errors
from danube_pipeline.errors import BrokerUnavailableError, NotServedHereError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.outages import OutageLog
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.cluster.replica_moves import REPLICA_CATCH_UP_S, replicate_to_target
from broker.cluster.leader import UNASSIGNED_PREFIX, LeaderDuties, assignments, broker_mode, registered_brokers
from broker.cluster.load_manager import (
    REASON_REBALANCED,
    BrokerLoad,
    LoadBalanceDecision,
    RebalancePlan,
    Strategy,
    plan_rebalance,
)
from broker.rpc.tls import BrokerChannels

log = logging.getLogger(__name__)

TOPIC_COOLDOWN_ROUNDS = 3
"""By default a topic moves at most once per this many round cool-downs."""
UNLOAD_TIMEOUT_MS = 15_000
"""Deadline of one ``Admin.UnloadTopic`` call made for a move, in milliseconds."""

Unload = Callable[[str], Awaitable[object]]
"""Asks the owner of a topic (``/ns/topic``) to release it; raises when it could not."""


class ClientUnloader:
    """:data:`Unload` over a broker-to-broker channel: ``Admin.UnloadTopic`` on the topic's
    owner.

    The owner's address comes from ``owner_address``; in a broker that is the owner's
    registration (``docs/etcd-layout.md`` §1.2): its broker-to-broker port when it serves one
    (``internal_addr``), else its advertised address
    (:attr:`broker.cluster_view.RegisteredBroker.peer_address`). Without ``owner_address``
    every call goes to ``address``. The channels are kept
    (:class:`broker.rpc.tls.BrokerChannels`) and opened again when the certificate, key or CA
    file changes, so a rotated certificate reaches the next call without a restart. A call
    answered ``NotServedHereError`` (the topic moved) or ``BrokerUnavailableError`` is tried
    once more, the owner looked up again.

    Args:
        address: ``host:port`` of a broker of the cluster, called when ``owner_address`` is
            ``None``.
        request_timeout_ms: deadline of each RPC, in milliseconds.
        tls_files: under TLS, the broker's ``(ca_file, cert_file, key_file)``: mutual TLS
            with the broker's own certificate; ``None`` calls in plaintext.
        owner_address: returns ``host:port`` to call for a topic (``/ns/topic``).

    Attributes:
        channels: the kept channels.
    """

    def __init__(
        self,
        address: str,
        *,
        request_timeout_ms: int = UNLOAD_TIMEOUT_MS,
        tls_files: tuple[Path | None, Path, Path] | None = None,
        owner_address: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        self.address = address
        self.request_timeout_ms = request_timeout_ms
        self._owner_address = owner_address
        self.channels = BrokerChannels(tls_files)

    async def __call__(self, topic: str) -> int:
        """Release ``topic`` from its owner.

        Returns:
            The first offset the next owner hands out.

        Raises:
            DanubeError: the owner refused (``NotServedHereError`` twice, the topic is gone)
                or could not be reached (``BrokerUnavailableError``), typed as it answered.
            OSError: a TLS file cannot be read.
        """
        path = TopicName.parse(topic).path
        for attempt in range(2):
            address = self.address if self._owner_address is None else await self._owner_address(path)
            channel = await self.channels.channel(address)
            try:
                with rpc_errors(address):
                    response = await pb_grpc.AdminStub(channel).UnloadTopic(
                        pb.UnloadTopicRequest(topic=path), timeout=self.request_timeout_ms / 1000
                    )
            except BrokerUnavailableError:
                await self.channels.discard(address)
                if attempt:
                    raise
            except NotServedHereError:
                if attempt:
                    raise
            else:
                return int(response.next_offset)
            await asyncio.sleep(0.2)
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        """Close the channels (idempotent)."""
        await self.channels.close()


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What one round did.

    Attributes:
        plan: the plan, or ``None`` when no plan was made (not the leader, a topic waiting in
            the unassigned queue, fewer than two active brokers).
        decision: the decision written to ``/cluster/load_balance``, or ``None``.
        moved: topics released for a move.
        failed: topics whose release failed.
        skipped: moves given up before the release (the source no longer owned the topic, or
            the leader was deposed meanwhile).
    """

    plan: RebalancePlan | None = None
    decision: LoadBalanceDecision | None = None
    moved: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()


class Rebalancer:
    """The leader's rebalancing loop (module docstring).

    Args:
        store: etcd, for the decision.
        cache: the broker's cache (load reports, states, assignments, the unassigned queue).
        epoch: returns this broker's leader epoch (§1.7), or ``None`` when it is not the leader.
        duties: the leader's assignment loop; a move's destination goes in its ``preferred``.
        unload: asks a topic's owner to release it (:class:`ClientUnloader` in a broker).
        strategy: how brokers are scored.
        threshold: the CV above which topics move (e.g. ``RebalanceAggressiveness.BALANCED
            .threshold``, 0.3).
        interval_s: seconds between two rounds.
        cooldown_s: seconds without balancing moves after a round that moved topics.
        max_moves: at most this many topics move per round.
        topic_cooldown_s: a topic moved (or tried) less than this many seconds ago does not
            move; default :data:`TOPIC_COOLDOWN_ROUNDS` × ``cooldown_s``.
        replica_catch_up_s: how long a replicated topic's move waits for its destination to
            join the ISR (:mod:`broker.cluster.replica_moves`).
        clock: monotonic seconds, for the cool-downs.
        wall_clock: seconds since the Unix epoch, for the decision's ``timestamp``.

    Attributes:
        rounds: rounds that made a plan.
        decisions: decisions written.
        moves_made: topics released for a move.
        moves_failed: releases that failed.
        moves_skipped: moves given up before the release.
        last_result: what the latest round did.

    Raises:
        ValueError: an unknown strategy, a non-positive interval, or a negative threshold,
            cool-down or ``max_moves``.
    """

    def __init__(
        self,
        store: MetadataStore,
        cache: LocalCache,
        epoch: Callable[[], int | None],
        *,
        duties: LeaderDuties | None,
        unload: Unload,
        strategy: Strategy | str,
        threshold: float,
        interval_s: float,
        cooldown_s: float,
        max_moves: int,
        topic_cooldown_s: float | None = None,
        replica_catch_up_s: float = REPLICA_CATCH_UP_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        if not (math.isfinite(threshold) and threshold >= 0) or cooldown_s < 0 or max_moves < 0:
            raise ValueError("threshold, cooldown_s and max_moves must be >= 0")
        self.store = store
        self.cache = cache
        self.epoch = epoch
        self.duties = duties
        self.unload = unload
        self.strategy = Strategy(strategy)
        self.threshold = threshold
        self.interval_s = interval_s
        self.cooldown_s = cooldown_s
        self.max_moves = max_moves
        self.topic_cooldown_s = TOPIC_COOLDOWN_ROUNDS * cooldown_s if topic_cooldown_s is None else topic_cooldown_s
        self.replica_catch_up_s = replica_catch_up_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._last_round_s: float | None = None
        self._recently_moved: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._outage = OutageLog(log, "rebalancing topics")
        self.rounds = 0
        self.decisions = 0
        self.moves_made = 0
        self.moves_failed = 0
        self.moves_skipped = 0
        self.last_result = RoundResult()

    def start(self) -> None:
        """Run a round every ``interval_s`` seconds (each acts only while the leader)."""
        self._task = asyncio.create_task(self._run(), name="rebalancer")

    async def stop(self) -> None:
        """Stop the loop (a move under way is cancelled) and close the unloader's client."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        close = getattr(self.unload, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            epoch = self.epoch()
            if epoch is None:
                continue
            try:
                await self.run_round(epoch)
            except Exception as exc:  # noqa: BLE001 - etcd unreachable: the next round retries
                self._outage.failed(exc)
                continue
            self._outage.succeeded()

    def broker_loads(self) -> list[BrokerLoad]:
        """The active registered brokers' loads, from the cache: each report's resources and
        the topics of the assignment keys (module docstring, step 2). A missing or unreadable
        report reads as all zeros."""
        owned = assignments(self.cache)
        loads = []
        for broker_id in registered_brokers(self.cache):
            if broker_mode(self.cache, broker_id) != "active":
                continue
            raw = self.cache.get(keys.load_report(broker_id))
            try:
                report = values.LoadReport.from_json(raw)
            except (ValueError, TypeError):
                report = values.LoadReport(resources_usage=[], topic_list=[], topics_len=0)
            try:
                load = BrokerLoad.from_report(broker_id, report, topics=sorted(set(owned.get(broker_id, []))))
            except ValueError as exc:  # a negative or non-finite figure: count its topics only
                log.warning("broker %d: unusable load report (%s)", broker_id, exc)
                load = BrokerLoad(broker_id, 0.0, 0.0, sorted(set(owned.get(broker_id, []))))
            loads.append(load)
        return loads

    async def run_round(self, epoch: int) -> RoundResult:
        """One round (module docstring) as the leader of ``epoch``.

        Returns:
            What it did; also kept in :attr:`last_result`.

        Raises:
            MetadataStoreError: etcd unreachable when writing the decision.
        """
        result = await self._round(epoch)
        self.last_result = result
        return result

    async def _round(self, epoch: int) -> RoundResult:
        if self.cache.get_prefix(UNASSIGNED_PREFIX):
            return RoundResult()
        loads = self.broker_loads()
        if len(loads) < 2:
            return RoundResult()
        now = self._clock()
        self._recently_moved = {
            t: at for t, at in self._recently_moved.items() if now - at < self.topic_cooldown_s
        }
        plan = plan_rebalance(
            loads,
            self.strategy,
            self.threshold,
            max_moves=self.max_moves,
            now_s=now,
            last_round_s=self._last_round_s,
            cooldown_s=self.cooldown_s,
            recently_moved=self._recently_moved,
            topic_cooldown_s=self.topic_cooldown_s,
        )
        self.rounds += 1
        if not plan.moves:
            log.debug("rebalance: CV %.3f (threshold %.3f): %s", plan.cv_before, self.threshold, plan.reason)
            return RoundResult(plan=plan)
        decision = LoadBalanceDecision.from_plan(plan, epoch=epoch, timestamp=self._wall_clock(), strategy=self.strategy)
        revision = await self.store.transaction(
            created={keys.CLUSTER_LEADER: epoch}, puts=[(keys.CLUSTER_LOAD_BALANCE, decision)]
        )
        if revision is None:
            log.info("rebalance: not the leader of epoch %d any more; nothing moves", epoch)
            return RoundResult(plan=plan)
        self.decisions += 1
        self._last_round_s = now
        log.info(
            "rebalance (leader epoch %d, %s): CV %.3f -> %.3f predicted, %d moves%s",
            epoch, self.strategy.value, plan.cv_before, plan.cv_after, len(plan.moves),
            "" if plan.reason == REASON_REBALANCED else f" ({plan.reason})",
        )
        moved: list[str] = []
        failed: list[str] = []
        skipped: list[str] = []
        for topic, source, target in plan.moves:
            self._recently_moved[topic] = now
            name = TopicName.parse(topic)
            if self.epoch() != epoch or not self.cache.contains(keys.topic_assignment(source, name)):
                skipped.append(topic)
                continue
            try:
                if not await replicate_to_target(
                    self.store, self.cache, epoch, name, target, catch_up_s=self.replica_catch_up_s
                ):
                    raise RuntimeError(f"broker {target} is not an in-sync replica")
                if self.duties is not None:
                    self.duties.preferred[topic] = target
                await self.unload(topic)
            except Exception as exc:  # noqa: BLE001 - any failure: logged, counted, not retried soon
                if self.duties is not None:
                    self.duties.preferred.pop(topic, None)
                failed.append(topic)
                log.warning(
                    "rebalance: moving %s from broker %d to broker %d failed: %s (not retried for %.0f s)",
                    topic, source, target, exc, self.topic_cooldown_s,
                )
                continue
            moved.append(topic)
            log.info("rebalance: %s released by broker %d for broker %d", topic, source, target)
        self.moves_made += len(moved)
        self.moves_failed += len(failed)
        self.moves_skipped += len(skipped)
        return RoundResult(plan=plan, decision=decision, moved=tuple(moved), failed=tuple(failed), skipped=tuple(skipped))


__all__ = ["TOPIC_COOLDOWN_ROUNDS", "ClientUnloader", "Rebalancer", "RoundResult", "Unload"]
