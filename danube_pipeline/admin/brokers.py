"""``danube-admin brokers``: registered brokers, the leader, draining (``docs/etcd-layout.md`` §1).

Verbs and the JSON each prints:

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
``brokers stats [--interval-s S] [--json]``
    per broker: state, topics owned, msg/s in and out, WAL bytes, disk free, RPC errors, from
    two scrapes of each broker's ``/metrics``; the document is described in
    :mod:`danube_pipeline.admin.stats`.
"""

from __future__ import annotations

import dataclasses

import click

from danube_pipeline.admin import stats
from danube_pipeline.admin.arguments import is_address
from danube_pipeline.admin.config import Config, danube_client, metadata_store, run
from danube_pipeline.admin.output import Json, cell, emit, table
from danube_pipeline.metadata import keys


@click.group(short_help="Registered brokers, the leader, draining.")
def brokers() -> None:
    """Registered brokers, the leader, draining (docs/etcd-layout.md §1)."""


async def _brokers_list(cfg: Config) -> Json:
    async with danube_client(cfg) as client:
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
    doc = run(_brokers_list(cfg))
    emit(
        cfg,
        doc,
        lambda d: f"cluster {d['cluster_name']}\n"
        + table(
            ["BROKER_ID", "ADDRESS", "MODE", "LEADER"],
            [[b["broker_id"], b["address"], b["mode"] or "-", b["leader"]] for b in d["brokers"]],
        ),
    )


@brokers.command("leader")
@click.pass_obj
def brokers_leader(cfg: Config) -> None:
    """The leader broker (§1.7): id, address and mode; nulls when no leader is recorded."""
    listed = run(_brokers_list(cfg))
    leader = next((b for b in listed["brokers"] if b["leader"]), None)
    doc = {
        "broker_id": listed["leader_broker_id"],
        "address": leader["address"] if leader else None,
        "mode": leader["mode"] if leader else None,
    }
    emit(
        cfg,
        doc,
        lambda d: "no leader recorded"
        if d["broker_id"] is None
        else f"leader {d['broker_id']} at {cell(d['address'])} ({cell(d['mode'])})",
    )


async def _drain(cfg: Config, target: str) -> Json:
    async with danube_client(cfg) as client:
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
    async with metadata_store(cfg) as store:
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
    if not address_or_id.isdigit() and not is_address(address_or_id):
        raise click.BadParameter(f"{address_or_id!r} is neither a broker id nor host:port", param_hint="'ADDRESS_OR_ID'")
    doc = run(_drain(cfg, address_or_id))
    emit(
        cfg,
        doc,
        lambda d: f"broker {d['broker_id']} ({d['address']}) is {cell(d['mode'])}; "
        f"released {len(d['released_topics'])} topic(s)"
        + "".join(f"\n  {t}" for t in d["released_topics"]),
    )


@brokers.command("stats")
@click.option("--interval-s", type=click.FloatRange(0.1, 60.0), default=1.0, show_default=True,
              help="Seconds between the two scrapes of each broker's metrics the rates come from.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document (as the root --output json).")
@click.pass_obj
def brokers_stats(cfg: Config, interval_s: float, as_json: bool) -> None:
    """Per broker: state (§1.3), leader, topics owned, msg/s in and out, WAL bytes, disk free
    and RPC errors, from its /metrics (brokers started with --metrics-listen)."""
    cfg = dataclasses.replace(cfg, output="json") if as_json else cfg
    emit(cfg, run(stats.brokers_stats(cfg, interval_s)), stats.brokers_stats_text)
