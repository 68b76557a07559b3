"""The cluster as this broker sees it in the LocalCache: brokers, the leader, who owns a topic.

:class:`ClusterView` answers from ``/cluster/register/``, ``/cluster/brokers/`` and
``/cluster/leader`` (``docs/etcd-layout.md`` §1): the registered brokers and their modes, the
leader's id, the broker a topic is assigned to, and the lookup of ``Discovery.TopicLookup``.
A topic nobody owns is put in the unassigned queue (§1.5) and waited for until the leader
assigns it. It also follows this broker's own assignments (§1.4) for the broker core.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from danube_pipeline.aio import wait_set
from danube_pipeline.errors import BrokerUnavailableError, TopicNotFoundError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.connection import remaining_budget_s
from danube_pipeline.metadata.store import MetadataStore, WatchEvent, WatchEventType
from danube_pipeline.names import TopicName

__all__ = ["ASSIGN_TIMEOUT_S", "ClusterView", "RegisteredBroker"]

ASSIGN_TIMEOUT_S = 10.0
"""How long a request waits for the leader to assign a topic nobody owns (§1.5)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RegisteredBroker:
    """A broker as ``/cluster/register/{id}`` and ``/cluster/brokers/{id}/state`` describe it.

    Attributes:
        broker_id: the u64 broker id.
        address: ``host:port`` clients use (``advertised_addr``).
        mode: the state's ``mode`` (``active``, ``draining``), empty when unknown.
        internal_address: ``host:port`` of its broker-to-broker port (``internal_addr``),
            ``None`` when it serves none.
    """

    broker_id: int
    address: str
    mode: str
    internal_address: str | None = None

    @property
    def peer_address(self) -> str:
        """Where another broker calls it: the broker-to-broker port when it has one, else
        the advertised address."""
        return self.internal_address or self.address


class ClusterView:
    """Brokers, the leader and topic owners, read from the LocalCache (§1).

    Args:
        broker_id: this broker's u64 id.
        store: etcd, for the writes of the unassigned queue and for cache misses.
        cache: the LocalCache, for reads.
    """

    def __init__(self, broker_id: int, *, store: MetadataStore, cache: LocalCache) -> None:
        self.broker_id = broker_id
        self.store = store
        self.cache = cache
        self._owners: dict[str, set[int]] | None = None
        """Topic path -> ids of the brokers with its assignment key (§1.4), kept from the cache's
        events once first read: a lookup does not scan the assignments of every topic."""

    # ------------------------------------------------------------------ assignments

    def follow_assignments(
        self, on_assigned: Callable[[TopicName], None], on_unassigned: Callable[[TopicName], None]
    ) -> Callable[[], None]:
        """Call ``on_assigned`` when ``/cluster/brokers/{own id}/{ns}/{topic}`` is written and
        ``on_unassigned`` when it is deleted (§1.4).

        Returns:
            A function that stops following.
        """

        def on_event(event: WatchEvent) -> None:
            name = self.assignment_topic(event.key)
            if name is None:
                return
            if event.type is WatchEventType.PUT:
                on_assigned(name)
            else:
                on_unassigned(name)

        return self.cache.add_listener(keys.broker_prefix(self.broker_id), on_event)

    def assigned_here(self) -> list[TopicName]:
        """The topics assigned to this broker in the cache (§1.4)."""
        names = (self.assignment_topic(key) for key in self.cache.get_prefix(keys.broker_prefix(self.broker_id)))
        return [name for name in names if name is not None]

    def assignment_topic(self, key: str) -> TopicName | None:
        """The topic of an assignment key of this broker; ``None`` for any other key (such as
        its ``state``)."""
        rest = key.removeprefix(keys.broker_prefix(self.broker_id))
        if rest.count("/") != 1:
            return None
        try:
            return TopicName.parse(f"/{rest}")
        except Exception:  # noqa: BLE001 - not an assignment key (e.g. "state")
            return None

    def is_assigned_here(self, name: TopicName) -> bool:
        """Whether ``/cluster/brokers/{own id}/{ns}/{topic}`` exists (``docs/etcd-layout.md`` §1.4)."""
        return self.cache.contains(keys.topic_assignment(self.broker_id, name))

    def assigned_broker(self, name: TopicName) -> int | None:
        """The broker id the topic is assigned to, from ``/cluster/brokers/*/{ns}/{topic}``
        (the lowest id in key order when two keys exist for a moment)."""
        owners = self._assignment_index().get(name.path)
        return min(owners, key=str) if owners else None

    def _assignment_index(self) -> dict[str, set[int]]:
        """Topic path -> broker ids of its assignment keys: loaded from the cache at first use,
        then kept current by a listener on ``/cluster/brokers/`` (the cache also replays what
        changed across a watch break as events)."""
        if self._owners is None:
            owners: dict[str, set[int]] = {}
            for key in self.cache.get_prefix(keys.BROKERS_PREFIX):
                parsed = _assignment(key)
                if parsed is not None:
                    owners.setdefault(parsed[1], set()).add(parsed[0])
            self._owners = owners
            self.cache.add_listener(keys.BROKERS_PREFIX, self._on_assignment_event)
        return self._owners

    def _on_assignment_event(self, event: WatchEvent) -> None:
        parsed = _assignment(event.key)
        if parsed is None or self._owners is None:
            return
        broker_id, path = parsed
        if event.type is WatchEventType.PUT:
            self._owners.setdefault(path, set()).add(broker_id)
        else:
            owners = self._owners.get(path)
            if owners is not None:
                owners.discard(broker_id)
                if not owners:
                    del self._owners[path]

    async def topic_exists(self, name: TopicName) -> bool:
        """Whether the topic root (§3.1) exists. A cache miss is checked against etcd (another
        broker may have created the topic a moment ago), and the cache waits for that write.

        Raises:
            MetadataStoreError: etcd unreachable (on a cache miss only).
        """
        if self.cache.contains(keys.topic_root(name)):
            return True
        kv = await self.store.get(keys.topic_root(name))
        if kv is None:
            return False
        await self.cache.wait_for_revision(kv.mod_revision)
        return True

    async def request_assignment(self, name: TopicName) -> None:
        """Put ``name`` in the unassigned queue (§1.5) unless it is there already.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        revision = await self.store.transaction(
            created={keys.unassigned_topic(name): 0},
            exists=[keys.topic_root(name)],
            puts=[(keys.unassigned_topic(name), None)],
        )
        if revision is not None:
            await self.cache.wait_for_revision(revision)

    async def await_owner(self, name: TopicName, timeout_s: float = ASSIGN_TIMEOUT_S, *, registered: bool = False) -> int:
        """Wait until ``name`` has an owner (§1.4) in the cache, at most ``timeout_s`` seconds
        and never past the request's deadline (so the client gets the typed cause). With
        ``registered``, the owner must also be registered (§1.2): an owner whose lease expired
        is waited out until the leader fails the topic over.

        Raises:
            BrokerUnavailableError: none in time (retriable).
        """
        budget = remaining_budget_s()  # the client's deadline, less a margin (deadline_scope)
        if budget is not None:
            timeout_s = min(timeout_s, budget)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        changed = asyncio.Event()
        unlisten = self.cache.add_listener(keys.BROKERS_PREFIX, lambda _event: changed.set())
        listeners = [unlisten]
        if registered:
            listeners.append(self.cache.add_listener(keys.BROKER_REGISTER_PREFIX, lambda _event: changed.set()))
        try:
            while True:
                owner = self.assigned_broker(name)
                if owner is not None and (not registered or self.cache.contains(keys.broker_register(owner))):
                    return owner
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise BrokerUnavailableError(
                        name.path, f"no broker was assigned the topic within {timeout_s:.0f} s (is a leader elected?)"
                    )
                changed.clear()
                await wait_set(changed, min(remaining, 0.5))
        finally:
            for remove in listeners:
                remove()

    # ------------------------------------------------------------------ discovery

    async def lookup(self, name: TopicName) -> RegisteredBroker:
        """The broker serving ``name``; an unassigned topic is queued for the leader to assign.

        Raises:
            TopicNotFoundError: the topic does not exist.
            BrokerUnavailableError: its owner is not registered.
        """
        if not await self.topic_exists(name):
            raise TopicNotFoundError(name.path)
        broker_id = self.assigned_broker(name)
        if broker_id is None:  # unassigned: the leader assigns it (§1.5)
            await self.request_assignment(name)
            broker_id = await self.await_owner(name)
        raw = self.cache.get(keys.broker_register(broker_id))
        if raw is None:  # its lease expired: the leader fails the topic over (§1.4)
            try:
                broker_id = await self.await_owner(name, registered=True)
            except BrokerUnavailableError:
                raise BrokerUnavailableError(
                    f"broker {broker_id}", f"serves {name.path} but is not registered (the leader fails its "
                    "topics over once its lease expired)"
                ) from None
            raw = self.cache.get(keys.broker_register(broker_id))
        if raw is None:
            raise BrokerUnavailableError(f"broker {broker_id}", f"serves {name.path} but is not registered")
        registration = values.BrokerRegistration.from_json(raw)
        return RegisteredBroker(broker_id, registration.advertised_addr, self._broker_mode(broker_id),
                                registration.internal_addr)

    def registered_brokers(self) -> list[RegisteredBroker]:
        """Every broker under ``/cluster/register/`` with its state's mode (§1.2, §1.3)."""
        out = []
        for key, raw in self.cache.get_prefix(keys.BROKER_REGISTER_PREFIX).items():
            suffix = key[len(keys.BROKER_REGISTER_PREFIX) :]
            if not suffix.isdigit():
                continue
            try:
                registration = values.BrokerRegistration.from_json(raw)
            except ValueError:
                continue
            out.append(RegisteredBroker(int(suffix), registration.advertised_addr, self._broker_mode(int(suffix)),
                                        registration.internal_addr))
        return out

    def other_active_brokers(self) -> list[int]:
        """Registered brokers other than this one whose state is ``active`` (§1.2, §1.3)."""
        return sorted(
            b.broker_id for b in self.registered_brokers() if b.broker_id != self.broker_id and b.mode == "active"
        )

    def _broker_mode(self, broker_id: int) -> str:
        state = self.cache.get(keys.broker_state(broker_id))
        return str(state.get("mode", "")) if isinstance(state, dict) else ""

    def leader_id(self) -> int:
        """The id in ``/cluster/leader`` (§1.7), 0 when none is recorded."""
        leader = self.cache.get(keys.CLUSTER_LEADER)
        return leader if isinstance(leader, int) and not isinstance(leader, bool) else 0


def _assignment(key: str) -> tuple[int, str] | None:
    """``(broker id, "/{ns}/{topic}")`` of an assignment key ``/cluster/brokers/{id}/{ns}/{topic}``
    (§1.4); ``None`` for any other key under the prefix (a broker's ``state``)."""
    parts = key[len(keys.BROKERS_PREFIX) :].split("/")
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    return int(parts[0]), f"/{parts[1]}/{parts[2]}"
