"""``danube-admin namespaces``: namespaces and their policies (``docs/etcd-layout.md`` §2).

Verbs and the JSON each prints:

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
    Refused (exit 1) for a namespace with no key under ``/namespaces/NS/`` (§2) and no topic
    under ``/topics/NS/`` (§3): a typo must not print a policy as if it existed.
``namespaces set-policy NS --FIELD N ...``
    ``{"namespace": str, "changed": [str], "revision": int, "before": object, "policy": object}``:
    one option per ``NamespacePolicy`` field (``--max-message-size``,
    ``--retention-time-minutes``, ``--retention-size-mb``, ...; non-negative integers, 0 means
    unlimited; ``--object-lifecycle keep|after-commit``; ``--replication-factor N`` and
    ``--min-insync-replicas N``, integers >= 1, the second not above the first). Reads the policy, changes only the fields given, and writes it back with a
    compare on the key's ``mod_revision`` (absent: must still be absent), so a concurrent change
    is never overwritten: the verb fails instead. The value written is the canonical
    ``NamespacePolicy`` (every field, snake-case names; camelCase aliases are folded in and
    unknown fields dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import click

from danube_pipeline.admin.arguments import parse_namespace
from danube_pipeline.admin.config import AdminError, Config, metadata_store, run
from danube_pipeline.admin.output import Json, emit, field_lines, table
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import OBJECT_LIFECYCLES, NamespacePolicy


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
    "object_lifecycle": "keep: segment objects stay; after-commit: tiering deletes each one once the "
    "topic's Iceberg table is verified to hold it (needs the table layout's raw_payload).",
    "replication_factor": "Brokers holding a copy of each topic's log, the owner included (1: no replication).",
    "min_insync_replicas": "In-sync copies, the owner included, a batch needs before its producer is acked "
    "(at most --replication-factor).",
}


@click.group(short_help="Namespaces and their policies.")
def namespaces() -> None:
    """Namespaces and their policies (docs/etcd-layout.md §2)."""


async def _namespaces_list(cfg: Config) -> Json:
    prefix = keys.NAMESPACES + "/"
    async with metadata_store(cfg) as store:
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
    doc = run(_namespaces_list(cfg))
    emit(
        cfg,
        doc,
        lambda d: table(
            ["NAMESPACE", "POLICY", "TOPICS"], [[n["namespace"], n["policy"], n["topics"]] for n in d["namespaces"]]
        ),
    )


async def _namespaces_create(cfg: Config, namespace: str) -> Json:
    key = keys.namespace_policy(namespace)
    async with metadata_store(cfg) as store:
        created = await store.put_if_absent(key, NamespacePolicy())
        policy: object = NamespacePolicy().to_json()
        if not created:
            current = await store.get(key)
            policy = current.value if current is not None else None
    return {"namespace": namespace, "created": created, "policy": policy}


@namespaces.command("create")
@click.argument("namespace", callback=parse_namespace)
@click.pass_obj
def namespaces_create(cfg: Config, namespace: str) -> None:
    """Create NAMESPACE: write the default policy unless one exists (§2.1)."""
    doc = run(_namespaces_create(cfg, namespace))
    emit(
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


async def _require_namespace(store: MetadataStore, namespace: str) -> None:
    """Raise unless ``namespace`` has a key under ``/namespaces/{ns}/`` (§2) or a topic (§3).

    Raises:
        AdminError: neither exists.
        MetadataStoreError: etcd cannot be reached.
    """
    for prefix in (f"{keys.NAMESPACES}/{namespace}/", f"{keys.TOPICS}/{namespace}/"):
        if await store.has_prefix(prefix):
            return
    raise AdminError(
        f"namespace {namespace!r} not found (no policy and no topic); "
        f"create it with: danube-admin namespaces create {namespace}"
    )


async def _get_policy(cfg: Config, namespace: str) -> Json:
    async with metadata_store(cfg) as store:
        await _require_namespace(store, namespace)
        policy, mod_revision = await _read_policy(store, namespace)
    return {
        "namespace": namespace,
        "key": keys.namespace_policy(namespace),
        "stored": mod_revision != 0,
        "mod_revision": mod_revision or None,
        "policy": policy.to_json(),
    }


def limit_text(value: object) -> object:
    """A policy limit for people: ``unlimited`` for 0 (§2.1), else the value unchanged."""
    return "unlimited" if value == 0 and not isinstance(value, bool) else value


def _field(policy: Json, name: str) -> object:
    """A field of a policy's JSON; its default when the JSON leaves it out (``object_lifecycle``)."""
    return policy[name] if name in policy else getattr(NamespacePolicy(), name)


def _policy_text(d: Json) -> str:
    note = "" if d["stored"] else " (none stored: the defaults apply)"
    return f"policy of namespace {d['namespace']}{note}\n" + field_lines(
        [(name, limit_text(value)) for name, value in d["policy"].items()]
    )


@namespaces.command("get-policy")
@click.argument("namespace", callback=parse_namespace)
@click.pass_obj
def namespaces_get_policy(cfg: Config, namespace: str) -> None:
    """The policy of NAMESPACE (§2.1); the defaults when none is stored. 0 means unlimited.
    Refused (exit 1) for a namespace with neither a policy nor a topic."""
    emit(cfg, run(_get_policy(cfg, namespace)), _policy_text)


async def update_namespace_policy(store: MetadataStore, namespace: str, changes: dict[str, int | str]) -> Json:
    """Read the policy of ``namespace``, apply ``changes``, write it back iff unchanged since.

    The write is a compare on the key's ``mod_revision`` (on its absence when no policy was
    stored), so a concurrent writer's change is never lost (``docs/etcd-layout.md`` §2.1).

    Args:
        store: a connected store.
        namespace: a valid namespace name.
        changes: ``NamespacePolicy`` field -> new non-negative value (``object_lifecycle``: one
            of ``OBJECT_LIFECYCLES``; the replication fields: >= 1).

    Returns:
        ``{"namespace", "changed": [field], "revision": int, "before": policy, "policy": policy}``.

    Raises:
        AdminError: the policy changed (or appeared) after it was read, it is unreadable, or
            the result is invalid (``min_insync_replicas`` above ``replication_factor``);
            nothing was written.
        MetadataStoreError: etcd cannot be reached.
    """
    key = keys.namespace_policy(namespace)
    before, mod_revision = await _read_policy(store, namespace)
    try:
        after = before.overridden(changes)
    except ValueError as exc:
        raise AdminError(f"policy of namespace {namespace!r} refused, nothing was written: {exc}") from None
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


async def _set_policy(cfg: Config, namespace: str, changes: dict[str, int | str]) -> Json:
    async with metadata_store(cfg) as store:
        return await update_namespace_policy(store, namespace, changes)


def _policy_options(command: Callable[..., None]) -> Callable[..., None]:
    for name in reversed(POLICY_FIELDS):
        command = click.option(
            "--" + name.replace("_", "-"),
            name,
            type=click.Choice(OBJECT_LIFECYCLES) if name == "object_lifecycle"
            else click.IntRange(min=1) if name in NamespacePolicy.REPLICATION_FIELDS else click.IntRange(min=0),
            default=None,
            help=_POLICY_HELP.get(name, ""),
        )(command)
    return command


@namespaces.command("set-policy")
@click.argument("namespace", callback=parse_namespace)
@_policy_options
@click.pass_obj
def namespaces_set_policy(cfg: Config, /, namespace: str, **fields: int | str | None) -> None:
    """Change only the given fields of NAMESPACE's policy (§2.1); 0 means unlimited.

    The policy is read, changed and written back with a compare on its mod revision: if
    someone changed it in between, nothing is written and the command fails (exit 1).
    """
    changes = {name: value for name, value in fields.items() if value is not None}
    if not changes:
        raise click.UsageError("give at least one policy field, e.g. --max-message-size 1048576")
    doc = run(_set_policy(cfg, namespace, changes))
    emit(
        cfg,
        doc,
        lambda d: f"updated policy of namespace {d['namespace']} at revision {d['revision']}\n"
        + field_lines([(n, f"{limit_text(_field(d['before'], n))} -> {limit_text(_field(d['policy'], n))}") for n in d["changed"]]),
    )
