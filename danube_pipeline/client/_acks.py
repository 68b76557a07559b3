"""A consumer's acknowledgements: acks buffered and sent in one ``Ack`` call (every
``ack_batch_size`` acks, every ``ack_flush_ms`` and on close), nacks sent at once, and what the
broker's refusal of either means.

The broker takes an ack only from the consumer the message was delivered to: an ack it refuses
(:class:`~danube_pipeline.errors.InvalidAckError`) is logged and dropped, and the message is
delivered again (at least once).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from danube_pipeline.client._connection import Stubs
from danube_pipeline.client._context import Context
from danube_pipeline.client._redelivery import offset_ranges
from danube_pipeline.client.status import rpc_errors
from danube_pipeline.client.types import Message
from danube_pipeline.errors import ConsumerNotFoundError, DanubeError, InvalidAckError
from danube_pipeline.proto import danube_pb2 as pb

# The facade's logger: users configure one logger per public module.
log = logging.getLogger("danube_pipeline.client.consumer")

_MAX_REFUSED_ACK_ROUNDS = 16
"""An ``Ack`` refused with :class:`InvalidAckError` is sent again without the refused offsets,
at most this many times per flush (the rest are then dropped: the broker redelivers them)."""


def reconnectable(exc: DanubeError) -> bool:
    """Whether subscribing again recovers from ``exc``: a ``retriable`` or
    ``invalid_metadata`` error, or :class:`ConsumerNotFoundError`."""
    # ConsumerNotFoundError: the broker forgot our consumer (restart); subscribing again fixes it.
    return exc.retriable or exc.invalid_metadata or isinstance(exc, ConsumerNotFoundError)


class AckTarget(Protocol):
    """Where acks and nacks go: the consumer on the broker that delivered the messages."""

    @property
    def stubs(self) -> Stubs | None:
        """The broker's stubs; ``None`` before the first ``Subscribe``."""
        ...

    @property
    def consumer_id(self) -> int:
        """The broker-assigned consumer id."""
        ...


class AckBuffer:
    """The acks of one consumer of a plain topic (or of one partition) not sent yet.

    Args:
        ctx: the client's shared context.
        consumer_name: the consumer's name (for the log).
        target: the consumer on the broker, read at each send (it changes on re-subscribe).
        ack_batch_size: acks buffered before they are sent.
        ack_flush_ms: how often buffered acks are sent anyway, in milliseconds.
    """

    def __init__(
        self, ctx: Context, consumer_name: str, target: AckTarget, *, ack_batch_size: int, ack_flush_ms: int
    ) -> None:
        self._ctx = ctx
        self._consumer_name = consumer_name
        self._target = target
        self._ack_batch_size = ack_batch_size
        self._ack_flush_s = ack_flush_ms / 1000
        self._acks: list[int] = []
        self._ack_lock = asyncio.Lock()
        self._ack_error: DanubeError | None = None

    async def add(self, offset: int) -> None:
        """Buffer the ack of ``offset``; send the buffer once it holds ``ack_batch_size`` acks.

        Raises:
            DanubeError: an earlier flush was refused with a non-retriable error.
        """
        error, self._ack_error = self._ack_error, None
        if error is not None:
            raise error
        self._acks.append(offset)
        if len(self._acks) >= self._ack_batch_size:
            await self.flush_quietly()

    def take_error(self) -> DanubeError | None:
        """The non-retriable refusal of a background flush not raised yet, if any (and forget it)."""
        error, self._ack_error = self._ack_error, None
        return error

    async def nack(self, message: Message, reason: str) -> None:
        """Send the nack of ``message`` at once (see :meth:`Consumer.nack
        <danube_pipeline.client.consumer.Consumer.nack>`).

        Raises:
            InvalidAckError: the message is not this consumer's to nack; nothing changed.
            DanubeError: another refusal from the broker. A nack lost to a broken connection
                is not raised: the broker redelivers every message of the old stream.
        """
        stubs = self._target.stubs
        assert stubs is not None
        request = pb.NackRequest(
            consumer_id=self._target.consumer_id,
            ranges=[pb.OffsetRange(first=message.offset, last=message.offset)],
            reason=reason,
        )
        try:
            with rpc_errors(stubs.address):
                await stubs.consumer.Nack(request, timeout=self._ctx.request_timeout_s)
        except DanubeError as exc:
            if not reconnectable(exc) or isinstance(exc, InvalidAckError):
                raise
            log.info("consumer %s: nack of %d not sent (%s); the broker redelivers it", self._consumer_name,
                     message.offset, exc)

    async def flush(self) -> None:
        """Send every buffered ack in one ``Ack`` call (again without the offsets the broker
        refused, at most ``_MAX_REFUSED_ACK_ROUNDS`` times).

        Raises:
            DanubeError: the broker could not be reached or refused the acks; after a
                retriable error the acks stay buffered (sent again after the re-subscribe).
        """
        async with self._ack_lock:
            offsets, self._acks = self._acks, []
            if not offsets:
                return
            stubs = self._target.stubs
            assert stubs is not None
            try:
                for _ in range(_MAX_REFUSED_ACK_ROUNDS):
                    try:
                        with rpc_errors(stubs.address):
                            await stubs.consumer.Ack(
                                pb.AckRequest(consumer_id=self._target.consumer_id, ranges=offset_ranges(offsets)),
                                timeout=self._ctx.request_timeout_s,
                            )
                        break
                    except InvalidAckError as refused:
                        # Not ours to ack any more (redelivered elsewhere after a re-subscribe,
                        # or acked already by a flush the broker applied before it was
                        # cancelled): the broker applied nothing; send the rest without them.
                        log.info("consumer %s: %s", self._consumer_name, refused)
                        offsets = [o for o in offsets if not refused.first_offset <= o <= refused.last_offset]
                        if not offsets:
                            break
                else:
                    log.info("consumer %s: %d acks dropped after %d refusals (redelivered)",
                             self._consumer_name, len(offsets), _MAX_REFUSED_ACK_ROUNDS)
            except DanubeError as exc:
                if reconnectable(exc):
                    self._acks[:0] = offsets  # sent again after the re-subscribe
                raise
            except asyncio.CancelledError:
                # close() (or a re-subscribe) cancelled the flush mid-RPC: keep the offsets so the
                # next flush sends them. If the broker applied them, it refuses the repeat and they are dropped.
                self._acks[:0] = offsets
                raise

    async def flush_quietly(self) -> None:
        """:meth:`flush`, keeping a non-retriable refusal for the next :meth:`add` or close."""
        try:
            await self.flush()
        except DanubeError as exc:
            if reconnectable(exc):
                log.info("consumer %s: ack flush deferred: %s", self._consumer_name, exc)
            else:
                self._ack_error = exc

    async def run(self) -> None:
        """Send the buffered acks every ``ack_flush_ms``, until cancelled."""
        while True:
            await asyncio.sleep(self._ack_flush_s)
            await self.flush_quietly()

    async def drop_unsent(self) -> None:
        """Forget the buffered acks on a re-subscribe: they were delivered to the old consumer,
        which is gone, so the broker refuses them from the new one and redelivers those
        messages."""
        async with self._ack_lock:
            if self._acks:
                log.info("consumer %s: %d unsent acks dropped on re-subscribe (redelivered)",
                         self._consumer_name, len(self._acks))
                self._acks = []
