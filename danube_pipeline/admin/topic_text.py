"""The text form of ``danube-admin topics describe`` (its JSON is built in
:mod:`danube_pipeline.admin.topics`)."""

from __future__ import annotations

import datetime as dt

from danube_pipeline.admin.output import Json, field_lines, owner_text, table
from danube_pipeline.client import DeliveryMode


def describe_text(d: Json) -> str:
    """``topics describe``'s text output from its JSON (``danube_pipeline.admin.topics``): the
    summary fields, then the unavailable ranges, followers, open producers and loaded
    subscriptions as tables."""
    if "partitions" in d:
        head = field_lines(
            [("topic", d["topic"]), ("partitions", d["partitions"]), ("delivery", d["delivery"]), ("table", d["table"])]
        )
        rows = table(
            ["PARTITION", "OWNER", "NEXT_OFFSET"],
            [[p["topic"], owner_text(p["owner"]), p["next_offset"]] for p in d["partition_topics"]],
        )
        return f"{head}\n\npartitions:\n{rows}"
    summary = field_lines(
        [
            ("topic", d["topic"]),
            ("owner", owner_text(d["owner"])),
            ("delivery", d["delivery"]),
            ("Iceberg table", d["table"]),
            ("schema subject", d["schema_subject"] or "(none: raw payloads)"),
            ("next offset", d["next_offset"]),
            ("not yet tiered", "-" if d["tiering_lag_offsets"] is None else f"{d['tiering_lag_offsets']} offsets"),
            ("committed to table", "-" if d["committed_end_offset"] is None else (
                f"through offset {d['committed_end_offset']} at "
                f"{dt.datetime.fromtimestamp(d['committed_at_ms'] / 1000, dt.UTC):%Y-%m-%d %H:%M:%S} UTC")),
            ("first local offset", d["first_local_offset"]),
            ("WAL bytes", d["wal_bytes"]),
            ("sealed segments", d["sealed_segments"]),
            ("remote offsets", "-" if d["remote_first_offset"] is None
             else f"{d['remote_first_offset']}..{d['remote_end_offset']}"),
            ("earliest offset", d["earliest_offset"]),
            ("owner epoch", d["owner_epoch"]),
            ("reserved through", d["reserved_end_offset"]),
            ("publish throttled", f"{d['publish_throttled_ms']} ms"),
            ("high watermark", d["high_watermark"]),
            *(
                [("replicas", ", ".join(map(str, d["replicas"]))), ("in-sync replicas", ", ".join(map(str, d["isr"])))]
                if d["replicas"]
                else []
            ),
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
    unavailable = "" if not ranges else "\n\nunavailable ranges (held by failed brokers, §5.5):\n" + table(
        ["START", "END", "BROKER", "LAST_WRITTEN", "ABANDONED"],
        [[u["start_offset"], u["end_offset"], u["broker_id"], u["last_written"], u["abandoned"]] for u in ranges],
    )
    followers = "" if not d["followers"] else "\n\nfollowers:\n" + table(
        ["BROKER", "LOG_END", "LAG", "LAST_FETCH_S", "IN_SYNC"],
        [[f["broker_id"], f["log_end_offset"], f["lag"], f["last_fetch_s"], f["in_sync"]] for f in d["followers"]],
    )
    subs = table(
        ["SUBSCRIPTION", "TYPE", "CURSOR", "READ_POSITION", "CONSUMERS", "DISPATCH_THROTTLED_MS"],
        [
            [s["name"], s["type"], s["cursor"], s["read_position"], s["consumers"], s["dispatch_throttled_ms"]]
            for s in d["subscriptions"]
        ],
    )
    producers = table(
        ["PRODUCER", "PRODUCER_ID"], [[p["producer_name"], p["producer_id"]] for p in d["producers"]]
    )
    return f"{summary}{unavailable}{followers}\n\nopen producers:\n{producers}\n\nloaded subscriptions:\n{subs}"
