"""``danube-pipeline dev``'s start-up note and ``env``/``backfill`` argument handling, against a
real etcd (the full launcher is exercised by ``tests/test_dev_stop.py``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from danube_pipeline.dev.cli import add_backfill_days, brokers_not_running, missing_brokers_note
from danube_pipeline.dev.stack import read_env_file, write_env_file
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

pytestmark = pytest.mark.integration


def test_topics_of_brokers_not_started_are_named_with_what_to_do(etcd_endpoints: list[str]) -> None:
    """After an unclean stop of 3 brokers, a start with 1 names the other ids, counts their
    topics and says to start as many brokers as before."""

    async def setup() -> None:
        async with await MetadataStore.connect(etcd_endpoints) as store:
            for broker_id, topic in ((11, "a"), (12, "b"), (12, "c"), (13, "d")):
                await store.put(keys.topic_assignment(broker_id, TopicName("default", topic)), None)

    asyncio.run(setup())
    absent = asyncio.run(brokers_not_running(etcd_endpoints, {11}))
    assert absent == {12: 2, 13: 1}
    note = missing_brokers_note(absent, started=1)
    assert "3 topic(s) are assigned to broker id(s) 12, 13" in note and "make dev BROKERS=3" in note
    assert asyncio.run(brokers_not_running(etcd_endpoints, {11, 12, 13})) == {}


def test_env_file_round_trip_and_bad_backfill_days(tmp_path: Path) -> None:
    exports = {"DANUBE_HOME": str(tmp_path / "a b"), "DANUBE_CATALOG_URI": "sqlite:////x/it's.db"}
    write_env_file(tmp_path, exports)
    assert read_env_file(tmp_path) == exports  # quoted for the shell, read back as written
    with pytest.raises(FileNotFoundError, match="start `make dev`"):
        read_env_file(tmp_path / "missing")
    with pytest.raises(ValueError):
        add_backfill_days("2026-13-01|default.flights", exports)
    assert add_backfill_days("default.flights", exports) == []  # a topic key alone has no day
