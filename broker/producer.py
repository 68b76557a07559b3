"""A producer registered on a topic, and the messages it sends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from danube_pipeline.metadata import values
from danube_pipeline.schema_registry import RegisteredSchema

if TYPE_CHECKING:
    from broker.topic import Topic


@dataclass(slots=True)
class Producer:
    """A producer registered on a topic (``docs/etcd-layout.md`` §3.3).

    Attributes:
        id: u64 producer id.
        name: producer name.
        access_mode: 0 = shared.
        topic: the topic it publishes to.
        schema: the registered writer schema, if the producer declared one.
        parsed_schema: fastavro's parsed form of ``schema``.
    """

    id: int
    name: str
    access_mode: int
    topic: Topic
    schema: RegisteredSchema | None = None
    parsed_schema: Any = None
    sent_messages: int = field(default=0)

    def metadata(self, *, status: bool) -> values.ProducerMetadata:
        """The value of ``/topics/{ns}/{topic}/producers/{id}`` (``docs/etcd-layout.md`` §3.3);
        ``status`` is true while the producer is open."""
        return values.ProducerMetadata(
            access_mode=self.access_mode,
            producer_id=self.id,
            producer_name=self.name,
            status=status,
            topic_name=self.topic.path,
        )


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """One message of a send request, before validation (wire types stay in services.py)."""

    payload: bytes
    attributes: dict[str, str]
    publish_time_us: int
