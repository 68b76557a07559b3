"""The test-only fault points (:mod:`danube_pipeline.faults`): no-ops unless armed, armed by
one environment variable read once, and a typo refused loudly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from danube_pipeline import faults

pytestmark = pytest.mark.unit


def test_parse_reads_name_action_pairs() -> None:
    assert faults.parse("") == {}
    assert faults.parse(" dead_letter.after_publish = sigkill , ") == {faults.DEAD_LETTER_AFTER_PUBLISH: faults.SIGKILL}


@pytest.mark.parametrize("value", ["dead_letter.after_publish", "nowhere=sigkill", "dead_letter.after_publish=explode"])
def test_parse_refuses_unknown_points_and_actions(value: str) -> None:
    with pytest.raises(ValueError, match=faults.FAULT_POINTS_ENV):
        faults.parse(value)


def test_environment_builds_the_variable() -> None:
    env = faults.environment({faults.DEAD_LETTER_AFTER_PUBLISH: faults.SIGKILL})
    assert env == {faults.FAULT_POINTS_ENV: "dead_letter.after_publish=sigkill"}
    with pytest.raises(ValueError):
        faults.environment({"nowhere": faults.SIGKILL})


def _run(env_value: str | None) -> subprocess.CompletedProcess[str]:
    """A child process that passes the dead-letter fault point once, then prints ``passed``."""
    env = {k: v for k, v in os.environ.items() if k != faults.FAULT_POINTS_ENV}
    if env_value is not None:
        env[faults.FAULT_POINTS_ENV] = env_value
    code = textwrap.dedent(
        """
        import logging
        logging.basicConfig(level=logging.ERROR)
        from danube_pipeline import faults
        faults.point(faults.DEAD_LETTER_AFTER_PUBLISH)
        print("passed", flush=True)
        """
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_an_unarmed_point_does_nothing() -> None:
    done = _run(None)
    assert done.returncode == 0 and done.stdout.strip() == "passed"


def test_an_armed_point_kills_the_process_after_an_error_line() -> None:
    done = _run("dead_letter.after_publish=sigkill")
    assert done.returncode == -9 and "passed" not in done.stdout
    assert "fault injection dead_letter.after_publish: killing the process after a dead-letter publish" in done.stderr


def test_a_malformed_variable_fails_the_first_point() -> None:
    done = _run("dead_letter.after_publish=boom")
    assert done.returncode == 1 and "ValueError" in done.stderr


def test_arm_and_disarm_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.FAULT_POINTS_ENV, raising=False)
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(faults, "_armed", None)
    faults.point(faults.DEAD_LETTER_AFTER_PUBLISH)
    assert killed == []
    faults.arm(faults.DEAD_LETTER_AFTER_PUBLISH)
    faults.point(faults.DEAD_LETTER_AFTER_PUBLISH)
    assert killed == [(os.getpid(), signal.SIGKILL)]
    faults.disarm(faults.DEAD_LETTER_AFTER_PUBLISH)
    faults.point(faults.DEAD_LETTER_AFTER_PUBLISH)
    assert len(killed) == 1
    with pytest.raises(ValueError):
        faults.arm("nowhere")
