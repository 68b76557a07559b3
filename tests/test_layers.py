"""The import boundaries between the layers of the tree (``docs/architecture.md``, "The tree").

Every ``import`` statement of the product packages is read with :mod:`ast`, wherever it stands
(module level or inside a function), and checked against the layer its module belongs to:

* the **base install** (``pip install danube-pipeline``: the client, the metadata core, the
  record and segment formats, ``danube-admin``) imports only the standard library, its own
  dependencies (``aetcd``, ``grpc``, ``google.protobuf``, ``crc32c``, ``click``) and other
  base modules;
* ``danube_pipeline/schemas/`` and ``danube_pipeline/storage/`` (needed by the ``[broker]`` and
  the ``[pipeline]`` extra alike) import no pipeline, development, broker or asset code;
* ``danube_pipeline/lake/`` (the ``[pipeline]`` extra) imports no development, broker or asset code;
* ``broker/`` and ``assets/`` never import each other, nor the pipeline or development code
  beyond what their extra installs (``broker/`` nothing of ``lake/``, either of them nothing of
  ``dev/``);
* nothing imports another package's private modules (a name starting with ``_``): a private
  module is imported only from inside its own package.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("danube_pipeline", "broker", "assets", "benchmarks")

#: Modules and packages of the base install (``dependencies`` in pyproject.toml).
BASE = (
    "danube_pipeline",  # the package's own __init__
    "danube_pipeline.aio",
    "danube_pipeline.errors",
    "danube_pipeline.error_codec",
    "danube_pipeline.faults",
    "danube_pipeline.names",
    "danube_pipeline.modes",
    "danube_pipeline.settings",
    "danube_pipeline.logs",
    "danube_pipeline.outages",
    "danube_pipeline.partitions",
    "danube_pipeline.format",
    "danube_pipeline.metadata",
    "danube_pipeline.client",
    "danube_pipeline.proto",
    "danube_pipeline.admin",
    "danube_pipeline.auth",
)
#: What the base install's dependencies bring, by top-level import name.
BASE_THIRD_PARTY = {"aetcd", "grpc", "google", "crc32c", "click", "jwt", "cryptography", "prometheus_client"}
EXTRA_SHARED = ("danube_pipeline.schemas", "danube_pipeline.storage")
LAKE = ("danube_pipeline.lake",)
DEV = ("danube_pipeline.dev",)


@dataclass(frozen=True)
class Import:
    """One imported module, as seen in one source file."""

    path: Path
    line: int
    importer: str
    module: str
    name: str | None = None
    """For ``from module import name``: the name, when it is not a module itself."""

    def __str__(self) -> str:
        what = self.module if self.name is None else f"{self.name} from {self.module}"
        return f"{self.path.relative_to(REPO)}:{self.line} imports {what}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> Iterator[Import]:
    importer = _module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, importer, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            if source == "__future__":
                continue
            yield Import(path, node.lineno, importer, source)
            # `from package import submodule` imports the submodule too.
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                if _is_module(candidate):
                    yield Import(path, node.lineno, importer, candidate)
                else:
                    yield Import(path, node.lineno, importer, source, alias.name)


def _is_module(dotted: str) -> bool:
    if not dotted.startswith(PRODUCT):
        return False
    base = REPO.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or any(
        base.parent.glob(f"{base.name}.*.so")
    )


def _all_imports(*packages: str) -> list[Import]:
    found: list[Import] = []
    for package in packages:
        for path in sorted(REPO.joinpath(package).rglob("*.py")):
            if "_pb2" not in path.name:
                found.extend(_imports(path))
    return found


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _in_base(module: str) -> bool:
    return module == "danube_pipeline" or _within(module, BASE[1:])


def test_base_install_imports_only_base_modules_and_dependencies() -> None:
    stdlib = set(sys.stdlib_module_names)
    wrong = [
        str(i)
        for i in _all_imports("danube_pipeline")
        if _in_base(i.importer)
        and not (
            _in_base(i.module)
            or i.module.split(".")[0] in stdlib
            or i.module.split(".")[0] in BASE_THIRD_PARTY
        )
    ]
    assert wrong == []


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        (EXTRA_SHARED, (*LAKE, *DEV, "broker", "assets")),
        (LAKE, (*DEV, "broker", "assets")),
        (("broker",), ("assets", *LAKE, *DEV)),
        (("assets",), ("broker", *DEV)),
    ],
)
def test_layers_import_nothing_above_them(layer: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    packages = {p.split(".")[0] for p in layer}
    wrong = [
        str(i)
        for i in _all_imports(*packages)
        if _within(i.importer, layer) and _within(i.module, forbidden)
    ]
    assert wrong == []


def test_the_broker_and_the_assets_never_import_each_other_even_through_the_core() -> None:
    """They meet only through etcd, object storage, the catalog and the broker's gRPC API."""
    wrong = [
        str(i)
        for i in _all_imports("danube_pipeline")
        if _within(i.module, ("broker", "assets"))
    ]
    assert wrong == []


def test_no_module_imports_another_packages_private_module_or_name() -> None:
    """A private module, or a private name of a module, is used only inside its own package."""
    wrong = []
    for i in _all_imports(*PRODUCT):
        parts = i.module.split(".") + ([i.name] if i.name else [])
        if parts[0] not in PRODUCT:
            continue
        for depth, part in enumerate(parts):
            if part.startswith("_") and not part.startswith("__"):
                # A private name belongs to its module's package; a private module to its parent.
                owner = ".".join(parts[: depth - 1 if i.name and depth == len(parts) - 1 else depth])
                if not _within(i.importer, (owner,)) and i.importer != owner:
                    wrong.append(str(i))
                break
    assert wrong == []


def test_the_checks_see_imports_at_every_level() -> None:
    """The walker finds function-level and relative imports, and `from pkg import module`."""
    found = {(i.importer, i.module) for i in _all_imports("danube_pipeline")}
    assert ("danube_pipeline.lake.segment_columns", "danube_pipeline.lake._framing") in found
    assert any(importer.startswith("danube_pipeline.lake") for importer, _ in found)
