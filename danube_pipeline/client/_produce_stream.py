"""One ``ProduceStream`` call per broker, shared by every producer of the client on that broker.

Each producer sends on a **lane** of the stream (``SendBatchRequest.stream_id``): the broker
appends a lane's batches in order, answers them in order, and appends nothing more of a lane
after one of its batches failed (``broker/rpc/produce_stream.py``). The batches that producers
hand over while a write is under way go out together in the next request, so the gRPC cost of a
message (a read, a write, their task switches on both sides) is paid per request, not per batch:
with thousands of topics every batch may hold one message.

What a producer does when its lane fails is decided by the producer
(:meth:`danube_pipeline.client._send_stream.BatchSender._stream_failed`); a failure of the whole
stream (the broker gone, the connection cut) is handed to every lane open on it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import grpc

from danube_pipeline.client._connection import Stubs
from danube_pipeline.client._tasks import being_cancelled, cancel_and_wait
from danube_pipeline.client.status import from_rpc_error, unavailable
from danube_pipeline.errors import DanubeError, StreamEndedError
from danube_pipeline.proto import danube_pb2 as pb

log = logging.getLogger("danube_pipeline.client.producer")

Answered = Callable[[pb.SendBatchResponse], None]
"""Called with each answer of a lane, in order."""
Failed = Callable[[DanubeError], None]
"""Called once if the whole stream fails while the lane is open."""


class ProduceStream:
    """The client's ``ProduceStream`` to one broker (module docstring).

    Args:
        stubs: the broker's stubs; the stream lives on their channel.
        on_end: called once when the stream ended (to stop handing it out).

    Attributes:
        stubs: as given.
        ended: why the stream ended; ``None`` while it runs.
    """

    def __init__(self, stubs: Stubs, on_end: Callable[[ProduceStream], None]) -> None:
        self.stubs = stubs
        self.ended: DanubeError | None = None
        self._on_end = on_end
        self._call: grpc.aio.StreamStreamCall = stubs.producer.ProduceStream()
        self._lanes: dict[int, tuple[Answered, Failed]] = {}
        self._ids = itertools.count(1)
        self._outbox: list[pb.SendBatchRequest] = []
        self._outbox_written: asyncio.Future[None] | None = None  # resolved once it went out
        self._closed_lanes: list[int] = []
        self._wakeup = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write())
        self._reader = loop.create_task(self._read())

    def open_lane(self, answered: Answered, failed: Failed) -> int:
        """A new lane; its answers go to ``answered``, a failure of the stream to ``failed``.

        Returns:
            The lane's id (``SendBatchRequest.stream_id``).
        """
        stream_id = next(self._ids)
        self._lanes[stream_id] = (answered, failed)
        return stream_id

    def close_lane(self, stream_id: int) -> None:
        """Stop routing the lane's answers (later ones are dropped) and tell the broker."""
        if self._lanes.pop(stream_id, None) is not None and self.ended is None:
            self._closed_lanes.append(stream_id)
            self._wakeup.set()

    def send(self, request: pb.SendBatchRequest) -> asyncio.Future[None]:
        """Queue one batch (its ``stream_id`` set) for the next request.

        Returns:
            A future resolved once that request is written (or the stream ended). A producer
            waits for it before it closes its next batch, so that batches grow while the
            connection is busy, as they did when each producer wrote its own stream. The
            producers' in-flight limits bound what is queued.
        """
        self._outbox.append(request)
        self._wakeup.set()
        written = self._outbox_written
        if written is None:
            written = self._outbox_written = asyncio.get_running_loop().create_future()
        return written

    async def close(self) -> None:
        """End the stream and its tasks; open lanes are not told (their producers closed)."""
        self._lanes.clear()
        self._end(unavailable(self.stubs.address, "ProduceStream closed"))
        await cancel_and_wait(self._writer, self._reader)

    def _end(self, exc: DanubeError) -> None:
        if self.ended is not None:
            return
        self.ended = exc
        self._on_end(self)
        self._call.cancel()
        self._writer.cancel()
        self._release()
        lanes, self._lanes = self._lanes, {}
        for _answered, failed in lanes.values():
            failed(exc)

    def _release(self, written: asyncio.Future[None] | None = None) -> None:
        """Resolve ``written`` (default: the waiting outbox's future)."""
        if written is None:
            written, self._outbox_written = self._outbox_written, None
        if written is not None and not written.done():
            written.set_result(None)

    async def _write(self) -> None:
        call = self._call
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._outbox and not self._closed_lanes:
                continue
            request = pb.ProduceRequest(batches=self._outbox, closed_streams=self._closed_lanes)
            written, self._outbox_written = self._outbox_written, None
            self._outbox, self._closed_lanes = [], []
            try:
                await call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                # The call has ended: the reader reports why (the broker's answers, then the
                # call's status). A failed write can also make gRPC replace that status with its
                # own INTERNAL "Internal error from Core" (grpc/grpc#36066), so it is not
                # reported here.
                log.debug("ProduceStream to %s: write failed: %s", self.stubs.address, exc)
                self._release()
                return
            finally:
                self._release(written)

    async def _read(self) -> None:
        address = self.stubs.address
        call = self._call
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    self._end(StreamEndedError(address, "ProduceStream"))
                    return
                lanes = self._lanes
                for result in response.results:
                    lane = lanes.get(result.stream_id)
                    if lane is not None:
                        lane[0](result)
        except grpc.aio.AioRpcError as exc:
            self._end(from_rpc_error(exc, address))
        except asyncio.CancelledError:
            if being_cancelled():
                raise
            self._end(unavailable(address, "ProduceStream cancelled"))


class ProduceStreams:
    """The client's produce streams, one per broker address (module docstring)."""

    def __init__(self) -> None:
        self._streams: dict[str, ProduceStream] = {}

    def get(self, stubs: Stubs) -> ProduceStream:
        """The running stream on ``stubs``' channel, opened if there is none."""
        stream = self._streams.get(stubs.address)
        if stream is None or stream.stubs is not stubs or stream.ended is not None:
            stream = self._streams[stubs.address] = ProduceStream(stubs, self._ended)
        return stream

    def _ended(self, stream: ProduceStream) -> None:
        if self._streams.get(stream.stubs.address) is stream:
            del self._streams[stream.stubs.address]

    async def close(self) -> None:
        """End every stream."""
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            await stream.close()
