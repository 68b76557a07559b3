"""The C extensions, declared here because ``[tool.setuptools.ext-modules]`` in
``pyproject.toml`` is still experimental in setuptools (it warns at every install); everything
else about the package is in ``pyproject.toml``.

Both are optional: without a C compiler the install still succeeds and the same results come
from pure Python, slower (``scripts/install-system-deps.sh`` installs gcc):

* ``danube_pipeline/lake/_framing.c``, the record walker that
  ``danube_pipeline/lake/segment_columns.py`` uses for tiering;
* ``danube_pipeline/format/_batch_builder.c``, which frames a producer's records (no key, no
  attributes) into a record batch for ``danube_pipeline/format/batches.py``;
* ``broker/storage/wal/_commit_round.c``, which runs a WAL commit round's system calls with the
  GIL released once, for ``broker/storage/wal/sync_thread.py``.
"""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]

setup(
    ext_modules=[
        Extension(
            "danube_pipeline.lake._framing",
            sources=["danube_pipeline/lake/_framing.c"],
            optional=True,
            extra_compile_args=_FLAGS,
        ),
        Extension(
            "danube_pipeline.format._batch_builder",
            sources=["danube_pipeline/format/_batch_builder.c"],
            optional=True,
            extra_compile_args=_FLAGS,
        ),
        Extension(
            "broker.storage.wal._commit_round",
            sources=["broker/storage/wal/_commit_round.c"],
            optional=True,
            extra_compile_args=_FLAGS,
        ),
    ]
)
