"""``--log-format json``: one JSON object per line with ``broker``, ``topic`` and ``subscription``
fields where they apply (:mod:`danube_pipeline.logs`), on a real broker process; and the shared
formatter's fields, in process."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.__main__ import parse_command_line
from danube_pipeline import logs
from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.modes import InitialPosition

TOPIC = "/default/logged"


@pytest.fixture
def json_logger() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger of its own writing JSON lines into a buffer (the root logger is pytest's)."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logs.JsonFormatter())
    handler.addFilter(logs.ContextFilter())
    logger = logging.getLogger("danube.test.log_format")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield logger, buf
    logger.removeHandler(handler)


def _lines(buf: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


@pytest.mark.unit
def test_json_lines_take_fields_from_extra_then_the_context(json_logger: tuple[logging.Logger, io.StringIO]) -> None:
    logger, buf = json_logger
    logger.info("plain %d", 1)
    with logs.bind(topic="/ns/a", subscription="s1"):
        logger.warning("bound")
        logger.info("overridden", extra={"topic": "/ns/b"})
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    logger.info("unbound again")
    plain, bound, overridden, failed, after = _lines(buf)
    assert plain["message"] == "plain 1" and plain["level"] == "INFO" and plain["logger"] == "danube.test.log_format"
    assert plain["ts"].endswith("Z") and "topic" not in plain and "subscription" not in plain
    assert (bound["topic"], bound["subscription"], bound["level"]) == ("/ns/a", "s1", "WARNING")
    assert (overridden["topic"], overridden["subscription"]) == ("/ns/b", "s1")
    assert failed["level"] == "ERROR" and "ValueError: boom" in failed["exc"]
    assert "topic" not in after
    with pytest.raises(ValueError, match="unknown log field"):
        with logs.bind(tenant="x"):
            pass


@pytest.mark.unit
def test_text_format_is_the_old_line_and_unknown_formats_are_refused() -> None:
    assert logs.TEXT_FORMAT == "%(asctime)s %(levelname)s %(name)s: %(message)s"
    with pytest.raises(ValueError, match="unknown log format"):
        logs.configure("INFO", "xml")


@pytest.mark.unit
def test_log_format_comes_from_the_flag_or_the_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "broker.yml"
    cfg.write_text("log_format: json\n", encoding="utf-8")
    assert parse_command_line(["--data-dir", str(tmp_path)])[1].log_format == "text"
    assert parse_command_line(["--config", str(cfg), "--data-dir", str(tmp_path)])[1].log_format == "json"
    flag_wins = ["--config", str(cfg), "--log-format", "text", "--data-dir", str(tmp_path)]
    assert parse_command_line(flag_wins)[1].log_format == "text"
    cfg.write_text("log_format: xml\n", encoding="utf-8")
    with pytest.raises(SystemExit) as info:
        parse_command_line(["--config", str(cfg)])
    assert info.value.code == 2 and "log_format 'xml'" in capsys.readouterr().err


@pytest.mark.integration
def test_a_json_broker_writes_only_json_lines_each_with_its_broker_id(
    start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    broker = start_broker(extra_args=["--log-format", "json", "--object-store-url", (tmp_path / "objects").as_uri()])

    async def traffic() -> None:
        async with DanubeClient([broker.address]) as client:
            await client.admin.create_topic(TOPIC)
            async with client.producer(TOPIC, producer_name="p") as producer:
                await producer.send(b"unacked")
            async with client.consumer(TOPIC, subscription="slow", initial_position=InitialPosition.EARLIEST,
                                       ack_timeout_ms=200) as consumer:
                first = await consumer.receive(timeout_ms=5_000)
                again = await consumer.receive(timeout_ms=5_000)  # the ack timeout redelivered it
                assert again.offset == first.offset

    asyncio.run(traffic())
    broker.stop()
    text = broker.log_path.read_text(encoding="utf-8")
    lines = [json.loads(line) for line in text.splitlines()]  # every line parses
    assert len(lines) >= 3
    assert all({"ts", "level", "logger", "message", "broker"} <= set(line) for line in lines), lines
    broker_id = str(broker.broker_id)
    serving = next(i for i, line in enumerate(lines) if "serving on" in line["message"])
    assert {line["broker"] for line in lines[serving:]} == {broker_id}
    loaded = [line for line in lines if line["message"].startswith(f"topic {TOPIC} loaded")]
    assert loaded and all(line["topic"] == TOPIC for line in loaded), lines
    # the subscription's dispatch task logs the redelivery with both fields
    redelivered = [line for line in lines if "redelivered" in line["message"]]
    assert redelivered and all((line["topic"], line["subscription"]) == (TOPIC, "slow") for line in redelivered), lines


@pytest.mark.unit
def test_the_writer_and_the_dev_launcher_take_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    from assets.continuous_writer import main as writer_main
    from danube_pipeline.dev.cli import main as dev_main

    for entry in (writer_main, lambda argv: dev_main(["dev", *argv])):
        with pytest.raises(SystemExit) as info:
            entry(["--log-format", "xml"])
        assert info.value.code == 2 and "invalid choice: 'xml'" in capsys.readouterr().err
