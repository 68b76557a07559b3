"""The admin verbs on topics and their subscriptions: list, look up, describe, unload and delete
topics, reset a subscription's cursor, abandon an unavailable range, set the schema policy.

Each function does the work of the :class:`~danube_pipeline.client.admin.AdminClient` method of
the same name, whose docstring tells its arguments, answer and errors: a per-topic call goes to
the topic's owner through :meth:`Context.call_owner
<danube_pipeline.client._context.Context.call_owner>` (retried there after a refresh when the
broker answers with an ``invalid_metadata`` error).
"""

from __future__ import annotations

from danube_pipeline.client._connection import Stubs
from danube_pipeline.client._context import Context
from danube_pipeline.client.status import rpc_errors
from danube_pipeline.client.types import (
    TopicDescription,
    TopicInfo,
    TopicSchemaPolicy,
    _topic_description_from_pb,
    _topic_info_from_pb,
)
from danube_pipeline.errors import MalformedRequestError, PartitionedTopicError
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.proto import danube_pb2 as pb


async def topic_partitions(ctx: Context, topic: str) -> int:
    """The partition count from a lookup: a partitioned topic answers with its count."""
    path = TopicName.parse(topic).path
    try:
        await ctx.metadata.lookup(path)
    except PartitionedTopicError as exc:
        return exc.partitions
    return 0


async def list_topics(ctx: Context, namespace: str) -> list[TopicInfo]:
    """``Admin.ListTopics`` on every known broker; the answers merged by topic."""
    if namespace:
        validate_part("namespace", namespace)
    if not ctx.metadata.brokers:
        await ctx.metadata.refresh()
    merged: dict[str, TopicInfo] = {}
    for broker in ctx.metadata.ordered_brokers():
        stubs = ctx.pool.stubs(broker.address)
        with rpc_errors(broker.address):
            response = await stubs.admin.ListTopics(
                pb.ListTopicsRequest(namespace=namespace), timeout=ctx.request_timeout_s
            )
        for t in response.topics:
            info = _topic_info_from_pb(t)
            seen = merged.get(info.topic)
            if seen is None or (info.next_offset, info.wal_syncs) > (seen.next_offset, seen.wal_syncs):
                merged[info.topic] = info
    return [merged[name] for name in sorted(merged)]


async def describe_topic(ctx: Context, topic: str) -> TopicDescription:
    """``Admin.DescribeTopic`` on the topic's owner."""
    path = TopicName.parse(topic).path

    async def call(stubs: Stubs) -> TopicDescription:
        response = await stubs.admin.DescribeTopic(pb.DescribeTopicRequest(topic=path), timeout=ctx.request_timeout_s)
        return _topic_description_from_pb(response)

    return await ctx.call_owner(path, call)


async def unload_topic(ctx: Context, topic: str) -> int:
    """``Admin.UnloadTopic`` on the topic's owner, then forget where the topic was."""
    path = TopicName.parse(topic).path

    async def call(stubs: Stubs) -> int:
        response = await stubs.admin.UnloadTopic(pb.UnloadTopicRequest(topic=path), timeout=ctx.request_timeout_s)
        return int(response.next_offset)

    next_offset = await ctx.call_owner(path, call)
    ctx.metadata.invalidate(path)
    return next_offset


async def delete_topic(ctx: Context, topic: str, *, force: bool) -> list[str]:
    """``Admin.DeleteTopic`` on the topic's owner (any broker for a partitioned topic)."""
    path = TopicName.parse(topic).path
    request = pb.DeleteTopicRequest(topic=path, force=force)

    async def call(stubs: Stubs) -> list[str]:
        response = await stubs.admin.DeleteTopic(request, timeout=ctx.request_timeout_s)
        return list(response.deleted)

    try:
        deleted = await ctx.call_owner(path, call)
    except PartitionedTopicError:  # no owner: any broker deletes it, partition by partition
        deleted = await ctx.call_any(call)
    ctx.metadata.invalidate(path)
    for partition in deleted:
        ctx.metadata.invalidate(partition)
    return deleted


async def reset_cursor(
    ctx: Context,
    topic: str,
    subscription: str,
    *,
    offset: int | None,
    earliest: bool,
    latest: bool,
    timestamp_ms: int | None,
) -> int:
    """Check the one position given, then ``Admin.ResetCursor`` on the topic's owner."""
    path = TopicName.parse(topic).path
    validate_part("subscription", subscription)
    given = sum((offset is not None, earliest, latest, timestamp_ms is not None))
    if given != 1:
        raise MalformedRequestError(
            f"give exactly one position (offset, earliest, latest or timestamp_ms), got {given}"
        )
    request = pb.ResetCursorRequest(topic=path, subscription=subscription)
    if offset is not None:
        if offset < 0:
            raise MalformedRequestError(f"offset must not be negative, got {offset}")
        request.offset = offset
    elif timestamp_ms is not None:
        if timestamp_ms < 0:
            raise MalformedRequestError(f"timestamp_ms must not be negative, got {timestamp_ms}")
        request.timestamp_ms = timestamp_ms
    elif earliest:
        request.earliest = True
    else:
        request.latest = True

    async def call(stubs: Stubs) -> int:
        response = await stubs.admin.ResetCursor(request, timeout=ctx.request_timeout_s)
        return int(response.next_offset)

    return await ctx.call_owner(path, call)


async def abandon_unavailable_range(ctx: Context, topic: str, start_offset: int) -> int:
    """``Admin.AbandonUnavailableRange`` on the topic's owner."""
    path = TopicName.parse(topic).path

    async def call(stubs: Stubs) -> int:
        response = await stubs.admin.AbandonUnavailableRange(
            pb.AbandonUnavailableRangeRequest(topic=path, start_offset=start_offset),
            timeout=ctx.request_timeout_s,
        )
        return int(response.skipped)

    return await ctx.call_owner(path, call)


async def set_topic_schema_policy(ctx: Context, topic: str, *, allow_raw: bool) -> list[TopicSchemaPolicy]:
    """``Admin.SetTopicSchemaPolicy`` on any broker."""
    path = TopicName.parse(topic).path

    async def call(stubs: Stubs) -> list[TopicSchemaPolicy]:
        response = await stubs.admin.SetTopicSchemaPolicy(
            pb.SetTopicSchemaPolicyRequest(topic=path, allow_raw=allow_raw), timeout=ctx.request_timeout_s
        )
        return [TopicSchemaPolicy(p.topic, p.subject, p.allow_raw) for p in response.policies]

    return await ctx.call_any(call)
