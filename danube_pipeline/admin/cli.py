"""``danube-admin``: the operator's command line for a running Danube cluster.

Every verb does its work for real, inside one ``asyncio.run``: through the client library
(:class:`~danube_pipeline.client.DanubeClient`, which talks to the brokers) or straight to etcd
through :class:`~danube_pipeline.metadata.store.MetadataStore` (the keys of
``docs/etcd-layout.md``). Root options, before the verb::

    danube-admin [--etcd-endpoints H:P,...] [--brokers H:P,...] [--output text|json] GROUP VERB ...

``--etcd-endpoints`` defaults to ``$DANUBE_ETCD_ENDPOINTS`` (``127.0.0.1:2379``), ``--brokers``
(bootstrap brokers) to ``$DANUBE_BROKER_ADDRESSES`` (``127.0.0.1:6650``), as in
:mod:`danube_pipeline.settings`. ``--output text`` (default) prints aligned tables for people;
``--output json`` prints exactly one JSON document on stdout (ids are bare JSON integers, usually
above 2^53, as in etcd: ``docs/etcd-layout.md``, "Conventions").

Verbs and the JSON each prints (``owner`` objects are ``{"broker_id": int, "address": "host:port"}``):

``brokers list``
    ``{"cluster_name": str, "leader_broker_id": int | null, "brokers": [{"broker_id": int,
    "address": str, "mode": str, "leader": bool}]}``: the registered brokers (§1.2) with the
    ``mode`` of their state key (§1.3) and the leader flag (§1.7), from ``Discovery.ClusterMetadata``.
``brokers leader``
    ``{"broker_id": int | null, "address": str | null, "mode": str | null}`` (nulls: no leader
    recorded, §1.7).
``brokers drain ADDRESS_OR_ID``
    ``{"broker_id": int, "address": str, "released_topics": [str], "mode": str}``: the broker
    releases every topic it owns (§1.4, §1.5, §5.3) and ends ``drained``; ``mode`` is read back
    from its state key in etcd (§1.3). An id is resolved to its address through the cluster
    metadata; an address must be a registered broker's.
``namespaces list``
    ``{"namespaces": [{"namespace": str, "policy": bool, "topics": int}]}``: every ``{ns}`` under
    ``/namespaces/`` (§2.1 policy keys, §2.2 topic keys), whether it has a stored policy, and how
    many §2.2 topic keys it has.
``namespaces create NS``
    ``{"namespace": str, "created": bool, "policy": object}``: writes the default
    ``NamespacePolicy`` with create-if-absent (§2.1); ``created`` is false when a policy
    existed, and ``policy`` is then the stored one.
``namespaces get-policy NS``
    ``{"namespace": str, "key": str, "stored": bool, "mod_revision": int | null, "policy":
    object}``: the stored policy (§2.1), or the defaults the brokers apply when none is stored.
``namespaces set-policy NS --FIELD N ...``
    ``{"namespace": str, "changed": [str], "revision": int, "before": object, "policy": object}``:
    one option per ``NamespacePolicy`` field (``--max-message-size``,
    ``--retention-time-minutes``, ``--retention-size-mb``, ...; non-negative integers, 0 means
    unlimited). Reads the policy, changes only the fields given, and writes it back with a
    compare on the key's ``mod_revision`` (absent: must still be absent), so a concurrent change
    is never overwritten: the verb fails instead. The value written is the canonical
    ``NamespacePolicy`` (every field, snake-case names; camelCase aliases are folded in and
    unknown fields dropped).
``topics create /NS/TOPIC [--delivery Reliable|NonReliable] [--partitions N]``
    ``{"topic": str, "created": bool, "requested_delivery": str, "owner": owner}``; an existing
    topic keeps its own delivery mode (§3.2). With ``--partitions N`` (1 to 100) a partitioned
    topic: its root holds N (§3.1) and its partitions ``TOPIC-part-{i}`` are topics of their
    own, each assigned an owner; the document is then ``{"topic": str, "created": bool,
    "requested_delivery": str, "partitions": int, "partition_topics": [{"topic": str,
    "owner": owner}]}`` (an existing topic keeps its own partition count).
``topics list [--namespace NS]``
    ``{"topics": [{"topic": str, "owner": owner | null, "delivery": str, "next_offset": int |
    null, "sealed_segments": int | null, "wal_syncs": int | null}]}``: every topic root in etcd
    (§3.1) with its assignment (§1.4) and delivery mode (§3.2), merged with what the brokers
    report for the topics they have loaded (``Admin.ListTopics``; nulls when none has it loaded).
``topics describe /NS/TOPIC``
    ``{"topic": str, "owner": owner, "delivery": str, "next_offset": int,
    "first_local_offset": int, "wal_bytes": int, "sealed_segments": int, "remote_first_offset":
    int | null, "remote_end_offset": int | null, "earliest_offset": int, "cache_bytes": int,
    "subscriptions": [{"name": str, "type": str, "cursor": int | null, "read_position": int,
    "consumers": int, "records_from_object_storage": int, "skipped_below_retention": int}]}``:
    the owner from a lookup, the rest from ``Admin.DescribeTopic`` (WAL, object storage §5.1,
    loaded subscriptions). A partitioned topic (§3.1) has no owner or WAL of its own:
    ``{"topic": str, "partitions": int, "delivery": str, "partition_topics": [{"topic": str,
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
``topics set-schema-policy /NS/TOPIC (--allow-raw | --no-allow-raw)``
    ``{"topic": str, "policies": [{"topic": str, "subject": str, "allow_raw": bool}]}``: whether
    producers without a schema may publish to the topic once it has a schema subject
    (``Admin.SetTopicSchemaPolicy`` on any broker, §3.7); a partitioned topic's partitions are
    each written (``policies`` lists them). ``subject`` is empty until a producer with a schema
    was created on the topic.
``subscriptions list /NS/TOPIC``
    ``{"topic": str, "owner_answered": bool, "subscriptions": [{"name": str, "type": str |
    null, "active_consumer_id": int | null, "consumer_name": str | null, "stored_cursor": int |
    null, "loaded": bool, "cursor": int | null, "read_position": int | null, "consumers": int |
    null, "records_from_object_storage": int | null, "skipped_below_retention": int | null}]}``:
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

Not available yet, because the broker cannot do it: deleting a subscription.

Errors, as one ``error: ...`` line on stderr and never a traceback:

* exit 2: bad arguments, e.g. a malformed topic or namespace name (the "Name grammar" of
  ``docs/etcd-layout.md``), a negative or non-integer policy value, an unknown broker id or
  address, a malformed endpoint (``click.UsageError`` / ``click.BadParameter``);
* exit 1: a :class:`~danube_pipeline.errors.DanubeError` from the cluster (e.g. ``topic
  '/default/x' not found``, an unreachable broker or etcd), a policy changed by someone else
  during ``set-policy``, or a stored policy that does not parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, NoReturn, TypeVar

import click

from danube_pipeline import settings
from danube_pipeline.client import BrokerAddress, DanubeClient, DeliveryMode, SubscriptionType
from danube_pipeline.errors import (
    BrokerUnavailableError,
    DanubeError,
    InvalidNameError,
    MetadataStoreError,
    TopicNotFoundError,
)
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.etcd import split_endpoint
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import PARTITION_TRANSFORMS, NamespacePolicy, TableLayout
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.partitions import MAX_PARTITIONS, partition_names

__all__ = ["AdminError", "Config", "cli", "main", "update_namespace_policy"]

T = TypeVar("T")
Json = dict[str, Any]

REQUEST_TIMEOUT_MS = 15_000
"""Deadline of each unary broker RPC the CLI makes (``DrainBroker`` has none)."""

POLICY_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(NamespacePolicy))
"""The ``NamespacePolicy`` fields (``docs/etcd-layout.md`` §2.1), one ``set-policy`` option each."""

_POLICY_HELP = {
    "max_consumers_per_subscription": "Consumers per subscription (recorded, not enforced yet).",
    "max_consumers_per_topic": "Consumers per topic (recorded, not enforced yet).",
    "max_message_size": "Largest payload in bytes; the brokers refuse a batch holding a larger one.",
    "max_producers_per_topic": "Producers per topic (recorded, not enforced yet).",
    "max_publish_rate": "Publish rate (recorded, not enforced yet).",
    "max_subscription_dispatch_rate": "Dispatch rate per subscription (recorded, not enforced yet).",
    "max_subscriptions_per_topic": "Subscriptions per topic (recorded, not enforced yet).",
    "retention_size_mb": "Keep at most this many MiB of segment objects per topic (retention asset).",
    "retention_time_minutes": "Keep messages this many minutes (retention asset).",
}


class AdminError(click.ClickException):
    """A refusal that is not about the arguments (exit 1): e.g. a policy changed meanwhile."""

    exit_code = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """The root options, shared by every verb.

    Attributes:
        etcd_endpoints: ``host:port`` etcd endpoints.
        brokers: ``host:port`` bootstrap brokers.
        output: ``"text"`` or ``"json"``.
    """

    etcd_endpoints: list[str]
    brokers: list[str]
    output: str


# ---------------------------------------------------------------------------- connections


@contextlib.asynccontextmanager
async def _store(cfg: Config) -> AsyncIterator[MetadataStore]:
    """A connected :class:`MetadataStore`, closed on exit.

    Raises:
        MetadataStoreError: no endpoint answered.
    """
    store = await MetadataStore.connect(cfg.etcd_endpoints)
    try:
        yield store
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def _client(cfg: Config) -> AsyncIterator[DanubeClient]:
    """A connected :class:`DanubeClient`, closed on exit (also when connecting failed).

    Raises:
        BrokerUnavailableError: no bootstrap broker answered.
    """
    client = DanubeClient(cfg.brokers, request_timeout_ms=REQUEST_TIMEOUT_MS, metadata_retries=2)
    try:
        await client.connect()
        yield client
    finally:
        await client.close()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


# ---------------------------------------------------------------------------- output


def _emit(cfg: Config, document: Json, text: Callable[[Json], str]) -> None:
    """Print ``document`` as one JSON document, or ``text(document)`` for people."""
    if cfg.output == "json":
        click.echo(json.dumps(document, indent=2))
    else:
        click.echo(text(document))


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An aligned table: numbers right-aligned, ``None`` as ``-``; ``(none)`` when empty."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [
        bool(rows) and all(isinstance(r[i], int) and not isinstance(r[i], bool) or r[i] is None for r in rows)
        for i in range(len(headers))
    ]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    out = [line(headers)]
    out += [line(r) for r in cells] if cells else ["(none)"]
    return "\n".join(out)


def _fields(pairs: Sequence[tuple[str, object]]) -> str:
    width = max(len(label) for label, _ in pairs)
    return "\n".join(f"{label.ljust(width)}  {_cell(value)}" for label, value in pairs)


def _owner(address: BrokerAddress) -> Json:
    return {"broker_id": address.broker_id, "address": address.address}


def _owner_text(owner: Json | None) -> str:
    return "-" if owner is None else f"{owner['broker_id']} ({owner['address']})"


def _type_name(number: object) -> str | None:
    """``Exclusive``, ``Shared`` or ``Failover`` for a stored type number (§3.4), else ``None``."""
    value = _as_int(number)
    if value is None or value not in SubscriptionType._value2member_map_:
        return None
    return SubscriptionType(value).name.capitalize()


def _as_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# ---------------------------------------------------------------------------- argument types


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _parse_topic(ctx: click.Context, param: click.Parameter, value: str) -> TopicName:
    try:
        return TopicName.parse(value)
    except InvalidNameError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _parse_namespace(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return validate_part("namespace", value)
    except InvalidNameError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _is_address(value: str) -> bool:
    """Whether ``value`` is ``host:port`` (no scheme, no spaces, port 1-65535)."""
    host, sep, port = value.rpartition(":")
    return (
        bool(sep and host and port.isdigit())
        and 0 < int(port) < 65536
        and not any(c.isspace() or c == "/" for c in host)
    )


def _parse_endpoints(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    endpoints = [part.strip() for part in value.split(",") if part.strip()]
    if not endpoints:
        raise click.BadParameter("no etcd endpoint given", ctx=ctx, param=param)
    for endpoint in endpoints:
        try:
            split_endpoint(endpoint)
        except MetadataStoreError:
            raise click.BadParameter(f"{endpoint!r} is not host:port", ctx=ctx, param=param) from None
    return endpoints


def _parse_brokers(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    addresses = [part.strip() for part in value.split(",") if part.strip()]
    if not addresses:
        raise click.BadParameter("no broker address given", ctx=ctx, param=param)
    for address in addresses:
        if not _is_address(address):
            raise click.BadParameter(f"{address!r} is not host:port", ctx=ctx, param=param)
    return addresses


# ---------------------------------------------------------------------------- root


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--etcd-endpoints",
    default=lambda: ",".join(settings.etcd_endpoints()),
    show_default="$DANUBE_ETCD_ENDPOINTS or 127.0.0.1:2379",
    callback=_parse_endpoints,
    help="Comma-separated etcd endpoints (host:port).",
)
@click.option(
    "--brokers",
    default=lambda: ",".join(settings.broker_addresses()),
    show_default="$DANUBE_BROKER_ADDRESSES or 127.0.0.1:6650",
    callback=_parse_brokers,
    help="Comma-separated bootstrap brokers (host:port), used to learn the cluster.",
)
@click.option(
    "--output",
    "-o",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="text: aligned tables; json: one JSON document on stdout.",
)
@click.pass_context
def cli(ctx: click.Context, etcd_endpoints: list[str], brokers: list[str], output: str) -> None:
    """Administer a Danube cluster: brokers, namespaces, topics, subscriptions.

    Not available yet (the broker cannot do it): deleting a subscription. The etcd keys are
    described in docs/etcd-layout.md.
    """
    ctx.obj = Config(etcd_endpoints=etcd_endpoints, brokers=brokers, output=output)


# ---------------------------------------------------------------------------- brokers


@cli.group(short_help="Registered brokers, the leader, draining.")
def brokers() -> None:
    """Registered brokers, the leader, draining (docs/etcd-layout.md §1)."""


async def _brokers_list(cfg: Config) -> Json:
    async with _client(cfg) as client:
        info = await client.admin.cluster_metadata()
    leader = info.leader_broker_id or None
    return {
        "cluster_name": info.cluster_name,
        "leader_broker_id": leader,
        "brokers": [
            {"broker_id": b.broker_id, "address": b.address, "mode": b.mode, "leader": b.broker_id == leader}
            for b in info.brokers
        ],
    }


@brokers.command("list")
@click.pass_obj
def brokers_list(cfg: Config) -> None:
    """Every registered broker: id, address, mode (§1.2, §1.3) and the leader flag (§1.7)."""
    doc = _run(_brokers_list(cfg))
    _emit(
        cfg,
        doc,
        lambda d: f"cluster {d['cluster_name']}\n"
        + _table(
            ["BROKER_ID", "ADDRESS", "MODE", "LEADER"],
            [[b["broker_id"], b["address"], b["mode"] or "-", b["leader"]] for b in d["brokers"]],
        ),
    )


@brokers.command("leader")
@click.pass_obj
def brokers_leader(cfg: Config) -> None:
    """The leader broker (§1.7): id, address and mode; nulls when no leader is recorded."""
    listed = _run(_brokers_list(cfg))
    leader = next((b for b in listed["brokers"] if b["leader"]), None)
    doc = {
        "broker_id": listed["leader_broker_id"],
        "address": leader["address"] if leader else None,
        "mode": leader["mode"] if leader else None,
    }
    _emit(
        cfg,
        doc,
        lambda d: "no leader recorded"
        if d["broker_id"] is None
        else f"leader {d['broker_id']} at {_cell(d['address'])} ({_cell(d['mode'])})",
    )


async def _drain(cfg: Config, target: str) -> Json:
    async with _client(cfg) as client:
        info = await client.admin.cluster_metadata()
        if target.isdigit():
            match = next((b for b in info.brokers if b.broker_id == int(target)), None)
        else:
            match = next((b for b in info.brokers if b.address == target), None)
        if match is None:
            registered = ", ".join(f"{b.broker_id} ({b.address})" for b in info.brokers) or "none"
            kind = "broker id" if target.isdigit() else "broker address"
            raise click.BadParameter(
                f"unknown {kind} {target!r}; registered brokers: {registered}", param_hint="'ADDRESS_OR_ID'"
            )
        released = await client.admin.drain_broker(match.address)
    async with _store(cfg) as store:
        state = await store.get(keys.broker_state(match.broker_id))
    mode = state.value.get("mode") if state is not None and isinstance(state.value, dict) else None
    return {"broker_id": match.broker_id, "address": match.address, "released_topics": sorted(released), "mode": mode}


@brokers.command("drain")
@click.argument("address_or_id")
@click.pass_obj
def brokers_drain(cfg: Config, address_or_id: str) -> None:
    """Move every topic off a broker and mark it drained (§1.3, §1.4, §1.5).

    ADDRESS_OR_ID is a registered broker's id (resolved through the cluster metadata) or its
    host:port address. Prints the topics it released.
    """
    if not address_or_id.isdigit() and not _is_address(address_or_id):
        raise click.BadParameter(f"{address_or_id!r} is neither a broker id nor host:port", param_hint="'ADDRESS_OR_ID'")
    doc = _run(_drain(cfg, address_or_id))
    _emit(
        cfg,
        doc,
        lambda d: f"broker {d['broker_id']} ({d['address']}) is {_cell(d['mode'])}; "
        f"released {len(d['released_topics'])} topic(s)"
        + "".join(f"\n  {t}" for t in d["released_topics"]),
    )


# ---------------------------------------------------------------------------- namespaces


@cli.group(short_help="Namespaces and their policies.")
def namespaces() -> None:
    """Namespaces and their policies (docs/etcd-layout.md §2)."""


async def _namespaces_list(cfg: Config) -> Json:
    prefix = keys.NAMESPACES + "/"
    async with _store(cfg) as store:
        kvs, _ = await store.get_prefix(prefix)
    found: dict[str, Json] = {}
    for kv in kvs:
        parts = kv.key[len(prefix) :].split("/")
        if len(parts) == 2 and parts[1] == "policy":
            found.setdefault(parts[0], {"namespace": parts[0], "policy": False, "topics": 0})["policy"] = True
        elif len(parts) >= 3 and parts[1] == "topics":
            found.setdefault(parts[0], {"namespace": parts[0], "policy": False, "topics": 0})["topics"] += 1
    return {"namespaces": [found[name] for name in sorted(found)]}


@namespaces.command("list")
@click.pass_obj
def namespaces_list(cfg: Config) -> None:
    """Every namespace with a policy (§2.1) or a topic key (§2.2) under /namespaces/."""
    doc = _run(_namespaces_list(cfg))
    _emit(
        cfg,
        doc,
        lambda d: _table(
            ["NAMESPACE", "POLICY", "TOPICS"], [[n["namespace"], n["policy"], n["topics"]] for n in d["namespaces"]]
        ),
    )


async def _namespaces_create(cfg: Config, namespace: str) -> Json:
    key = keys.namespace_policy(namespace)
    async with _store(cfg) as store:
        created = await store.put_if_absent(key, NamespacePolicy())
        policy: object = NamespacePolicy().to_json()
        if not created:
            current = await store.get(key)
            policy = current.value if current is not None else None
    return {"namespace": namespace, "created": created, "policy": policy}


@namespaces.command("create")
@click.argument("namespace", callback=_parse_namespace)
@click.pass_obj
def namespaces_create(cfg: Config, namespace: str) -> None:
    """Create NAMESPACE: write the default policy unless one exists (§2.1)."""
    doc = _run(_namespaces_create(cfg, namespace))
    _emit(
        cfg,
        doc,
        lambda d: f"created namespace {d['namespace']} with the default policy"
        if d["created"]
        else f"namespace {d['namespace']} already existed; its policy is unchanged",
    )


async def _read_policy(store: MetadataStore, namespace: str) -> tuple[NamespacePolicy, int]:
    """The namespace's policy and its key's ``mod_revision`` (0: none stored, the defaults).

    Raises:
        AdminError: the stored value does not parse (the brokers then apply the defaults).
        MetadataStoreError: etcd cannot be reached.
    """
    key = keys.namespace_policy(namespace)
    current = await store.get(key)
    if current is None:
        return NamespacePolicy(), 0
    try:
        return NamespacePolicy.from_json(current.value), current.mod_revision
    except ValueError as exc:
        raise AdminError(
            f"the policy at {key} is unreadable ({exc}); the brokers apply the defaults. "
            f"Fix it with etcdctl put (docs/etcd-layout.md §2.1)"
        ) from None


async def _get_policy(cfg: Config, namespace: str) -> Json:
    async with _store(cfg) as store:
        policy, mod_revision = await _read_policy(store, namespace)
    return {
        "namespace": namespace,
        "key": keys.namespace_policy(namespace),
        "stored": mod_revision != 0,
        "mod_revision": mod_revision or None,
        "policy": policy.to_json(),
    }


def _policy_text(d: Json) -> str:
    note = "" if d["stored"] else " (none stored: the defaults apply)"
    return f"policy of namespace {d['namespace']}{note}\n" + _fields(list(d["policy"].items()))


@namespaces.command("get-policy")
@click.argument("namespace", callback=_parse_namespace)
@click.pass_obj
def namespaces_get_policy(cfg: Config, namespace: str) -> None:
    """The policy of NAMESPACE (§2.1); the defaults when none is stored. 0 means unlimited."""
    _emit(cfg, _run(_get_policy(cfg, namespace)), _policy_text)


async def update_namespace_policy(store: MetadataStore, namespace: str, changes: dict[str, int]) -> Json:
    """Read the policy of ``namespace``, apply ``changes``, write it back iff unchanged since.

    The write is a compare on the key's ``mod_revision`` (on its absence when no policy was
    stored), so a concurrent writer's change is never lost (``docs/etcd-layout.md`` §2.1).

    Args:
        store: a connected store.
        namespace: a valid namespace name.
        changes: ``NamespacePolicy`` field -> new non-negative value.

    Returns:
        ``{"namespace", "changed": [field], "revision": int, "before": policy, "policy": policy}``.

    Raises:
        AdminError: the policy changed (or appeared) after it was read, or it is unreadable;
            nothing was written.
        MetadataStoreError: etcd cannot be reached.
    """
    key = keys.namespace_policy(namespace)
    before, mod_revision = await _read_policy(store, namespace)
    after = dataclasses.replace(before, **changes)
    revision = await store.compare_and_put_many([(key, after)], expected_mod_revisions={key: mod_revision})
    if revision is None:
        raise AdminError(
            f"the policy of namespace {namespace!r} changed while it was being updated; "
            "nothing was written, run the command again"
        )
    return {
        "namespace": namespace,
        "changed": sorted(changes),
        "revision": revision,
        "before": before.to_json(),
        "policy": after.to_json(),
    }


async def _set_policy(cfg: Config, namespace: str, changes: dict[str, int]) -> Json:
    async with _store(cfg) as store:
        return await update_namespace_policy(store, namespace, changes)


def _policy_options(command: Callable[..., None]) -> Callable[..., None]:
    for name in reversed(POLICY_FIELDS):
        command = click.option(
            "--" + name.replace("_", "-"),
            name,
            type=click.IntRange(min=0),
            default=None,
            help=_POLICY_HELP.get(name, ""),
        )(command)
    return command


@namespaces.command("set-policy")
@click.argument("namespace", callback=_parse_namespace)
@_policy_options
@click.pass_obj
def namespaces_set_policy(cfg: Config, namespace: str, **fields: int | None) -> None:
    """Change only the given fields of NAMESPACE's policy (§2.1); 0 means unlimited.

    The policy is read, changed and written back with a compare on its mod revision: if
    someone changed it in between, nothing is written and the command fails (exit 1).
    """
    changes = {name: value for name, value in fields.items() if value is not None}
    if not changes:
        raise click.UsageError("give at least one policy field, e.g. --max-message-size 1048576")
    doc = _run(_set_policy(cfg, namespace, changes))
    _emit(
        cfg,
        doc,
        lambda d: f"updated policy of namespace {d['namespace']} at revision {d['revision']}\n"
        + _fields([(n, f"{d['before'][n]} -> {d['policy'][n]}") for n in d["changed"]]),
    )


# ---------------------------------------------------------------------------- topics


@cli.group(short_help="Create, list, describe, unload and delete topics.")
def topics() -> None:
    """Topics: create, list, describe, unload, delete (docs/etcd-layout.md §3)."""


async def _topics_create(cfg: Config, topic: TopicName, delivery: str, partitions: int = 0) -> Json:
    async with _client(cfg) as client:
        created = await client.admin.create_topic(topic.path, delivery=DeliveryMode(delivery), partitions=partitions)
        count = await client.admin.topic_partitions(topic.path)
        if count:
            return {
                "topic": topic.path,
                "created": created,
                "requested_delivery": delivery,
                "partitions": count,
                "partition_topics": [
                    {"topic": p.path, "owner": _owner(await client.lookup_topic(p.path))}
                    for p in partition_names(topic, count)
                ],
            }
        owner = await client.lookup_topic(topic.path)
    return {"topic": topic.path, "created": created, "requested_delivery": delivery, "owner": _owner(owner)}


def _created_text(d: Json) -> str:
    what = f"partitioned topic {d['topic']}" if "partitions" in d else f"topic {d['topic']}"
    head = f"created {what} ({d['requested_delivery']})" if d["created"] else f"{what} already existed"
    if "partitions" not in d:
        return f"{head}; owner {_owner_text(d['owner'])}"
    rows = _table(["PARTITION", "OWNER"], [[p["topic"], _owner_text(p["owner"])] for p in d["partition_topics"]])
    return f"{head}; {d['partitions']} partitions:\n{rows}"


@topics.command("create")
@click.argument("topic", callback=_parse_topic)
@click.option(
    "--delivery",
    type=click.Choice([m.value for m in DeliveryMode]),
    default=DeliveryMode.RELIABLE.value,
    show_default=True,
    help="Delivery mode (§3.2); an existing topic keeps its own.",
)
@click.option(
    "--partitions",
    type=click.IntRange(0, MAX_PARTITIONS),
    default=0,
    show_default=True,
    help="Partitions of a partitioned topic (§3.1), named TOPIC-part-{i}; 0 for a plain topic.",
)
@click.pass_obj
def topics_create(cfg: Config, topic: TopicName, delivery: str, partitions: int) -> None:
    """Create TOPIC (/namespace/topic); the leader assigns its owner (§1.4, §3.1), or each
    partition's owner with --partitions."""
    _emit(cfg, _run(_topics_create(cfg, topic, delivery, partitions)), _created_text)


async def _topics_list(cfg: Config, namespace: str | None) -> Json:
    prefix = keys.TOPICS + "/" + (f"{namespace}/" if namespace else "")
    async with _store(cfg) as store:
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
    async with _client(cfg) as client:
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
@click.option("--namespace", callback=_parse_namespace, default=None, help="Only this namespace.")
@click.pass_obj
def topics_list(cfg: Config, namespace: str | None) -> None:
    """Every topic (§3.1) with its owner (§1.4), delivery mode (§3.2) and, when a broker has it
    loaded, its next offset, sealed segments and WAL syncs."""
    doc = _run(_topics_list(cfg, namespace))
    _emit(
        cfg,
        doc,
        lambda d: _table(
            ["TOPIC", "OWNER", "DELIVERY", "NEXT_OFFSET", "SEALED_SEGMENTS", "WAL_SYNCS"],
            [
                [t["topic"], _owner_text(t["owner"]), t["delivery"], t["next_offset"], t["sealed_segments"], t["wal_syncs"]]
                for t in d["topics"]
            ],
        ),
    )


async def _describe_partitioned(cfg: Config, client: DanubeClient, topic: TopicName, partitions: int) -> Json:
    rows = []
    for p in partition_names(topic, partitions):
        owner = await client.lookup_topic(p.path)
        description = await client.admin.describe_topic(p.path)
        rows.append({"topic": p.path, "owner": _owner(owner), "next_offset": description.next_offset})
    async with _store(cfg) as store:
        delivery = await store.get(keys.topic_delivery(topic))
    return {
        "topic": topic.path,
        "partitions": partitions,
        "delivery": DeliveryMode.from_stored(delivery.value if delivery else None).value,
        "partition_topics": rows,
    }


async def _topics_describe(cfg: Config, topic: TopicName) -> Json:
    async with _client(cfg) as client:
        partitions = await client.admin.topic_partitions(topic.path)
        if partitions:
            return await _describe_partitioned(cfg, client, topic, partitions)
        owner = await client.lookup_topic(topic.path)
        description = await client.admin.describe_topic(topic.path)
    async with _store(cfg) as store:
        delivery = await store.get(keys.topic_delivery(topic))
    return {
        "topic": topic.path,
        "owner": _owner(owner),
        "delivery": DeliveryMode.from_stored(delivery.value if delivery else None).value,
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
                "skipped_below_retention": s.skipped_below_retention,
                "skipped_unavailable": s.skipped_unavailable,
                "dispatch_throttled_ms": s.dispatch_throttled_ms,
            }
            for s in description.subscriptions
        ],
    }


def _describe_text(d: Json) -> str:
    if "partitions" in d:
        head = _fields([("topic", d["topic"]), ("partitions", d["partitions"]), ("delivery", d["delivery"])])
        rows = _table(
            ["PARTITION", "OWNER", "NEXT_OFFSET"],
            [[p["topic"], _owner_text(p["owner"]), p["next_offset"]] for p in d["partition_topics"]],
        )
        return f"{head}\n\npartitions:\n{rows}"
    summary = _fields(
        [
            ("topic", d["topic"]),
            ("owner", _owner_text(d["owner"])),
            ("delivery", d["delivery"]),
            ("next offset", d["next_offset"]),
            ("first local offset", d["first_local_offset"]),
            ("WAL bytes", d["wal_bytes"]),
            ("sealed segments", d["sealed_segments"]),
            ("remote offsets", "-" if d["remote_first_offset"] is None
             else f"{d['remote_first_offset']}..{d['remote_end_offset']}"),
            ("earliest offset", d["earliest_offset"]),
            ("owner epoch", d["owner_epoch"]),
            ("reserved through", d["reserved_end_offset"]),
            ("publish throttled", f"{d['publish_throttled_ms']} ms"),
            *(
                [
                    ("in memory", f"{d['buffered_messages']} messages, {d['buffered_bytes']} bytes"),
                    ("dropped", f"{d['dropped_messages']} (buffer full, oldest first)"),
                ]
                if d["delivery"] == DeliveryMode.NON_RELIABLE.value
                else []
            ),
        ]
    )
    ranges = d["unavailable_ranges"]
    unavailable = "" if not ranges else "\n\nunavailable ranges (held by failed brokers, §5.5):\n" + _table(
        ["START", "END", "BROKER", "LAST_WRITTEN", "ABANDONED"],
        [[u["start_offset"], u["end_offset"], u["broker_id"], u["last_written"], u["abandoned"]] for u in ranges],
    )
    subs = _table(
        ["SUBSCRIPTION", "TYPE", "CURSOR", "READ_POSITION", "CONSUMERS", "DISPATCH_THROTTLED_MS"],
        [
            [s["name"], s["type"], s["cursor"], s["read_position"], s["consumers"], s["dispatch_throttled_ms"]]
            for s in d["subscriptions"]
        ],
    )
    return f"{summary}{unavailable}\n\nloaded subscriptions:\n{subs}"


@topics.command("describe")
@click.argument("topic", callback=_parse_topic)
@click.pass_obj
def topics_describe(cfg: Config, topic: TopicName) -> None:
    """Where TOPIC's offsets live: owner, WAL, object storage (§5.1), loaded subscriptions."""
    _emit(cfg, _run(_topics_describe(cfg, topic)), _describe_text)


async def _topics_unload(cfg: Config, topic: TopicName) -> Json:
    async with _client(cfg) as client:
        previous = await client.lookup_topic(topic.path)
        next_offset = await client.admin.unload_topic(topic.path)
        owner = await client.lookup_topic(topic.path)
    return {"topic": topic.path, "previous_owner": _owner(previous), "next_offset": next_offset, "owner": _owner(owner)}


async def _topics_abandon_range(cfg: Config, topic: TopicName, start_offset: int) -> Json:
    async with _client(cfg) as client:
        skipped = await client.admin.abandon_unavailable_range(topic.path, start_offset)
    return {"topic": topic.path, "start_offset": start_offset, "skipped": skipped}


@topics.command("abandon-range")
@click.argument("topic", callback=_parse_topic)
@click.argument("start_offset", type=click.IntRange(min=0))
@click.pass_obj
def topics_abandon_range(cfg: Config, topic: TopicName, start_offset: int) -> None:
    """Give up waiting for TOPIC's unavailable range starting at START_OFFSET (§5.5): its
    offsets not in object storage are skipped by subscriptions (counted) and by tiering. Use
    it when the failed broker's disk is lost for good."""
    doc = _run(_topics_abandon_range(cfg, topic, start_offset))
    _emit(cfg, doc, lambda d: f"abandoned the unavailable range of {d['topic']} at {d['start_offset']}: "
          f"{d['skipped']} offsets will never be delivered")


@topics.command("unload")
@click.argument("topic", callback=_parse_topic)
@click.pass_obj
def topics_unload(cfg: Config, topic: TopicName) -> None:
    """Release TOPIC from its owner; the leader assigns it again, to another active broker
    when there is one (§1.5, §5.3). Prints the next owner's first offset and the new owner."""
    doc = _run(_topics_unload(cfg, topic))
    _emit(
        cfg,
        doc,
        lambda d: f"unloaded {d['topic']} from {_owner_text(d['previous_owner'])}; "
        f"now owned by {_owner_text(d['owner'])}, continuing at offset {d['next_offset']}",
    )


async def _topics_delete(cfg: Config, topic: TopicName, force: bool) -> Json:
    async with _client(cfg) as client:
        deleted = await client.admin.delete_topic(topic.path, force=force)
    return {"topic": topic.path, "force": force, "deleted": deleted}


@topics.command("delete")
@click.argument("topic", callback=_parse_topic)
@click.option("--force", is_flag=True, help="Delete even with producers or consumers connected (they are closed).")
@click.pass_obj
def topics_delete(cfg: Config, topic: TopicName, force: bool) -> None:
    """Delete TOPIC, without asking: its etcd keys (§1.4, §1.5, §2.2, §3, §5), its WAL and its
    segment objects; a partitioned topic partition by partition. Its Iceberg table is kept.

    Refused while producers or consumers are connected, unless --force closes them (a client
    producer that keeps sending creates the topic again). The name can be created again; it
    starts at offset 0. Prints every topic deleted.
    """
    doc = _run(_topics_delete(cfg, topic, force))
    _emit(
        cfg,
        doc,
        lambda d: f"deleted {d['topic']}"
        if d["deleted"] == [d["topic"]]
        else f"deleted partitioned topic {d['topic']}" + "".join(f"\ndeleted {p}" for p in d["deleted"]),
    )


async def _topics_set_schema_policy(cfg: Config, topic: TopicName, allow_raw: bool) -> Json:
    async with _client(cfg) as client:
        policies = await client.admin.set_topic_schema_policy(topic.path, allow_raw=allow_raw)
    return {
        "topic": topic.path,
        "policies": [{"topic": p.topic, "subject": p.subject, "allow_raw": p.allow_raw} for p in policies],
    }


@topics.command("set-schema-policy")
@click.argument("topic", callback=_parse_topic)
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
    doc = _run(_topics_set_schema_policy(cfg, topic, allow_raw))
    _emit(
        cfg,
        doc,
        lambda d: "\n".join(
            f"{p['topic']}: raw messages {'allowed' if p['allow_raw'] else 'refused'}"
            + (f" (schema subject {p['subject']})" if p["subject"] else " (no schema subject yet)")
            for p in d["policies"]
        ),
    )


async def _topics_set_table_layout(cfg: Config, topic: TopicName, partition_by: str) -> Json:
    async with _store(cfg) as store:
        if await store.get(keys.topic_root(topic)) is None:
            raise AdminError(f"topic {topic.path!r} not found")
        layout = TableLayout(partition_transform=partition_by)
        revision = await store.put(keys.topic_table(topic), layout)
    return {"topic": topic.path, "key": keys.topic_table(topic), "revision": revision, **layout.to_json()}


@topics.command("set-table-layout")
@click.argument("topic", callback=_parse_topic)
@click.option(
    "--partition-by",
    type=click.Choice(PARTITION_TRANSFORMS),
    required=True,
    help="Partition TOPIC's Iceberg table by this transform of _publish_time (none: unpartitioned).",
)
@click.pass_obj
def topics_set_table_layout(cfg: Config, topic: TopicName, partition_by: str) -> None:
    """Choose how TOPIC's Iceberg table is partitioned (§3.9; default day). The next tiering
    evolves the table's partition spec in place: files already written keep theirs until
    compaction rewrites them."""
    doc = _run(_topics_set_table_layout(cfg, topic, partition_by))
    _emit(
        cfg,
        doc,
        lambda d: f"{d['topic']}: table partitioned by "
        + ("nothing" if d["partition_transform"] == "none" else f"{d['partition_transform']}(_publish_time)")
        + f" from the next tiering on ({d['key']} at revision {d['revision']})",
    )


# ---------------------------------------------------------------------------- subscriptions


@cli.group(short_help="Subscriptions and their cursors.")
def subscriptions() -> None:
    """Subscriptions and their cursors (docs/etcd-layout.md §3.4, §3.5): list, reset-cursor.

    Deleting a subscription is not available yet.
    """


async def _subscriptions_list(cfg: Config, topic: TopicName) -> Json:
    prefix = keys.topic_root(topic) + "/subscriptions/"
    async with _store(cfg) as store:
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
            entry["cursor"] = _as_int(kv.value)
    loaded: dict[str, Any] = {}
    answered = True
    try:
        async with _client(cfg) as client:
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
                "type": live.subscription_type.name.capitalize() if live else _type_name(meta.get("subscription_type")),
                "active_consumer_id": _as_int(meta.get("consumer_id")),
                "consumer_name": meta.get("consumer_name") if isinstance(meta.get("consumer_name"), str) else None,
                "stored_cursor": stored.get(name, {}).get("cursor"),
                "loaded": live is not None,
                "cursor": live.cursor if live else None,
                "read_position": live.read_position if live else None,
                "consumers": live.consumers if live else None,
                "records_from_object_storage": live.records_from_object_storage if live else None,
                "skipped_below_retention": live.skipped_below_retention if live else None,
            }
        )
    return {"topic": topic.path, "owner_answered": answered, "subscriptions": rows}


@subscriptions.command("list")
@click.argument("topic", callback=_parse_topic)
@click.pass_obj
def subscriptions_list(cfg: Config, topic: TopicName) -> None:
    """Every subscription of TOPIC from etcd (§3.4) with its stored cursor (§3.5), merged with
    the state its owner has loaded (live cursor, read position, consumers)."""
    doc = _run(_subscriptions_list(cfg, topic))
    _emit(
        cfg,
        doc,
        lambda d: _table(
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
    async with _client(cfg) as client:
        next_offset = await client.admin.reset_cursor(topic.path, subscription, **position)
    return {"topic": topic.path, "subscription": subscription, "position": position, "next_offset": next_offset}


@subscriptions.command("reset-cursor")
@click.argument("topic", callback=_parse_topic)
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
    doc = _run(_reset_cursor(cfg, topic, subscription, positions[0]))
    _emit(
        cfg,
        doc,
        lambda d: f"subscription {d['subscription']} of {d['topic']} now delivers from offset {d['next_offset']}",
    )


# ---------------------------------------------------------------------------- entry point


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"error: {_one_line(message)}", err=True)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run ``danube-admin`` and exit: 0 on success, 2 for bad arguments, 1 for a refusal by the
    cluster (each error as one ``error: ...`` line on stderr, never a traceback)."""
    try:
        result = cli.main(
            args=list(argv) if argv is not None else None, prog_name="danube-admin", standalone_mode=False
        )
    except click.exceptions.NoArgsIsHelpError as exc:  # a group named without a verb: its help
        click.echo(exc.format_message(), err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        _fail("interrupted", 130)
    except click.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except InvalidNameError as exc:
        _fail(str(exc), 2)
    except DanubeError as exc:
        _fail(str(exc), 1)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except BrokenPipeError:
        sys.exit(1)
    except Exception as exc:  # never a traceback; say what broke
        _fail(f"unexpected {type(exc).__name__}: {exc}", 1)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
