"""``danube-admin topics``: create, list, describe, unload and delete topics (``docs/etcd-layout.md`` §3).

Verbs and the JSON each prints (``owner`` objects are ``{"broker_id": int, "address": "host:port"}``):

``topics create /NS/TOPIC [--delivery Reliable|NonReliable] [--partitions N]``
    ``{"topic": str, "created": bool, "requested_delivery": str, "owner": owner}``; an existing
    topic keeps its own delivery mode (§3.2). With ``--partitions N`` (1 to 100) a partitioned
    topic: its root holds N (§3.1) and its partitions ``TOPIC-part-{i}`` are topics of their
    own, each assigned an owner; the document is then ``{"topic": str, "created": bool,
    "requested_delivery": str, "partitions": int, "partition_topics": [{"topic": str,
    "owner": owner}]}`` (an existing topic keeps its own partition count).
``topics list [NS] [--namespace NS]``
    ``{"topics": [{"topic": str, "owner": owner | null, "delivery": str, "next_offset": int |
    null, "sealed_segments": int | null, "wal_syncs": int | null}]}``: every topic root in etcd
    (§3.1) with its assignment (§1.4) and delivery mode (§3.2), merged with what the brokers
    report for the topics they have loaded (``Admin.ListTopics``; nulls when none has it loaded).
``topics describe /NS/TOPIC``
    ``{"topic": str, "owner": owner, "delivery": str, "table": str, "schema_subject": str | null,
    "producers": [{"producer_id": int, "producer_name": str}], "committed_end_offset": int | null,
    "committed_at_ms": int | null, "tiering_lag_offsets": int | null,
    "next_offset": int,
    "first_local_offset": int, "wal_bytes": int, "sealed_segments": int, "remote_first_offset":
    int | null, "remote_end_offset": int | null, "earliest_offset": int, "cache_bytes": int,
    "subscriptions": [{"name": str, "type": str, "cursor": int | null, "read_position": int,
    "consumers": int, "records_from_object_storage": int, "records_from_table": int,
    "skipped_below_retention": int}]}``:
    the owner from a lookup; ``table`` the Iceberg table the topic is committed to (a
    partition's is its topic's); the schema subject (§3.7) and the open producers (§3.3) from
    etcd; ``committed_end_offset`` and ``committed_at_ms`` the table's last commit for the topic
    as tiering recorded it (§5.8; ``null`` before the first); ``tiering_lag_offsets`` the
    offsets handed out that object storage does not hold yet
    (``null`` for a NonReliable topic, never tiered); the rest from ``Admin.DescribeTopic`` (WAL,
    object storage §5.1, loaded subscriptions). A partitioned topic (§3.1) has no owner or WAL of its own:
    ``{"topic": str, "partitions": int, "delivery": str, "table": str, "partition_topics": [{"topic": str,
    "owner": owner, "next_offset": int}]}``, each partition described by its owner.
``topics unload /NS/TOPIC``
    ``{"topic": str, "previous_owner": owner, "next_offset": int, "owner": owner}``: the owner
    releases the topic (§1.5, §5.3); ``next_offset`` is the first offset the next owner hands
    out, ``owner`` the owner a lookup finds afterwards.
``topics delete /NS/TOPIC [--force]``
    ``{"topic": str, "force": bool, "deleted": [str]}``: the topic's owner deletes it with its
    etcd keys (§1.4, §1.5, §2.2, §3, §5), its WAL and its segment objects; a partitioned topic
    is deleted partition by partition (``deleted`` lists the partitions). No confirmation is
    asked. Refused (exit 1) while producers or consumers are connected, unless ``--force``
    (they are closed). The Iceberg table is kept.
``topics stats /NS/TOPIC [--interval-s S] [--json]``
    rates, backlog per subscription and storage per tier; the document is described in
    :mod:`danube_pipeline.admin.stats`.
``topics set-table-layout /NS/TOPIC [--partition-by T] [--raw-payload | --no-raw-payload]``
    ``{"topic": str, "key": str, "revision": int, "partition_transform": str, "raw_payload": bool}``:
    the table layout (§3.9) after the change; fields not given keep their stored value.
``topics set-read-path /NS/TOPIC objects|iceberg|auto``
    ``{"topic": str, "cold_read_path": str, "keys": [str], "revision": int}``: where the topic's
    subscriptions read offsets below the local WAL (§3.10); a partitioned topic's partitions are
    each written too (``keys`` lists every key written, in one transaction).
``topics set-schema-policy /NS/TOPIC (--allow-raw | --no-allow-raw)``
    ``{"topic": str, "policies": [{"topic": str, "subject": str, "allow_raw": bool}]}``: whether
    producers without a schema may publish to the topic once it has a schema subject
    (``Admin.SetTopicSchemaPolicy`` on any broker, §3.7); a partitioned topic's partitions are
    each written (``policies`` lists them). ``subject`` is empty until a producer with a schema
    was created on the topic.
"""

from __future__ import annotations

import contextlib
import dataclasses

import click

from danube_pipeline.admin import stats
from danube_pipeline.admin.arguments import parse_namespace, parse_topic
from danube_pipeline.admin.config import AdminError, Config, danube_client, metadata_store, run
from danube_pipeline.admin.output import Json, emit, owner_json, owner_text, table
from danube_pipeline.admin.read_path import topics_set_read_path
from danube_pipeline.admin.topic_text import describe_text
from danube_pipeline.client import DanubeClient, DeliveryMode
from danube_pipeline.metadata import keys
from danube_pipeline import settings
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.schema_values import TopicSchema
from danube_pipeline.metadata.values import PARTITION_TRANSFORMS, ProducerMetadata, TableCommit, TableLayout
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import MAX_PARTITIONS, partition_names, partition_of


@click.group(short_help="Create, list, describe, unload and delete topics.")
def topics() -> None:
    """Topics: create, list, describe, unload, delete (docs/etcd-layout.md §3)."""


topics.add_command(topics_set_read_path)


async def _topics_create(cfg: Config, topic: TopicName, delivery: str, partitions: int = 0) -> Json:
    async with danube_client(cfg) as client:
        created = await client.admin.create_topic(topic.path, delivery=DeliveryMode(delivery), partitions=partitions)
        count = await client.admin.topic_partitions(topic.path)
        if count:
            return {
                "topic": topic.path,
                "created": created,
                "requested_delivery": delivery,
                "partitions": count,
                "partition_topics": [
                    {"topic": p.path, "owner": owner_json(await client.lookup_topic(p.path))}
                    for p in partition_names(topic, count)
                ],
            }
        owner = await client.lookup_topic(topic.path)
    return {"topic": topic.path, "created": created, "requested_delivery": delivery, "owner": owner_json(owner)}


def _created_text(d: Json) -> str:
    what = f"partitioned topic {d['topic']}" if "partitions" in d else f"topic {d['topic']}"
    head = f"created {what} ({d['requested_delivery']})" if d["created"] else f"{what} already existed"
    if "partitions" not in d:
        return f"{head}; owner {owner_text(d['owner'])}"
    rows = table(["PARTITION", "OWNER"], [[p["topic"], owner_text(p["owner"])] for p in d["partition_topics"]])
    return f"{head}; {d['partitions']} partitions:\n{rows}"


@topics.command("create")
@click.argument("topic", callback=parse_topic)
@click.option(
    "--delivery",
    type=click.Choice([m.value for m in DeliveryMode]),
    default=DeliveryMode.RELIABLE.value,
    show_default=True,
    help="Delivery mode (§3.2); an existing topic keeps its own.",
)
@click.option(
    "--partitions",
    type=click.IntRange(1, MAX_PARTITIONS),
    default=None,
    help=f"Partitions of a partitioned topic (§3.1, 1 to {MAX_PARTITIONS}), named TOPIC-part-{{i}}; "
    "leave it out for a plain topic.",
)
@click.pass_obj
def topics_create(cfg: Config, topic: TopicName, delivery: str, partitions: int | None) -> None:
    """Create TOPIC (/namespace/topic); the leader assigns its owner (§1.4, §3.1), or each
    partition's owner with --partitions."""
    emit(cfg, run(_topics_create(cfg, topic, delivery, partitions or 0)), _created_text)


async def _topics_list(cfg: Config, namespace: str | None) -> Json:
    prefix = keys.TOPICS + "/" + (f"{namespace}/" if namespace else "")
    async with metadata_store(cfg) as store:
        topic_kvs, _ = await store.get_prefix(prefix)
        assignment_kvs, _ = await store.get_prefix(keys.BROKERS_PREFIX)
    roots: dict[str, str] = {}
    for kv in topic_kvs:
        parts = kv.key[len(keys.TOPICS) + 1 :].split("/")
        path = f"/{parts[0]}/{parts[1]}" if len(parts) >= 2 else None
        if path is None:
            continue
        if len(parts) == 2:
            roots.setdefault(path, DeliveryMode.RELIABLE.value)
        elif len(parts) == 3 and parts[2] == "delivery" and path in roots:
            roots[path] = DeliveryMode.from_stored(kv.value).value
    owner_ids: dict[str, int] = {}
    for kv in assignment_kvs:
        parts = kv.key[len(keys.BROKERS_PREFIX) :].split("/")
        if len(parts) == 3 and parts[0].isdigit():
            owner_ids[f"/{parts[1]}/{parts[2]}"] = int(parts[0])
    async with danube_client(cfg) as client:
        info = await client.admin.cluster_metadata()
        loaded = {t.topic: t for t in await client.admin.list_topics(namespace or "")}
    addresses = {b.broker_id: b.address for b in info.brokers}
    rows = []
    for path in sorted(set(roots) | set(loaded)):
        owner_id = owner_ids.get(path)
        stats = loaded.get(path)
        rows.append(
            {
                "topic": path,
                "owner": None if owner_id is None else {"broker_id": owner_id, "address": addresses.get(owner_id)},
                "delivery": roots.get(path, DeliveryMode.RELIABLE.value),
                "next_offset": stats.next_offset if stats else None,
                "sealed_segments": stats.sealed_segments if stats else None,
                "wal_syncs": stats.wal_syncs if stats else None,
            }
        )
    return {"topics": rows}


@topics.command("list")
@click.argument("namespace_argument", metavar="[NAMESPACE]", required=False, callback=parse_namespace)
@click.option("--namespace", callback=parse_namespace, default=None, help="Only this namespace (or give it as NAMESPACE).")
@click.pass_obj
def topics_list(cfg: Config, namespace_argument: str | None, namespace: str | None) -> None:
    """Every topic (§3.1), or NAMESPACE's, with its owner (§1.4), delivery mode (§3.2) and, when
    a broker has it loaded, its next offset, sealed segments and WAL syncs."""
    if namespace_argument is not None and namespace is not None and namespace_argument != namespace:
        raise click.UsageError(f"two namespaces given: {namespace_argument!r} and --namespace {namespace!r}")
    doc = run(_topics_list(cfg, namespace_argument or namespace))
    emit(
        cfg,
        doc,
        lambda d: table(
            ["TOPIC", "OWNER", "DELIVERY", "NEXT_OFFSET", "SEALED_SEGMENTS", "WAL_SYNCS"],
            [
                [t["topic"], owner_text(t["owner"]), t["delivery"], t["next_offset"], t["sealed_segments"], t["wal_syncs"]]
                for t in d["topics"]
            ],
        ),
    )


async def _describe_partitioned(cfg: Config, client: DanubeClient, topic: TopicName, partitions: int) -> Json:
    rows = []
    for p in partition_names(topic, partitions):
        owner = await client.lookup_topic(p.path)
        description = await client.admin.describe_topic(p.path)
        rows.append({"topic": p.path, "owner": owner_json(owner), "next_offset": description.next_offset})
    async with metadata_store(cfg) as store:
        delivery = await store.get(keys.topic_delivery(topic))
    return {
        "topic": topic.path,
        "partitions": partitions,
        "delivery": DeliveryMode.from_stored(delivery.value if delivery else None).value,
        "table": table_name(topic),
        "partition_topics": rows,
    }


def table_name(topic: TopicName) -> str:
    """The Iceberg table of ``topic`` (a plain or partitioned topic, not a partition):
    ``{catalog}.{ns}.{topic}``, the catalog named by ``DANUBE_CATALOG_NAME``."""
    return f"{settings.catalog_name()}.{topic.namespace}.{topic.topic}"


async def _table_commit(store: MetadataStore, topic: TopicName) -> TableCommit | None:
    """The topic's last commit to its table as tiering recorded it (§5.8), ``None`` before the
    first one (or an unreadable value)."""
    kv = await store.get(keys.table_commit(topic))
    if kv is None:
        return None
    try:
        return TableCommit.from_json(kv.value)
    except ValueError:
        return None


async def _schema_and_producers(store: MetadataStore, topic: TopicName) -> tuple[str | None, list[Json]]:
    """The topic's schema subject (§3.7; ``None`` while it has none) and its open producers
    (§3.3, ``status: true``), from etcd."""
    schema = await store.get(keys.topic_schema(topic))
    subject = None
    if schema is not None:
        with contextlib.suppress(ValueError):
            subject = TopicSchema.from_json(schema.value).subject or None
    kvs, _ = await store.get_prefix(keys.topic_producers_prefix(topic))
    producers = []
    for kv in kvs:
        with contextlib.suppress(ValueError):
            producer = ProducerMetadata.from_json(kv.value)
            if producer.status:
                producers.append({"producer_id": producer.producer_id, "producer_name": producer.producer_name})
    return subject, sorted(producers, key=lambda p: (p["producer_name"], p["producer_id"]))


def tiering_lag_offsets(next_offset: int, first_local_offset: int, remote_end_offset: int | None) -> int:
    """Offsets handed out that object storage does not hold yet: from past the last tiered
    offset (or the WAL's first offset when nothing is tiered) to ``next_offset - 1``."""
    tiered_to = first_local_offset if remote_end_offset is None else remote_end_offset + 1
    return max(0, next_offset - tiered_to)


async def _topics_describe(cfg: Config, topic: TopicName) -> Json:
    async with danube_client(cfg) as client:
        partitions = await client.admin.topic_partitions(topic.path)
        if partitions:
            return await _describe_partitioned(cfg, client, topic, partitions)
        owner = await client.lookup_topic(topic.path)
        description = await client.admin.describe_topic(topic.path)
    async with metadata_store(cfg) as store:
        delivery = await store.get(keys.topic_delivery(topic))
        subject, producers = await _schema_and_producers(store, topic)
        parent = await partition_of(store, topic)  # a partition's rows are in its topic's table
        commit = await _table_commit(store, topic)
    mode = DeliveryMode.from_stored(delivery.value if delivery else None)
    return {
        "topic": topic.path,
        "owner": owner_json(owner),
        "delivery": mode.value,
        "table": table_name(parent.parent if parent is not None else topic),
        "schema_subject": subject,
        "producers": producers,
        "committed_end_offset": commit.committed_end_offset if commit is not None else None,
        "committed_at_ms": commit.committed_at_ms if commit is not None else None,
        "tiering_lag_offsets": None  # kept in memory only, never tiered (§3.2)
        if mode is DeliveryMode.NON_RELIABLE
        else tiering_lag_offsets(description.next_offset, description.first_local_offset, description.remote_end_offset),
        "next_offset": description.next_offset,
        "first_local_offset": description.first_local_offset,
        "wal_bytes": description.wal_bytes,
        "sealed_segments": description.sealed_segments,
        "remote_first_offset": description.remote_first_offset,
        "remote_end_offset": description.remote_end_offset,
        "earliest_offset": description.earliest_offset,
        "cache_bytes": description.cache_bytes,
        "owner_epoch": description.owner_epoch,
        "reserved_end_offset": description.reserved_end_offset,
        "publish_throttled_ms": description.publish_throttled_ms,
        "dropped_messages": description.dropped_messages,
        "buffered_messages": description.buffered_messages,
        "buffered_bytes": description.buffered_bytes,
        "replicas": description.replicas,
        "isr": description.isr,
        "high_watermark": description.high_watermark,
        "followers": [
            {
                "broker_id": f.broker_id,
                "log_end_offset": f.log_end_offset,
                "lag": f.lag,
                "last_fetch_s": f.last_fetch_s,
                "in_sync": f.in_sync,
            }
            for f in description.followers
        ],
        "unavailable_ranges": [
            {
                "start_offset": u.start_offset,
                "end_offset": u.end_offset,
                "broker_id": u.broker_id,
                "since": u.since,
                "last_written": u.last_written,
                "abandoned": u.abandoned,
            }
            for u in description.unavailable_ranges
        ],
        "subscriptions": [
            {
                "name": s.name,
                "type": s.subscription_type.name.capitalize(),
                "cursor": s.cursor,
                "read_position": s.read_position,
                "consumers": s.consumers,
                "records_from_object_storage": s.records_from_object_storage,
                "records_from_table": s.records_from_table,
                "skipped_below_retention": s.skipped_below_retention,
                "skipped_unavailable": s.skipped_unavailable,
                "dispatch_throttled_ms": s.dispatch_throttled_ms,
            }
            for s in description.subscriptions
        ],
    }


@topics.command("describe")
@click.argument("topic", callback=parse_topic)
@click.pass_obj
def topics_describe(cfg: Config, topic: TopicName) -> None:
    """Where TOPIC's offsets live: owner, WAL, object storage (§5.1), loaded subscriptions."""
    emit(cfg, run(_topics_describe(cfg, topic)), describe_text)


@topics.command("stats")
@click.argument("topic", callback=parse_topic)
@click.option("--interval-s", type=click.FloatRange(0.1, 60.0), default=1.0, show_default=True,
              help="Seconds between the two scrapes of the owner's metrics the rates come from.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document (as the root --output json).")
@click.pass_obj
def topics_stats(cfg: Config, topic: TopicName, interval_s: float, as_json: bool) -> None:
    """TOPIC's rates (msg/s and bytes/s in and out, from two scrapes of its owner's /metrics),
    backlog per subscription and storage per tier: WAL, segment objects (§5.1), Iceberg (§5.8).
    A partitioned topic is measured partition by partition."""
    cfg = dataclasses.replace(cfg, output="json") if as_json else cfg
    emit(cfg, run(stats.topic_stats(cfg, topic, interval_s, table_name)), stats.topic_stats_text)


async def _topics_unload(cfg: Config, topic: TopicName) -> Json:
    async with danube_client(cfg) as client:
        previous = await client.lookup_topic(topic.path)
        next_offset = await client.admin.unload_topic(topic.path)
        owner = await client.lookup_topic(topic.path)
    return {"topic": topic.path, "previous_owner": owner_json(previous), "next_offset": next_offset, "owner": owner_json(owner)}


async def _topics_abandon_range(cfg: Config, topic: TopicName, start_offset: int) -> Json:
    async with danube_client(cfg) as client:
        skipped = await client.admin.abandon_unavailable_range(topic.path, start_offset)
    return {"topic": topic.path, "start_offset": start_offset, "skipped": skipped}


@topics.command("abandon-range")
@click.argument("topic", callback=parse_topic)
@click.argument("start_offset", type=click.IntRange(min=0))
@click.pass_obj
def topics_abandon_range(cfg: Config, topic: TopicName, start_offset: int) -> None:
    """Give up waiting for TOPIC's unavailable range starting at START_OFFSET (§5.5): its
    offsets not in object storage are skipped by subscriptions (counted) and by tiering. Use
    it when the failed broker's disk is lost for good."""
    doc = run(_topics_abandon_range(cfg, topic, start_offset))
    emit(cfg, doc, lambda d: f"abandoned the unavailable range of {d['topic']} at {d['start_offset']}: "
          f"{d['skipped']} offsets will never be delivered")


@topics.command("unload")
@click.argument("topic", callback=parse_topic)
@click.pass_obj
def topics_unload(cfg: Config, topic: TopicName) -> None:
    """Release TOPIC from its owner; the leader assigns it again, to another active broker
    when there is one (§1.5, §5.3). Prints the next owner's first offset and the new owner."""
    doc = run(_topics_unload(cfg, topic))
    emit(
        cfg,
        doc,
        lambda d: f"unloaded {d['topic']} from {owner_text(d['previous_owner'])}; "
        f"now owned by {owner_text(d['owner'])}, continuing at offset {d['next_offset']}",
    )


async def _topics_delete(cfg: Config, topic: TopicName, force: bool) -> Json:
    async with danube_client(cfg) as client:
        deleted = await client.admin.delete_topic(topic.path, force=force)
    return {"topic": topic.path, "force": force, "deleted": deleted}


@topics.command("delete")
@click.argument("topic", callback=parse_topic)
@click.option("--force", is_flag=True, help="Delete even with producers or consumers connected (they are closed).")
@click.pass_obj
def topics_delete(cfg: Config, topic: TopicName, force: bool) -> None:
    """Delete TOPIC, without asking: its etcd keys (§1.4, §1.5, §2.2, §3, §5), its WAL and its
    segment objects; a partitioned topic partition by partition. Its Iceberg table is kept.

    Refused while producers or consumers are connected, unless --force closes them (a client
    producer that keeps sending creates the topic again). The name can be created again; it
    starts at offset 0. Prints every topic deleted.
    """
    doc = run(_topics_delete(cfg, topic, force))
    emit(
        cfg,
        doc,
        lambda d: f"deleted {d['topic']}"
        if d["deleted"] == [d["topic"]]
        else f"deleted partitioned topic {d['topic']}" + "".join(f"\ndeleted {p}" for p in d["deleted"]),
    )


async def _topics_set_schema_policy(cfg: Config, topic: TopicName, allow_raw: bool) -> Json:
    async with danube_client(cfg) as client:
        policies = await client.admin.set_topic_schema_policy(topic.path, allow_raw=allow_raw)
    return {
        "topic": topic.path,
        "policies": [{"topic": p.topic, "subject": p.subject, "allow_raw": p.allow_raw} for p in policies],
    }


@topics.command("set-schema-policy")
@click.argument("topic", callback=parse_topic)
@click.option(
    "--allow-raw/--no-allow-raw",
    required=True,
    help="Accept (or refuse) producers without a schema on a topic that has a schema subject.",
)
@click.pass_obj
def topics_set_schema_policy(cfg: Config, topic: TopicName, allow_raw: bool) -> None:
    """Set whether producers without a schema may publish to TOPIC once it has a schema
    subject (§3.7). Their messages carry schema id 0 and are kept raw, never decoded with the
    topic's schema. A partitioned topic is set on every partition."""
    doc = run(_topics_set_schema_policy(cfg, topic, allow_raw))
    emit(
        cfg,
        doc,
        lambda d: "\n".join(
            f"{p['topic']}: raw messages {'allowed' if p['allow_raw'] else 'refused'}"
            + (f" (schema subject {p['subject']})" if p["subject"] else " (no schema subject yet)")
            for p in d["policies"]
        ),
    )


async def _topics_set_table_layout(
    cfg: Config, topic: TopicName, partition_by: str | None, raw_payload: bool | None
) -> Json:
    """Change the fields given of §3.9 and keep the others: a compare-and-put on the key's
    ``mod_revision``, read again when another writer changed it meanwhile."""
    async with metadata_store(cfg) as store:
        if await store.get(keys.topic_root(topic)) is None:
            raise AdminError(f"topic {topic.path!r} not found")
        key = keys.topic_table(topic)
        for _ in range(5):
            kv = await store.get(key)
            try:
                current = TableLayout.from_json(kv.value) if kv is not None else TableLayout()
            except ValueError:
                current = TableLayout()  # an unreadable value is replaced whole
            layout = TableLayout(
                partition_transform=partition_by if partition_by is not None else current.partition_transform,
                raw_payload=raw_payload if raw_payload is not None else current.raw_payload,
            )
            guard = {key: kv.mod_revision if kv is not None else 0}
            revision = await store.compare_and_put_many([(key, layout)], expected_mod_revisions=guard)
            if revision is not None:
                break
        else:
            raise AdminError(f"{key} kept changing while it was written; try again")
    return {
        "topic": topic.path, "key": key, "revision": revision,
        "partition_transform": layout.partition_transform, "raw_payload": layout.raw_payload,
    }


@topics.command("set-table-layout")
@click.argument("topic", callback=parse_topic)
@click.option(
    "--partition-by",
    type=click.Choice(PARTITION_TRANSFORMS),
    default=None,
    help="Partition TOPIC's Iceberg table by this transform of _publish_time (none: unpartitioned).",
)
@click.option(
    "--raw-payload/--no-raw-payload",
    default=None,
    help="Keep each payload's exact bytes in the table's _raw_payload column (topics with a schema; "
    "their dead letters also get _producer_id and _attributes). Off by default.",
)
@click.pass_obj
def topics_set_table_layout(cfg: Config, topic: TopicName, partition_by: str | None, raw_payload: bool | None) -> None:
    """Choose how TOPIC's Iceberg table is laid out (§3.9): its partitioning (default day) and
    whether it keeps the exact payload bytes (default off). Fields not given keep their value.
    The next tiering evolves the table in place: files already written keep their partition
    spec until compaction rewrites them, and rows written before keep a null _raw_payload."""
    if partition_by is None and raw_payload is None:
        raise click.UsageError("give --partition-by, --raw-payload or --no-raw-payload")
    doc = run(_topics_set_table_layout(cfg, topic, partition_by, raw_payload))
    emit(
        cfg,
        doc,
        lambda d: f"{d['topic']}: table partitioned by "
        + ("nothing" if d["partition_transform"] == "none" else f"{d['partition_transform']}(_publish_time)")
        + (", exact payload bytes kept in _raw_payload" if d["raw_payload"] else "")
        + f" from the next tiering on ({d['key']} at revision {d['revision']})",
    )
