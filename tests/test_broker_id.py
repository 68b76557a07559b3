"""A broker whose id file is unreadable stops with a clear error and never mints a new id
(issue 21 #17), against real broker processes and a real etcd."""

from __future__ import annotations

from pathlib import Path

import pytest

from danube_pipeline.dev.localcluster import BrokerProcess

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("content", [b"", b"garbage\n"], ids=["empty", "garbage"])
def test_a_broker_with_an_unreadable_id_file_exits_and_keeps_the_file(
    etcd_endpoints: list[str], tmp_path: Path, content: bytes
) -> None:
    data_dir = tmp_path / "broker"
    data_dir.mkdir()
    id_file = data_dir / "broker_id"
    id_file.write_bytes(content)
    broker = BrokerProcess(etcd_endpoints=etcd_endpoints, data_dir=data_dir)
    try:
        with pytest.raises(RuntimeError, match="broker exited with code 1 before it was ready"):
            broker.start(timeout_s=30)
    finally:
        broker.stop()
    log = broker.log_path.read_text(errors="replace")
    assert "BrokerIdUnreadableError" in log and f"broker id file {id_file} is unreadable" in log
    assert "will not start with a new id" in log
    assert id_file.read_bytes() == content  # no new id written
    assert sorted(p.name for p in data_dir.iterdir()) == ["broker.log", "broker_id"]

    # What the error says to do: write the id back; the broker then starts under it.
    id_file.write_text("12345\n")
    broker = BrokerProcess(etcd_endpoints=etcd_endpoints, data_dir=data_dir)
    try:
        broker.start(timeout_s=30)
        assert broker.broker_id == 12345
    finally:
        broker.stop()
