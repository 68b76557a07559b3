"""The continuous writer's log: the Alembic migrations a Dagster instance runs when its SQL
storage opens write no INFO lines into it; the writer's own INFO lines stay."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from dagster import instance_for_test

from assets.continuous_writer import main

pytestmark = pytest.mark.unit


@pytest.fixture
def root_at_info() -> Iterator[None]:
    """The root logger at INFO, as the writer's ``logging.basicConfig`` leaves it (under pytest,
    whose handlers are already on the root logger, ``basicConfig`` adds none); levels restored
    afterwards."""
    root, alembic = logging.getLogger(), logging.getLogger("alembic")
    saved = root.level, alembic.level
    root.setLevel(logging.INFO)
    yield
    root.setLevel(saved[0])
    alembic.setLevel(saved[1])


def test_alembic_info_lines_stay_out_of_the_writer_log(
    root_at_info: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert main([]) == 2  # logging configured, then stopped: no DAGSTER_HOME
    with instance_for_test():  # a fresh SQLite instance: Alembic stamps its schema
        pass
    logging.getLogger("assets.continuous_writer").info("a writer line")
    alembic = [r for r in caplog.records if r.name.startswith("alembic")]
    assert alembic == [], [r.getMessage() for r in alembic]
    assert "a writer line" in caplog.messages
