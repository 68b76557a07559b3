"""The admin verbs on sealed WAL segments: list and seal them, apply the local retention, find
the segments brokers kept after releasing a topic, and read a segment's bytes.

Each function does the work of the :class:`~danube_pipeline.client.admin.AdminClient` method of
the same name, whose docstring tells its arguments, answer and errors.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from danube_pipeline.client._connection import Stubs
from danube_pipeline.client._context import Context
from danube_pipeline.client.status import rpc_errors
from danube_pipeline.client.types import LocalRetentionResult, SegmentInfo, _segment_info_from_pb
from danube_pipeline.errors import CorruptRecordError, DanubeError
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb


async def list_sealed_segments(ctx: Context, topic: str) -> list[SegmentInfo]:
    """``Admin.ListSealedSegments`` on the topic's owner."""
    path = TopicName.parse(topic).path

    async def call(stubs: Stubs) -> list[SegmentInfo]:
        response = await stubs.admin.ListSealedSegments(
            pb.ListSealedSegmentsRequest(topic=path), timeout=ctx.request_timeout_s
        )
        return [_segment_info_from_pb(s) for s in response.segments]

    return await ctx.call_owner(path, call)


async def seal_active_segment(ctx: Context, topic: str) -> SegmentInfo | None:
    """``Admin.SealActiveSegment`` on the topic's owner."""
    path = TopicName.parse(topic).path

    async def call(stubs: Stubs) -> SegmentInfo | None:
        response = await stubs.admin.SealActiveSegment(
            pb.SealActiveSegmentRequest(topic=path), timeout=ctx.request_timeout_s
        )
        return _segment_info_from_pb(response.segment) if response.sealed else None

    return await ctx.call_owner(path, call)


async def apply_local_retention(
    ctx: Context, topic: str, *, retention_bytes: int | None, retention_ms: int | None
) -> LocalRetentionResult:
    """``Admin.ApplyLocalRetention`` on the topic's owner."""
    path = TopicName.parse(topic).path
    request = pb.ApplyLocalRetentionRequest(topic=path)
    if retention_bytes is not None:
        request.retention_bytes = retention_bytes
    if retention_ms is not None:
        request.retention_ms = retention_ms

    async def call(stubs: Stubs) -> LocalRetentionResult:
        r = await stubs.admin.ApplyLocalRetention(request, timeout=ctx.request_timeout_s)
        return LocalRetentionResult(r.deleted_segments, r.deleted_bytes, r.first_local_offset, r.wal_bytes)

    return await ctx.call_owner(path, call)


async def list_released_segments(ctx: Context, topic: str) -> list[tuple[str, SegmentInfo]]:
    """``Admin.ListSealedSegments`` of released segments, on every registered broker."""
    path = TopicName.parse(topic).path
    cluster = await ctx.metadata.refresh()
    found: list[tuple[str, SegmentInfo]] = []
    for broker in cluster.brokers:
        stubs = ctx.pool.stubs(broker.address)
        try:
            with rpc_errors(broker.address):
                response = await stubs.admin.ListSealedSegments(
                    pb.ListSealedSegmentsRequest(topic=path, released=True), timeout=ctx.request_timeout_s
                )
        except DanubeError:  # a broker that cannot answer holds nothing we can read now
            continue
        found.extend((broker.address, _segment_info_from_pb(seg)) for seg in response.segments)
    return sorted(found, key=lambda pair: pair[1].start_offset)


async def read_segment(
    ctx: Context, topic: str, start_offset: int, *, address: str | None
) -> AsyncGenerator[bytes, None]:
    """``Admin.ReadSegment`` from the owner (or the broker at ``address``), checking that chunks are contiguous."""
    path = TopicName.parse(topic).path
    broker_address = address if address is not None else (await ctx.metadata.lookup(path)).address
    stubs = ctx.pool.stubs(broker_address)
    call = stubs.admin.ReadSegment(
        pb.ReadSegmentRequest(topic=path, start_offset=start_offset, released=address is not None),
        timeout=None,
    )
    where = f"segment {start_offset} of {path}"
    expected = 0
    try:
        with rpc_errors(broker_address):
            async for chunk in call:
                if chunk.position != expected:
                    raise CorruptRecordError(
                        where, chunk.position, f"chunk at byte {chunk.position}, expected byte {expected}"
                    )
                expected += len(chunk.data)
                yield bytes(chunk.data)
    except DanubeError as exc:
        if exc.invalid_metadata:
            ctx.metadata.invalidate(path)
        raise
    finally:
        call.cancel()
