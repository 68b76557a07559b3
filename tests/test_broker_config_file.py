"""The broker's configuration file (``--config``), ``--print-config`` and the refusal to listen on
a non-loopback address without TLS and authentication (``broker/config_file.py``)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import eventually_sync

from broker.__main__ import parse_command_line
from broker.config import BrokerConfig
from broker.config_file import (
    EXTRA_KEYS,
    SECTIONS,
    ConfigFileError,
    build_config,
    is_loopback_host,
    listen_exposure,
    load_config_file,
)
from danube_pipeline import faults
from danube_pipeline.client import DanubeClient

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "docs" / "danube_broker.example.yml"
DANUBE_VARS = ("DANUBE_ETCD_ENDPOINTS", "DANUBE_OBJECT_STORE_URL")


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _clean_env(tmp_path: Path) -> dict[str, str]:
    """The environment without any ``DANUBE_*`` variable, ``DANUBE_HOME`` in ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DANUBE_")}
    env["DANUBE_HOME"] = str(tmp_path / "home")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def no_danube_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in DANUBE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DANUBE_HOME", str(tmp_path / "home"))
    return monkeypatch


# ------------------------------------------------------------------ unit: layering


@pytest.mark.unit
def test_flags_override_environment_which_overrides_the_file(no_danube_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = _write(
        tmp_path / "b.yml",
        "etcd_endpoints: [file-etcd:2379]\n"
        "object_store_url: file:///from-file\n"
        "segment_max_bytes: 111111\n"
        "rebalance: false\n"
        "super_admins: [file-admin]\n"
        "log_level: DEBUG\n",
    )
    config, _, log_level = parse_command_line(["--config", str(cfg)])
    assert config.etcd_endpoints == ["file-etcd:2379"]
    assert config.object_store_url == "file:///from-file"
    assert (config.segment_max_bytes, config.rebalance, config.super_admins) == (111111, False, ("file-admin",))
    assert log_level == "DEBUG"
    assert config.lease_ttl_s == 10  # not in the file: the default
    assert config.data_dir == tmp_path / "home" / "broker"  # DANUBE_HOME moves the default

    no_danube_env.setenv("DANUBE_ETCD_ENDPOINTS", "env-etcd:2379")
    no_danube_env.setenv("DANUBE_OBJECT_STORE_URL", "file:///from-env")
    config, _, _ = parse_command_line(["--config", str(cfg)])
    assert config.etcd_endpoints == ["env-etcd:2379"]
    assert config.object_store_url == "file:///from-env"
    assert config.segment_max_bytes == 111111

    config, _, log_level = parse_command_line([
        "--config", str(cfg), "--etcd-endpoints", "flag-etcd:2379,flag-etcd2:2379",
        "--object-store-url", "file:///from-flag", "--segment-max-bytes", "222222", "--rebalance",
        "--super-admin", "alice", "--super-admin", "bob", "--log-level", "WARNING",
    ])  # fmt: skip
    assert config.etcd_endpoints == ["flag-etcd:2379", "flag-etcd2:2379"]
    assert config.object_store_url == "file:///from-flag"
    assert (config.segment_max_bytes, config.rebalance, config.super_admins) == (222222, True, ("alice", "bob"))
    assert log_level == "WARNING"


@pytest.mark.unit
def test_no_file_and_no_flags_give_the_old_defaults(no_danube_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config, _, log_level = parse_command_line([])
    assert config == BrokerConfig(data_dir=tmp_path / "home" / "broker")
    assert log_level == "INFO"
    assert not config.tls and not config.authentication and not config.insecure


@pytest.mark.unit
def test_sections_and_relative_paths_resolve_against_the_file(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    cfg = _write(
        tmp_path / "conf" / "b.yml",
        "tls: {cert_file: certs/b.pem, key_file: /abs/b.key}\n"
        "auth: {jwt_issuer: danube, jwt_leeway_s: 2, mtls: false}\n"
        "etcd: {endpoints: 'e1:2379, e2:2379', user: broker, password_file: etcd.pw}\n"
        "data_dir: data\n"
        "rebalance_threshold: 0.25\n"
        "advertised_addr: null\n",
    )
    values = load_config_file(cfg)
    assert values == {
        "tls_cert_file": tmp_path / "conf" / "certs" / "b.pem",
        "tls_key_file": Path("/abs/b.key"),
        "auth_jwt_issuer": "danube",
        "auth_jwt_leeway_s": 2.0,
        "auth_mtls": False,
        "etcd_endpoints": ["e1:2379", "e2:2379"],
        "etcd_user": "broker",
        "etcd_password_file": tmp_path / "conf" / "etcd.pw",
        "data_dir": tmp_path / "conf" / "data",
        "rebalance_threshold": "0.25",
    }
    assert build_config(values).rebalance_cv_threshold == 0.25


# ------------------------------------------------------------------ unit: errors


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "key"),
    [("bogus: 1\n", "bogus"), ("tls: {bogus_file: x}\n", "tls.bogus_file"), ("tls_cert: x\n", "tls_cert")],
)
def test_an_unknown_key_is_an_error_naming_key_and_file(tmp_path: Path, text: str, key: str) -> None:
    cfg = _write(tmp_path / "b.yml", text)
    with pytest.raises(ConfigFileError) as info:
        load_config_file(cfg)
    assert (info.value.key, info.value.path) == (key, str(cfg))
    assert f"'{key}'" in str(info.value) and str(cfg) in str(info.value)
    assert "unknown setting" in str(info.value)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ("lease_ttl_s: ten\n", "lease_ttl_s", "expected an integer, got a string"),
        ("lease_ttl_s: 1.5\n", "lease_ttl_s", "expected an integer, got a number"),
        ("segment_max_age_s: true\n", "segment_max_age_s", "expected a number, got a boolean"),
        ("rebalance: 1\n", "rebalance", "expected true or false, got an integer"),
        ("super_admins: alice\n", "super_admins", "expected a list of strings, got a string"),
        ("super_admins: [1, 2]\n", "super_admins", "expected a list of strings, got a list"),
        ("tls: {cert_file: 5}\n", "tls.cert_file", "expected a file path (a string), got an integer"),
        ("auth_jwt_issuer: 987654321\n", "auth_jwt_issuer", "expected a string, got an integer"),
        ("object_store_options: [a]\n", "object_store_options", "expected a mapping with string keys, got a list"),
    ],
)
def test_a_wrong_type_is_an_error_naming_key_and_type(tmp_path: Path, text: str, key: str, expected: str) -> None:
    cfg = _write(tmp_path / "b.yml", text)
    with pytest.raises(ConfigFileError) as info:
        load_config_file(cfg)
    assert info.value.key == key
    assert str(info.value) == f"configuration file {cfg}: key '{key}': {expected}"
    assert "987654321" not in str(info.value)  # never the value: it may be a secret


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("lease_ttl_s: 1\nlease_ttl_s: 2\n", "key 'lease_ttl_s': given twice"),
        ("tls: {cert_file: a}\ntls_cert_file: b\n", "key 'tls_cert_file': given twice (also as 'tls.cert_file')"),
        ("- a\n- b\n", "must be a mapping"),
        ("listen: [unclosed\n", "is not valid YAML at line"),
    ],
)
def test_a_malformed_file_is_an_error(tmp_path: Path, text: str, reason: str) -> None:
    cfg = _write(tmp_path / "b.yml", text)
    with pytest.raises(ConfigFileError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        load_config_file(cfg)


@pytest.mark.unit
def test_a_bad_file_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = _write(tmp_path / "b.yml", "bogus: 1\n")
    with pytest.raises(SystemExit) as info:
        parse_command_line(["--config", str(cfg)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"python -m broker: error: configuration file {cfg}: key 'bogus': unknown setting " \
        "(see docs/danube_broker.example.yml)\n"


@pytest.mark.unit
def test_the_example_file_lists_every_setting_with_its_default(no_danube_env: pytest.MonkeyPatch) -> None:
    raw = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    keys = set()
    for key, value in raw.items():
        if key in SECTIONS:
            keys |= {f"{key}_{sub}" for sub in value}
        else:
            keys.add(key)
    assert keys == {f.name for f in dataclasses.fields(BrokerConfig)} | set(EXTRA_KEYS)
    assert build_config(load_config_file(EXAMPLE)) == build_config({})


# ------------------------------------------------------------------ unit: listen address


@pytest.mark.unit
@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
        ("LocalHost", True), ("0.0.0.0", False), ("::", False), ("[::]", False), ("", False),
        ("10.0.0.5", False), ("broker-1.example", False), ("128.0.0.1", False),
    ],
)  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


@pytest.mark.unit
def test_listen_exposure_names_what_is_missing(tmp_path: Path) -> None:
    def exposure(listen: str, **kwargs: Any) -> str | None:
        return listen_exposure(BrokerConfig(data_dir=tmp_path, listen=listen, **kwargs))

    assert exposure("127.0.0.1:6650") is None
    assert exposure("[::1]:0") is None
    assert exposure("0.0.0.0:6650") == "plaintext and unauthenticated"
    assert exposure("[::]:6650") == "plaintext and unauthenticated"
    assert exposure("10.1.2.3:6650", auth_jwt_secret_file=tmp_path / "s") == "plaintext"
    assert exposure("10.1.2.3:6650", tls_cert_file=tmp_path / "c", tls_key_file=tmp_path / "k") == "unauthenticated"
    assert exposure(
        "0.0.0.0:6650", tls_cert_file=tmp_path / "c", tls_key_file=tmp_path / "k", auth_jwt_secret_file=tmp_path / "s"
    ) is None  # fmt: skip


# ------------------------------------------------------------------ processes


def _broker(args: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker", *args], capture_output=True, text=True, env=env, timeout=60, cwd=REPO, **kwargs
    )


@pytest.mark.integration
def test_print_config_masks_credentials_and_exits_0(tmp_path: Path) -> None:
    cfg = _write(
        tmp_path / "b.yml",
        "listen: 0.0.0.0:7000\n"  # printing is not serving: no refusal
        "tls: {ca_file: ca.pem}\n"
        "object_store_url: s3://bucket/prefix\n"
        "object_store_options:\n"
        "  key: AKIAEXAMPLEKEYID\n"
        "  secret: s3-secret-value\n"
        "  client_kwargs: {aws_session_token: session-token-value}\n"
        "  endpoint_url: http://minio:minio-password@127.0.0.1:9000\n",
    )
    proc = _broker(["--config", str(cfg), "--print-config", "--s3-region", "eu-west-1"], _clean_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for secret in ("AKIAEXAMPLEKEYID", "s3-secret-value", "session-token-value", "minio-password"):
        assert secret not in proc.stdout and secret not in proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["object_store_options"] == {
        "key": "***",
        "secret": "***",
        "client_kwargs": {"aws_session_token": "***", "region_name": "eu-west-1"},
        "endpoint_url": "http://minio:***@127.0.0.1:9000",
    }
    assert printed["listen"] == "0.0.0.0:7000"
    assert printed["tls_ca_file"] == str(tmp_path / "ca.pem")
    assert printed["data_dir"] == str(tmp_path / "home" / "broker")
    assert printed["log_level"] == "INFO"
    assert set(printed) == {f.name for f in dataclasses.fields(BrokerConfig)} | {"log_level"}
    assert not (tmp_path / "home").exists()  # nothing started


@pytest.mark.integration
@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "192.0.2.10:6650"])
def test_a_non_loopback_listen_without_tls_and_auth_is_refused(tmp_path: Path, listen: str) -> None:
    cfg = _write(tmp_path / "b.yml", f"listen: '{listen}'\netcd_endpoints: [127.0.0.1:1]\ndata_dir: data\n")
    proc = _broker(["--config", str(cfg)], _clean_env(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        f"python -m broker: error: refusing to listen on {listen} (plaintext and unauthenticated): "
    )
    assert "--insecure" in proc.stderr
    assert not (tmp_path / "data").exists()  # refused before touching anything


@pytest.mark.integration
@pytest.mark.asyncio
async def test_insecure_wildcard_listen_starts_and_warns_at_every_start(start_broker: Any) -> None:
    broker = start_broker(host="0.0.0.0", extra_args=["--insecure"])
    async with DanubeClient([broker.address]) as client:
        async with client.producer("/default/insecure_listen", producer_name="p") as producer:
            assert await producer.send(b"hello") == 0
    broker.stop()
    broker.start()
    warnings = [
        line for line in broker.log_path.read_text(encoding="utf-8").splitlines()
        if " WARNING broker: INSECURE: serving plaintext and unauthenticated on non-loopback address 0.0.0.0:0" in line
    ]  # fmt: skip
    assert len(warnings) == 2, broker.log_path.read_text(encoding="utf-8")[-3000:]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_broker_configured_only_by_file_serves(etcd_endpoints: list[str], tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    ready = tmp_path / "ready.json"
    cfg = _write(
        tmp_path / "danube_broker.yml",
        f"listen: 127.0.0.1:0\n"
        f"etcd:\n  endpoints: {json.dumps(etcd_endpoints)}\n"
        f"data_dir: data\n"
        f"ready_file: ready.json\n"
        f"cluster_name: danube\n"
        f"segment_max_bytes: 1048576\n",
    )
    log_path = tmp_path / "broker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "broker", "--config", str(cfg)],
            stdout=log, stderr=subprocess.STDOUT, env=_clean_env(tmp_path), cwd=REPO,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, log_path.read_text(encoding="utf-8")[-3000:]
            assert time.monotonic() < deadline, "broker not ready in 30 s"
            time.sleep(0.05)
        address = str(json.loads(ready.read_text(encoding="utf-8"))["broker_addr"]).removeprefix("http://")
        async with DanubeClient([address]) as client:
            async with client.producer("/default/from_file", producer_name="p") as producer:
                assert [await producer.send(f"m-{i}".encode()) for i in range(3)] == [0, 1, 2]
        assert (data_dir / "wal" / "default" / "from_file").is_dir()  # data_dir came from the file
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log_path.read_text(encoding="utf-8")[-3000:]
    assert "WARNING broker: INSECURE" not in log_path.read_text(encoding="utf-8")


_SEND_ONE = """
import asyncio, sys
from danube_pipeline.client import DanubeClient

async def main() -> None:
    async with DanubeClient([sys.argv[1]]) as client:
        async with client.producer("/default/slow_disk", producer_name="p") as producer:
            await producer.send(b"m")

asyncio.run(main())
"""


@pytest.mark.integration
def test_a_stop_still_running_after_shutdown_report_s_logs_what_it_waits_for(start_broker: Any, tmp_path: Path) -> None:
    # A slow disk for real (the fault point blocks the commit's sync thread for 6 s): the stop
    # waits for that commit. After shutdown_report_s (1 s, from the file) the broker logs every
    # task's stack, the WAL writer's among them, and the stop then ends on its own.
    cfg = _write(tmp_path / "stop.yml", "shutdown_report_s: 1.0\n")
    broker = start_broker(
        extra_args=["--config", str(cfg)], env=faults.environment({faults.WAL_BEFORE_FDATASYNC: "delay:6"})
    )
    sender = subprocess.Popen(
        [sys.executable, "-c", _SEND_ONE, broker.address], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        eventually_sync(lambda: "fault injection wal.before_fdatasync" in broker.log_path.read_text(encoding="utf-8"),
                        timeout_s=30, interval_s=0.05, what="the send's commit in the sync thread")
        os.kill(broker.pid, signal.SIGTERM)
        eventually_sync(lambda: not broker.running, timeout_s=30, interval_s=0.1, what="the broker stopped")
    finally:
        sender.kill()
        sender.wait()
    log = broker.log_path.read_text(encoding="utf-8")
    report = log[log.index("broker stop still running after 1 s"):]
    assert re.search(r"task wal-writer:\S+slow_disk:\n  \S+group_commit\.py:\d+ in _writer", report), report[:3000]
    assert re.search(r"INFO broker\.rpc\.server: broker \d+ stopped", report), report[-2000:]  # and it ended
