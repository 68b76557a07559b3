"""The idempotent producer's identity: a producer id and an epoch per topic and producer name,
assigned by the broker through etcd (Kafka's KIP-98 producer id and epoch).

One etcd key per (topic, producer name), ``/danube-data/storage/topics/{ns}/{topic}/producer_ids/{name}``
(``docs/etcd-layout.md`` §5.6.1), holds ``{"producer_id": p, "epoch": e}``. A producer asks for
its identity in ``CreateProducerRequest`` (``idempotent``):

* a new producer *instance* sends no identity: the topic's owner creates the key (a random
  48-bit producer id, epoch 0) or bumps its epoch, with a compare-and-set on the key's
  ``mod_revision`` (retried on a conflict). Every older instance of the name is fenced: its
  batches, and its attempts to re-create its producer, are refused with
  :class:`~danube_pipeline.errors.ProducerFencedError`;
* the same instance re-creating its producer (a reconnect, a topic move, a broker restart)
  sends the identity it holds: the owner only checks that the key still holds it (no write),
  and the producer resumes: its sequence numbers continue, so its resends are deduplicated.

Sequence numbers start at 0 per identity: an epoch bump starts them again, and no clock is
involved. The batch header (``danube_pipeline.format.batches``) has no field for the epoch, and
its ``producer_id`` field is a u64: an idempotent producer writes its identity there as
``epoch << 48 | producer_id`` (:attr:`ProducerIdentity.header_id`), so the header format does
not change and segments written before keep their meaning (a producer that asked for no
identity, such as the dead-letter writer, still writes its session id). At topic load, the
owner rebuilds the sequence state from those headers (:mod:`broker.topics.producer_sequences`),
each producer name's state belonging to the header id of its newest batches; when the instance
re-creates its producer with that identity, it resumes on that state.

An epoch past 65,535 does not fit the header: the name then gets a new producer id, epoch 0
(as Kafka does on epoch exhaustion).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Mapping

from danube_pipeline.errors import MetadataStoreError, ProducerFencedError
from danube_pipeline.metadata import keys
from danube_pipeline.names import TopicName
from danube_pipeline.metadata.store import MetadataStore

log = logging.getLogger(__name__)

EPOCH_SHIFT = 48
"""The header's ``producer_id`` is ``epoch << EPOCH_SHIFT | producer_id``."""
MAX_PRODUCER_ID = (1 << EPOCH_SHIFT) - 1
"""Largest idempotent producer id (48 bits)."""
MAX_EPOCH = 0xFFFF
"""Largest epoch (16 bits, as Kafka's); the next bump allocates a new producer id."""
_MAX_ATTEMPTS = 20


@dataclasses.dataclass(frozen=True, slots=True)
class ProducerIdentity:
    """One instance's idempotent identity.

    Attributes:
        producer_id: the 48-bit id, kept per (topic, producer name) across epochs.
        epoch: bumped by every new instance of the producer.
    """

    producer_id: int
    epoch: int

    @property
    def header_id(self) -> int:
        """The batch header's ``producer_id`` for this identity."""
        return self.epoch << EPOCH_SHIFT | self.producer_id

    def to_json(self) -> dict[str, int]:
        """The §5.6.1 value."""
        return {"producer_id": self.producer_id, "epoch": self.epoch}

    @staticmethod
    def from_json(value: object) -> ProducerIdentity | None:
        """The identity in a §5.6.1 value, or ``None`` if it is malformed."""
        if not isinstance(value, Mapping):
            return None
        pid, epoch = value.get("producer_id"), value.get("epoch")
        if not isinstance(pid, int) or not isinstance(epoch, int) or isinstance(pid, bool) or isinstance(epoch, bool):
            return None
        if not 0 < pid <= MAX_PRODUCER_ID or not 0 <= epoch <= MAX_EPOCH:
            return None
        return ProducerIdentity(pid, epoch)

    def bumped(self) -> ProducerIdentity:
        """The next instance's identity: the epoch plus one, or a new producer id at epoch 0
        past :data:`MAX_EPOCH`."""
        if self.epoch >= MAX_EPOCH:
            return ProducerIdentity(_new_producer_id(avoid=self.producer_id), 0)
        return ProducerIdentity(self.producer_id, self.epoch + 1)


def epoch_of(header_id: int) -> int:
    """The epoch in a batch header's ``producer_id`` written by an idempotent producer."""
    return header_id >> EPOCH_SHIFT


def producer_id_of(header_id: int) -> int:
    """The idempotent producer id in a batch header's ``producer_id``."""
    return header_id & MAX_PRODUCER_ID


def _new_producer_id(*, avoid: int = 0) -> int:
    while True:
        candidate = secrets.randbits(EPOCH_SHIFT)
        if candidate and candidate != avoid:
            return candidate


async def assign_identity(
    store: MetadataStore, topic: TopicName, producer_name: str, *, held: ProducerIdentity | None
) -> ProducerIdentity:
    """The identity of a producer instance being created (module docstring).

    Args:
        store: etcd.
        topic: the topic (served here).
        producer_name: the producer's name.
        held: the identity the instance already holds (it re-creates its producer), or
            ``None`` for a new instance.

    Returns:
        ``held`` when the key still holds it; otherwise the new instance's identity, written.
        A held identity whose key is gone (the topic was deleted and created again) is
        replaced by a new one.

    Raises:
        ProducerFencedError: ``held`` is older than the key's identity (a newer instance exists).
        MetadataStoreError: etcd unreachable, or the key kept changing under concurrent creations.
    """
    key = keys.producer_identity(topic, producer_name)
    for _attempt in range(_MAX_ATTEMPTS):
        current = await store.get(key)
        stored = ProducerIdentity.from_json(current.value) if current is not None else None
        if held is not None and stored is not None:
            if stored == held:
                return held
            raise ProducerFencedError(topic.path, producer_name, held.epoch, stored.epoch)
        new = stored.bumped() if stored is not None else ProducerIdentity(_new_producer_id(), 0)
        expected = current.mod_revision if current is not None else 0
        if await store.compare_and_put(key, new.to_json(), expected_mod_revision=expected):
            log.info("%s: producer %s is instance %d of producer id %d", topic, producer_name, new.epoch, new.producer_id)
            return new
    raise MetadataStoreError("producer identity", f"{key} kept changing under concurrent creations")


__all__ = [
    "EPOCH_SHIFT",
    "MAX_EPOCH",
    "MAX_PRODUCER_ID",
    "ProducerIdentity",
    "assign_identity",
    "epoch_of",
    "producer_id_of",
]
