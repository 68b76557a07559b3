"""``danube-admin subscriptions``: subscriptions and their cursors (``docs/etcd-layout.md`` §3.4, §3.5).

Verbs and the JSON each prints:

``subscriptions list /NS/TOPIC``
    ``{"topic": str, "owner_answered": bool, "subscriptions": [{"name": str, "type": str |
    null, "active_consumer_id": int | null, "consumer_name": str | null, "stored_cursor": int |
    null, "loaded": bool, "cursor": int | null, "read_position": int | null, "consumers": int |
    null, "records_from_object_storage": int | null, "records_from_table": int | null,
    "skipped_below_retention": int | null}]}``:
    the subscription keys (§3.4) and stored cursors (§3.5) from etcd, merged with the loaded
    state ``Admin.DescribeTopic`` reports (``cursor`` is the live one; it runs ahead of the
    stored cursor between flushes). When the owner cannot be reached, ``owner_answered`` is
    false, a ``warning:`` line goes to stderr and the etcd part is still printed.
``subscriptions reset-cursor /NS/TOPIC SUBSCRIPTION (--offset N | --earliest | --latest | --timestamp T)``
    ``{"topic": str, "subscription": str, "position": {"offset": int} | {"earliest": true} |
    {"latest": true} | {"timestamp_ms": int}, "next_offset": int}``: the owner drops the
    subscription's unacknowledged deliveries and delivers from ``next_offset`` on; the stored
    cursor (§3.5) becomes ``next_offset - 1``. ``T`` is milliseconds since the Unix epoch or an
    ISO 8601 time (UTC when it has no offset). Exactly one position, else exit 2.
"""

from __future__ import annotations

import datetime
from typing import Any

import click

from danube_pipeline.admin.arguments import parse_topic
from danube_pipeline.admin.config import Config, danube_client, metadata_store, run
from danube_pipeline.admin.output import Json, as_int, emit, subscription_type_name, table
from danube_pipeline.errors import BrokerUnavailableError, InvalidNameError, TopicNotFoundError
from danube_pipeline.metadata import keys
from danube_pipeline.names import TopicName, validate_part


@click.group(short_help="Subscriptions and their cursors.")
def subscriptions() -> None:
    """Subscriptions and their cursors (docs/etcd-layout.md §3.4, §3.5): list, reset-cursor.

    Deleting a subscription is not available yet.
    """


async def _subscriptions_list(cfg: Config, topic: TopicName) -> Json:
    prefix = keys.topic_root(topic) + "/subscriptions/"
    async with metadata_store(cfg) as store:
        if await store.get(keys.topic_root(topic)) is None:
            raise TopicNotFoundError(topic.path)  # what a broker answers without a root (§3.1)
        kvs, _ = await store.get_prefix(prefix)
    stored: dict[str, Json] = {}
    for kv in kvs:
        name, _, tail = kv.key[len(prefix) :].partition("/")
        entry = stored.setdefault(name, {"metadata": None, "cursor": None})
        if tail == "":
            entry["metadata"] = kv.value if isinstance(kv.value, dict) else None
        elif tail == "cursor":
            entry["cursor"] = as_int(kv.value)
    loaded: dict[str, Any] = {}
    answered = True
    try:
        async with danube_client(cfg) as client:
            description = await client.admin.describe_topic(topic.path)
        loaded = {s.name: s for s in description.subscriptions}
    except BrokerUnavailableError as exc:
        answered = False
        click.echo(f"warning: the owner of {topic.path} did not answer ({exc}); showing etcd only", err=True)
    rows = []
    for name in sorted(set(stored) | set(loaded)):
        meta = stored.get(name, {}).get("metadata") or {}
        live = loaded.get(name)
        rows.append(
            {
                "name": name,
                "type": live.subscription_type.name.capitalize() if live else subscription_type_name(meta.get("subscription_type")),
                "active_consumer_id": as_int(meta.get("consumer_id")),
                "consumer_name": meta.get("consumer_name") if isinstance(meta.get("consumer_name"), str) else None,
                "stored_cursor": stored.get(name, {}).get("cursor"),
                "loaded": live is not None,
                "cursor": live.cursor if live else None,
                "read_position": live.read_position if live else None,
                "consumers": live.consumers if live else None,
                "records_from_object_storage": live.records_from_object_storage if live else None,
                "records_from_table": live.records_from_table if live else None,
                "skipped_below_retention": live.skipped_below_retention if live else None,
            }
        )
    return {"topic": topic.path, "owner_answered": answered, "subscriptions": rows}


@subscriptions.command("list")
@click.argument("topic", callback=parse_topic)
@click.pass_obj
def subscriptions_list(cfg: Config, topic: TopicName) -> None:
    """Every subscription of TOPIC from etcd (§3.4) with its stored cursor (§3.5), merged with
    the state its owner has loaded (live cursor, read position, consumers)."""
    doc = run(_subscriptions_list(cfg, topic))
    emit(
        cfg,
        doc,
        lambda d: table(
            ["SUBSCRIPTION", "TYPE", "STORED_CURSOR", "LOADED", "CURSOR", "READ_POSITION", "CONSUMERS"],
            [
                [s["name"], s["type"], s["stored_cursor"], s["loaded"], s["cursor"], s["read_position"], s["consumers"]]
                for s in d["subscriptions"]
            ],
        ),
    )


def _parse_subscription(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return validate_part("subscription", value)
    except InvalidNameError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _parse_timestamp(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """``--timestamp``: milliseconds since the Unix epoch, or an ISO 8601 time (UTC when it
    carries no offset), as milliseconds."""
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is neither milliseconds since the epoch nor an ISO 8601 time "
            "(e.g. 2026-01-31T12:00:00Z)", ctx=ctx, param=param
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    ms = int(moment.timestamp() * 1000)
    if ms < 0:
        raise click.BadParameter(f"{value!r} is before the Unix epoch", ctx=ctx, param=param)
    return ms


async def _reset_cursor(cfg: Config, topic: TopicName, subscription: str, position: Json) -> Json:
    async with danube_client(cfg) as client:
        next_offset = await client.admin.reset_cursor(topic.path, subscription, **position)
    return {"topic": topic.path, "subscription": subscription, "position": position, "next_offset": next_offset}


@subscriptions.command("reset-cursor")
@click.argument("topic", callback=parse_topic)
@click.argument("subscription", callback=_parse_subscription)
@click.option("--offset", type=click.IntRange(min=0), default=None, help="Deliver from this offset.")
@click.option("--earliest", is_flag=True, help="Deliver from the earliest offset (object storage included).")
@click.option("--latest", is_flag=True, help="Deliver only messages published from now on.")
@click.option(
    "--timestamp",
    callback=_parse_timestamp,
    default=None,
    help="Deliver from the first message published at or after this time: milliseconds since the "
    "epoch or ISO 8601 (UTC without an offset).",
)
@click.pass_obj
def subscriptions_reset_cursor(
    cfg: Config,
    topic: TopicName,
    subscription: str,
    offset: int | None,
    earliest: bool,
    latest: bool,
    timestamp: int | None,
) -> None:
    """Move SUBSCRIPTION of TOPIC to one position (exactly one of --offset, --earliest,
    --latest, --timestamp); its unacknowledged deliveries are dropped, and the stored cursor
    (§3.5) becomes the new offset - 1. Connected consumers subscribe again by themselves."""
    positions: list[Json] = []
    if offset is not None:
        positions.append({"offset": offset})
    if earliest:
        positions.append({"earliest": True})
    if latest:
        positions.append({"latest": True})
    if timestamp is not None:
        positions.append({"timestamp_ms": timestamp})
    if len(positions) != 1:
        raise click.UsageError(
            f"give exactly one of --offset, --earliest, --latest, --timestamp ({len(positions)} given)"
        )
    doc = run(_reset_cursor(cfg, topic, subscription, positions[0]))
    emit(
        cfg,
        doc,
        lambda d: f"subscription {d['subscription']} of {d['topic']} now delivers from offset {d['next_offset']}",
    )
