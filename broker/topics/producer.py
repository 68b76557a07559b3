"""A producer registered on a topic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from danube_pipeline.format.batches import BatchHeader
from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.metadata import values
from danube_pipeline.schemas.formats import ParsedSchema
from danube_pipeline.schemas.registry import RegisteredSchema

if TYPE_CHECKING:
    from broker.topics.producer_identity import ProducerIdentity
    from broker.topics.topic import Topic


@dataclass(slots=True)
class Producer:
    """A producer registered on a topic (``docs/etcd-layout.md`` §3.3).

    Attributes:
        id: u64 producer id.
        name: producer name.
        access_mode: 0 = shared.
        topic: the topic it publishes to.
        schema: the registered writer schema, if the producer declared one.
        parsed_schema: the parsed ``schema``, which validates each payload
            (:class:`~danube_pipeline.schemas.formats.ParsedSchema`).
        sent_messages: messages accepted from it.
        closed: set once it is closed (by the client, or its topic unloaded).
        identity: its idempotent identity (:mod:`broker.topics.producer_identity`), if it
            asked for one; its batches then carry the identity's header id instead of ``id``.
    """

    id: int
    name: str
    access_mode: int
    topic: Topic
    schema: RegisteredSchema | None = None
    parsed_schema: ParsedSchema | None = None
    sent_messages: int = field(default=0)
    closed: bool = field(default=False)
    identity: ProducerIdentity | None = None

    @property
    def header_id(self) -> int:
        """The ``producer_id`` its batch headers carry: the identity's header id, else ``id``."""
        return self.identity.header_id if self.identity is not None else self.id

    def check_batch_identity(self, header: BatchHeader) -> None:
        """A batch must carry this producer's id (:attr:`header_id`), name and schema: the
        broker stores the batch's header as the records' producer and schema.

        Raises:
            MalformedRequestError: a field differs.
        """
        schema_id = self.schema.schema_id if self.schema else 0
        schema_version = self.schema.version if self.schema else 0
        got = (header.producer_id, header.producer_name, header.schema_id, header.schema_version)
        want = (self.header_id, self.name, schema_id, schema_version)
        if got != want:
            raise MalformedRequestError(
                f"record batch: producer id, name, schema id and version are {got}, this producer's are {want}"
            )

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
