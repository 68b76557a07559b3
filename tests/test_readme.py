"""The README's quickstart runs as written and prints what the README says it prints.

The Python block of "Your first producer and consumer" runs in a fresh interpreter against a
real broker (its address through ``DANUBE_BROKER_ADDRESSES``, which the block reads); its output
must equal the ``text`` block that follows it. The first ``etcdctl`` command runs with the test
etcd's endpoint in place of ``127.0.0.1:2379``; its output must equal the block after it, with
the producer id standing in for ``<producer id>``.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from danube_pipeline.dev.localcluster import BrokerProcess, etcdctl_binary

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def _section(title: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block under the ``## title`` heading."""
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(text[start : end if end > 0 else None])]


def test_quickstart_runs_as_written(start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str], tmp_path: Path) -> None:
    blocks = _section("Your first producer and consumer")
    langs = [lang for lang, _ in blocks]
    py, sh = langs.index("python"), langs.index("sh")
    (code, printed), (command, listed) = (blocks[py][1], blocks[py + 1][1]), (blocks[sh][1].strip(), blocks[sh + 1][1])
    broker = start_broker()
    script = README.parent / "quickstart.py"  # shipped: the README says to run it
    assert script.read_text() == code
    env = {**os.environ, "DANUBE_BROKER_ADDRESSES": broker.address}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == printed

    assert command.startswith(".venv/bin/etcdctl --endpoints=127.0.0.1:2379 ")
    argv = command.split()
    argv[0] = etcdctl_binary()
    argv[1] = f"--endpoints={etcd_endpoints[0]}"
    listing = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"ETCDCTL_API": "3"})
    assert listing.returncode == 0, listing.stderr
    producer_ids = re.findall(r"/producers/(\d+)\n", listing.stdout)
    assert len(producer_ids) == 1
    assert listing.stdout.replace(producer_ids[0], "<producer id>") == listed

    # what the text after the listing says: the producer closed, the cursor is the last acked offset
    def value(key: str) -> str:
        out = subprocess.run(argv[:2] + ["get", key, "--print-value-only"], capture_output=True, text=True,
                             timeout=30, env={"ETCDCTL_API": "3"})
        return out.stdout.strip()

    assert '"status":false' in value(f"/topics/default/readings/producers/{producer_ids[0]}")
    assert value("/topics/default/readings/subscriptions/quickstart/cursor") == "2"


@pytest.mark.unit
def test_every_python_block_compiles_and_its_imports_exist() -> None:
    """Each ``python`` block of the README is valid Python (top-level ``await`` allowed, as in
    an asyncio REPL), and every name it imports from this project exists."""
    text = README.read_text()
    blocks = [m.group(2) for m in _BLOCK.finditer(text) if m.group(1) == "python"]
    assert len(blocks) >= 5
    for body in blocks:
        tree = compile(body, "<README>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        assert isinstance(tree, ast.Module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        importlib.import_module(f"{node.module}.{alias.name}")  # a submodule
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PROJECT:
                        importlib.import_module(alias.name)


PROJECT = ("danube_pipeline", "broker", "assets")
"""Top-level packages of this project, whose imports the README blocks must get right."""
