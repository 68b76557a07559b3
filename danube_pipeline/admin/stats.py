"""``danube-admin topics stats`` and ``brokers stats``: rates, backlog and storage, measured.

Rates come from the brokers' Prometheus endpoints: the URL each broker registers as
``prom_exporter`` in ``/cluster/register/{broker_id}`` (``docs/etcd-layout.md`` §1.2) when it
runs with ``--metrics-listen``. Every endpoint is scraped twice, ``interval_s`` apart, and
each counter's increase over the time between the two scrapes is its rate; the expositions
are parsed with ``prometheus_client.parser``. A broker without metrics (``prom_exporter``
null), or whose endpoint does not answer, gives one line in ``problems`` (and nulls in its
figures), never a failure of the command.

Storage per tier, for ``topics stats``: the WAL from ``Admin.DescribeTopic`` (``wal_bytes``),
segment objects from their descriptors in etcd (§5.1: completed objects, their sizes summed),
Iceberg from the table-commit record (§5.8). That record carries the table's committed end
offset and snapshot, not its row or byte totals: those print as ``unknown`` (``null``), as
reading the table would need pyiceberg, which the base install does not carry.

The documents (ids are bare JSON integers; rates are per second over the measured interval,
``null`` when not measured):

``topics stats TOPIC``
    ``{"topic": str, "interval_s": float, "partitions": int, "partition_topics": [topic_stats],
    "problems": [str]}`` where each ``topic_stats`` is ``{"topic": str, "owner": {"broker_id":
    int, "address": str}, "rates": {"scope": "topic" | "namespace" | null,
    "messages_in_per_s": float | null, "bytes_in_per_s": ..., "messages_out_per_s": ...,
    "bytes_out_per_s": ...}, "subscriptions": [{"name": str, "type": str, "consumers": int,
    "lag_messages": int | null, "unacked_messages": int | null, "source": "metrics" |
    "describe"}], "storage": {"wal": {"bytes": int, "first_offset": int, "next_offset": int},
    "segment_objects": {"objects": int, "bytes": int, "first_offset": int | null,
    "end_offset": int | null}, "iceberg": {"table": str, "committed_end_offset": int | null,
    "snapshot_id": int | null, "committed_at_ms": int | null, "rows": null, "bytes": null}}}``.
    A plain topic has ``partitions`` 0 and itself as the only entry. ``scope`` is
    ``namespace`` when the owner runs with ``--no-metrics-per-topic`` (the rates are then its
    namespace's). Backlog comes from the owner's ``danube_subscription_lag_messages`` and
    ``danube_subscription_unacked_messages`` when it serves metrics, else from the cursor
    (``lag = next_offset - cursor - 1``; ``unacked = read_position - cursor - 1``, an upper
    bound: offsets acknowledged one by one above the cursor still count).
``brokers stats``
    ``{"interval_s": float, "leader_broker_id": int | null, "brokers": [{"broker_id": int,
    "address": str, "state": str | null, "leader": bool, "metrics_url": str | null,
    "topics_owned": int, "messages_in_per_s": float | null, "messages_out_per_s": float |
    null, "wal_bytes": float | null, "disk_free_bytes": float | null, "rpc_errors": float |
    null}], "problems": [str]}``: ``state`` is the mode of the broker's state key (§1.3);
    ``topics_owned`` from ``danube_broker_topics_owned``, or the assignment keys in etcd
    (§1.4) without metrics; ``rpc_errors`` the broker's ``danube_broker_rpc_total`` calls
    whose ``result`` (a status code name) is not ``OK``, since it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from danube_pipeline.admin.config import Config, danube_client, metadata_store
from danube_pipeline.admin.output import Json, field_lines, owner_json, owner_text, table
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import BrokerRegistration, ObjectDescriptor, TableCommit
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_names, partition_of

TOPIC_MESSAGES_IN = "danube_topic_messages_in_total"
TOPIC_BYTES_IN = "danube_topic_bytes_in_total"
CONSUMER_MESSAGES_OUT = "danube_consumer_messages_out_total"
CONSUMER_BYTES_OUT = "danube_consumer_bytes_out_total"
SUBSCRIPTION_LAG = "danube_subscription_lag_messages"
SUBSCRIPTION_UNACKED = "danube_subscription_unacked_messages"
TOPICS_OWNED = "danube_broker_topics_owned"
RPC_TOTAL = "danube_broker_rpc_total"
WAL_BYTES = "danube_wal_disk_bytes"
DISK_FREE = "danube_wal_disk_free_bytes"
"""The metric (sample) names read here, as the broker serves them (``broker/metrics/``)."""

SCRAPE_TIMEOUT_S = 5.0
"""Longest wait for one ``/metrics`` response."""

RPC_OK = "OK"
"""The ``result`` label (a gRPC status code name) of a successful call in ``danube_broker_rpc_total``."""


# ---------------------------------------------------------------------------- scraping


@dataclasses.dataclass(frozen=True, slots=True)
class Scrape:
    """One parsed exposition.

    Attributes:
        samples: every sample of every family (counters as ``..._total`` and ``..._created``).
        at_s: ``time.monotonic()`` when the response had arrived, in seconds.
    """

    samples: tuple[Sample, ...]
    at_s: float

    @classmethod
    def parse(cls, text: str, at_s: float) -> Scrape:
        """Parse a Prometheus text exposition.

        Raises:
            ValueError: ``text`` is not a valid exposition.
        """
        return cls(tuple(s for family in text_string_to_metric_families(text) for s in family.samples), at_s)

    def matching(self, name: str, **labels: str) -> list[Sample]:
        """The samples called ``name`` whose labels include every ``labels`` pair."""
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def total(self, name: str, **labels: str) -> float | None:
        """The sum of :meth:`matching` samples, ``None`` when there is none."""
        found = self.matching(name, **labels)
        return sum(s.value for s in found) if found else None


def series_key(sample: Sample) -> tuple[tuple[str, str], ...]:
    """A sample's labels as a sorted tuple: the identity of its series."""
    return tuple(sorted(sample.labels.items()))


def rate_per_s(first: Scrape, second: Scrape, name: str, **labels: str) -> float | None:
    """The summed increase per second of the counter series ``name`` (with ``labels``) from
    ``first`` to ``second``; a series that went down (a restarted broker) counts from 0, a
    series new in ``second`` counts in full. ``None`` when ``second`` has no such series."""
    now = second.matching(name, **labels)
    if not now:
        return None
    before = {series_key(s): s.value for s in first.matching(name, **labels)}
    increase = 0.0
    for sample in now:
        previous = before.get(series_key(sample), 0.0)
        increase += sample.value - previous if sample.value >= previous else sample.value
    return increase / max(second.at_s - first.at_s, 1e-9)


def fetch_exposition(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> str:
    """GET ``url`` (a ``/metrics`` endpoint) and return its body as text (blocking).

    Raises:
        OSError: the endpoint did not answer in time, refused or answered an HTTP error
            (``urllib.error.URLError`` and ``HTTPError`` are ``OSError``).
    """
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - http(s) from etcd
        body: bytes = response.read()
    return body.decode("utf-8", errors="replace")


@dataclasses.dataclass(slots=True)
class BrokerScrapes:
    """Two scrapes of one broker's endpoint, or why there are none.

    Attributes:
        broker_id: the broker.
        url: its ``prom_exporter``, ``None`` when it serves no metrics.
        first: the first scrape, ``None`` when it failed.
        second: the scrape ``interval_s`` later, ``None`` when it failed.
        problem: one line for people when a scrape is missing.
    """

    broker_id: int
    url: str | None
    first: Scrape | None = None
    second: Scrape | None = None
    problem: str | None = None

    @property
    def pair(self) -> tuple[Scrape, Scrape] | None:
        """Both scrapes, when both worked."""
        return (self.first, self.second) if self.first is not None and self.second is not None else None


def metrics_off_line(broker_id: int) -> str:
    """The line for a broker that serves no metrics."""
    return f"metrics off on broker {broker_id}: start it with --metrics-listen"


async def _scrape_once(target: BrokerScrapes) -> Scrape | None:
    assert target.url is not None
    try:
        text = await asyncio.to_thread(fetch_exposition, target.url)
        return Scrape.parse(text, time.monotonic())
    except (OSError, ValueError) as exc:
        if target.problem is None:
            target.problem = f"metrics of broker {target.broker_id} unreadable at {target.url}: {exc}"
        return None


async def scrape_twice(urls: dict[int, str | None], interval_s: float) -> dict[int, BrokerScrapes]:
    """Scrape every broker's endpoint, wait ``interval_s``, scrape them again (concurrently).

    Args:
        urls: ``prom_exporter`` by broker id (``None``: metrics off).
        interval_s: seconds between the two scrapes.

    Returns:
        The scrapes by broker id; failures are recorded in each ``problem``, never raised.
    """
    targets = {broker_id: BrokerScrapes(broker_id, url) for broker_id, url in urls.items()}
    live = [t for t in targets.values() if t.url is not None]
    for target in targets.values():
        if target.url is None:
            target.problem = metrics_off_line(target.broker_id)
    firsts = await asyncio.gather(*(_scrape_once(t) for t in live))
    if live:
        await asyncio.sleep(interval_s)
    seconds = await asyncio.gather(*(_scrape_once(t) for t in live))
    for target, first, second in zip(live, firsts, seconds, strict=True):
        target.first, target.second = first, second
    return targets


async def metrics_urls(store: MetadataStore, broker_ids: Iterable[int]) -> dict[int, str | None]:
    """The ``prom_exporter`` of each broker's registration (§1.2); ``None`` when it has none
    (or no readable registration)."""
    urls: dict[int, str | None] = {}
    for broker_id in broker_ids:
        kv = await store.get(keys.broker_register(broker_id))
        url = None
        if kv is not None:
            with contextlib.suppress(ValueError):
                url = BrokerRegistration.from_json(kv.value).prom_exporter or None
        urls[broker_id] = url
    return urls


# ---------------------------------------------------------------------------- topics


def topic_rates(pair: tuple[Scrape, Scrape] | None, topic: str, namespace: str) -> dict[str, object]:
    """The ``rates`` object of a topic: per topic when its owner labels series with ``topic``,
    else its namespace's when the owner aggregates per namespace, else nulls."""
    names = {
        "messages_in_per_s": TOPIC_MESSAGES_IN,
        "bytes_in_per_s": TOPIC_BYTES_IN,
        "messages_out_per_s": CONSUMER_MESSAGES_OUT,
        "bytes_out_per_s": CONSUMER_BYTES_OUT,
    }
    if pair is None:
        return {"scope": None, **dict.fromkeys(names)}
    first, second = pair
    for scope, labels in (("topic", {"topic": topic}), ("namespace", {"namespace": namespace})):
        rates = {field: rate_per_s(first, second, name, **labels) for field, name in names.items()}
        if scope == "namespace" and any(s.labels.get("topic") for s in second.matching(TOPIC_MESSAGES_IN)):
            break  # per-topic series exist, just none for this topic yet: not the namespace's
        if any(v is not None for v in rates.values()):
            return {"scope": scope, **{k: 0.0 if v is None else v for k, v in rates.items()}}
    return {"scope": "topic", **dict.fromkeys(names, 0.0)}


def backlog_from_metrics(scrape: Scrape, topic: str, subscription: str) -> tuple[int | None, int | None]:
    """``(lag_messages, unacked_messages)`` of one subscription from its owner's gauges."""
    lag = scrape.total(SUBSCRIPTION_LAG, topic=topic, subscription=subscription)
    unacked = scrape.total(SUBSCRIPTION_UNACKED, topic=topic, subscription=subscription)
    return (None if lag is None else int(lag)), (None if unacked is None else int(unacked))


def backlog_from_cursor(next_offset: int, cursor: int | None, read_position: int) -> tuple[int | None, int | None]:
    """``(lag_messages, unacked_messages)`` from the stored cursor (``None`` before any ack)."""
    if cursor is None:
        return None, None
    return max(0, next_offset - cursor - 1), max(0, read_position - cursor - 1)


def object_tier(descriptors: Sequence[ObjectDescriptor]) -> dict[str, int | None]:
    """The ``segment_objects`` object: completed objects, their bytes and offset span."""
    done = [d for d in descriptors if d.completed]
    return {
        "objects": len(done),
        "bytes": sum(d.size for d in done),
        "first_offset": min((d.start_offset for d in done), default=None),
        "end_offset": max((d.end_offset for d in done), default=None),
    }


async def read_descriptors(store: MetadataStore, objects_prefix: str) -> list[ObjectDescriptor]:
    """Every readable object descriptor under ``objects_prefix`` (§5.1; ``cur`` is skipped)."""
    kvs, _ = await store.get_prefix(objects_prefix)
    found = []
    for kv in kvs:
        if kv.key.endswith("/cur"):
            continue
        with contextlib.suppress(ValueError):
            found.append(ObjectDescriptor.from_json(kv.value))
    return found


def iceberg_tier(table: str, commit: TableCommit | None) -> dict[str, object]:
    """The ``iceberg`` object: the table and its last recorded commit (§5.8); row and byte
    totals are not recorded there, so they are ``None`` (unknown)."""
    return {
        "table": table,
        "committed_end_offset": commit.committed_end_offset if commit else None,
        "snapshot_id": commit.snapshot_id if commit else None,
        "committed_at_ms": commit.committed_at_ms if commit else None,
        "rows": None,
        "bytes": None,
    }


async def topic_stats(
    cfg: Config, topic: TopicName, interval_s: float, table_of: Callable[[TopicName], str]
) -> Json:
    """The ``topics stats`` document of ``topic`` (a plain topic, a partition or a partitioned
    topic, whose partitions are each measured); see the module docstring.

    Args:
        cfg: the root options.
        topic: the topic.
        interval_s: seconds between the two scrapes of each owner's metrics.
        table_of: the Iceberg table of a topic that is not a partition.

    Raises:
        TopicNotFoundError: no such topic.
        BrokerUnavailableError: no bootstrap broker answered.
        MetadataStoreError: etcd did not answer.
    """
    async with danube_client(cfg) as client:
        count = await client.admin.topic_partitions(topic.path)
        members = partition_names(topic, count) if count else [topic]
        owners = {p.path: await client.lookup_topic(p.path) for p in members}
        described = {p.path: await client.admin.describe_topic(p.path) for p in members}
    async with metadata_store(cfg) as store:
        parent = await partition_of(store, topic)
        table = table_of(parent.parent if parent is not None else topic)
        urls = await metrics_urls(store, sorted({o.broker_id for o in owners.values()}))
        tiers = {}
        for p in members:
            commit = None
            kv = await store.get(keys.table_commit(p))
            if kv is not None:
                with contextlib.suppress(ValueError):
                    commit = TableCommit.from_json(kv.value)
            tiers[p.path] = (object_tier(await read_descriptors(store, keys.objects_prefix(p))), commit)
    scrapes = await scrape_twice(urls, interval_s)
    rows = []
    for p in members:
        owner, description = owners[p.path], described[p.path]
        pair = scrapes[owner.broker_id].pair
        subscriptions = []
        for s in description.subscriptions:
            from_metrics = backlog_from_metrics(pair[1], p.path, s.name) if pair else (None, None)
            source = "metrics" if from_metrics != (None, None) else "describe"
            lag, unacked = (
                from_metrics if source == "metrics" else backlog_from_cursor(description.next_offset, s.cursor, s.read_position)
            )
            subscriptions.append(
                {
                    "name": s.name,
                    "type": s.subscription_type.name.capitalize(),
                    "consumers": s.consumers,
                    "lag_messages": lag,
                    "unacked_messages": unacked,
                    "source": source,
                }
            )
        objects, commit = tiers[p.path]
        rows.append(
            {
                "topic": p.path,
                "owner": owner_json(owner),
                "rates": topic_rates(pair, p.path, p.namespace),
                "subscriptions": subscriptions,
                "storage": {
                    "wal": {
                        "bytes": description.wal_bytes,
                        "first_offset": description.first_local_offset,
                        "next_offset": description.next_offset,
                    },
                    "segment_objects": objects,
                    "iceberg": iceberg_tier(table, commit),
                },
            }
        )
    problems = sorted({s.problem for s in scrapes.values() if s.problem})
    return {"topic": topic.path, "interval_s": interval_s, "partitions": count, "partition_topics": rows, "problems": problems}


def _rate(value: object, unit: str) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:,.1f} {unit}"


def _topic_text(t: Json) -> str:
    r, st = t["rates"], t["storage"]
    scope = "" if r["scope"] != "namespace" else " (the namespace's: per-topic metrics off)"
    head = field_lines(
        [
            ("topic", t["topic"]),
            ("owner", owner_text(t["owner"])),
            (f"in{scope}", f"{_rate(r['messages_in_per_s'], 'msg/s')}   {_rate(r['bytes_in_per_s'], 'B/s')}"),
            (f"out{scope}", f"{_rate(r['messages_out_per_s'], 'msg/s')}   {_rate(r['bytes_out_per_s'], 'B/s')}"),
        ]
    )
    subs = table(
        ["SUBSCRIPTION", "TYPE", "CONSUMERS", "LAG", "UNACKED", "FROM"],
        [[s["name"], s["type"], s["consumers"], s["lag_messages"], s["unacked_messages"], s["source"]] for s in t["subscriptions"]],
    )
    wal, objects, ice = st["wal"], st["segment_objects"], st["iceberg"]
    span = "-" if objects["first_offset"] is None else f"offsets {objects['first_offset']}..{objects['end_offset']}"
    committed = (
        "nothing committed yet"
        if ice["committed_end_offset"] is None
        else f"{ice['table']} through offset {ice['committed_end_offset']} (snapshot {ice['snapshot_id']})"
    )
    tiers = table(
        ["TIER", "BYTES", "DETAIL"],
        [
            ["WAL", wal["bytes"], f"offsets {wal['first_offset']}..{wal['next_offset'] - 1}"],
            ["segment objects", objects["bytes"], f"{objects['objects']} objects, {span}"],
            ["Iceberg", "unknown", f"{committed}; rows and bytes unknown"],
        ],
    )
    return f"{head}\n\nbacklog:\n{subs}\n\nstorage:\n{tiers}"


def topic_stats_text(d: Json) -> str:
    """The ``topics stats`` document for people."""
    parts = [f"measured over {d['interval_s']:g} s"]
    if d["partitions"]:
        parts[0] += f"; partitioned topic {d['topic']} ({d['partitions']} partitions)"
    parts += [_topic_text(t) for t in d["partition_topics"]]
    parts += [p for p in d["problems"]]
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------- brokers


async def brokers_stats(cfg: Config, interval_s: float) -> Json:
    """The ``brokers stats`` document; see the module docstring.

    Raises:
        BrokerUnavailableError: no bootstrap broker answered.
        MetadataStoreError: etcd did not answer.
    """
    async with danube_client(cfg) as client:
        info = await client.admin.cluster_metadata()
    leader = info.leader_broker_id or None
    async with metadata_store(cfg) as store:
        urls = await metrics_urls(store, [b.broker_id for b in info.brokers])
        assignment_kvs, _ = await store.get_prefix(keys.BROKERS_PREFIX)
    assigned: dict[int, int] = {}
    for kv in assignment_kvs:
        parts = kv.key[len(keys.BROKERS_PREFIX) :].split("/")
        if len(parts) == 3 and parts[0].isdigit():
            assigned[int(parts[0])] = assigned.get(int(parts[0]), 0) + 1
    scrapes = await scrape_twice(urls, interval_s)
    rows = []
    for b in info.brokers:
        pair = scrapes[b.broker_id].pair
        second = pair[1] if pair else None
        owned = second.total(TOPICS_OWNED) if second else None
        rpc = second.matching(RPC_TOTAL) if second else []
        rows.append(
            {
                "broker_id": b.broker_id,
                "address": b.address,
                "state": b.mode or None,
                "leader": b.broker_id == leader,
                "metrics_url": urls.get(b.broker_id),
                "topics_owned": int(owned) if owned is not None else assigned.get(b.broker_id, 0),
                "messages_in_per_s": rate_per_s(*pair, TOPIC_MESSAGES_IN) if pair else None,
                "messages_out_per_s": rate_per_s(*pair, CONSUMER_MESSAGES_OUT) if pair else None,
                "wal_bytes": second.total(WAL_BYTES) if second else None,
                "disk_free_bytes": second.total(DISK_FREE) if second else None,
                "rpc_errors": sum(s.value for s in rpc if s.labels.get("result") != RPC_OK) if second else None,
            }
        )
    problems = [scrapes[b.broker_id].problem for b in info.brokers if scrapes[b.broker_id].problem]
    return {"interval_s": interval_s, "leader_broker_id": leader, "brokers": rows, "problems": problems}


def _bytes(value: object) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def brokers_stats_text(d: Json) -> str:
    """The ``brokers stats`` document for people."""
    rows = table(
        ["BROKER_ID", "ADDRESS", "STATE", "LEADER", "TOPICS", "IN_MSG/S", "OUT_MSG/S", "WAL", "DISK_FREE", "RPC_ERRORS"],
        [
            [
                b["broker_id"], b["address"], b["state"], b["leader"], b["topics_owned"],
                _rate(b["messages_in_per_s"], "").strip(), _rate(b["messages_out_per_s"], "").strip(),
                _bytes(b["wal_bytes"]), _bytes(b["disk_free_bytes"]),
                None if b["rpc_errors"] is None else int(b["rpc_errors"]),
            ]
            for b in d["brokers"]
        ],
    )  # fmt: skip
    return "\n".join([f"measured over {d['interval_s']:g} s", rows, *d["problems"]])
