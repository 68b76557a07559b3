"""The one C extension, declared here because ``[tool.setuptools.ext-modules]`` in
``pyproject.toml`` is still experimental in setuptools (it warns at every install); everything
else about the package is in ``pyproject.toml``.

The record walker ``danube_pipeline/lake/_framing.c`` is used by
``danube_pipeline/lake/segment_columns.py`` for tiering. It is optional: without a C compiler the
install still succeeds and the same columns come from the pure-Python decoder, slower
(``scripts/install-system-deps.sh`` installs gcc).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "danube_pipeline.lake._framing",
            sources=["danube_pipeline/lake/_framing.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
        )
    ]
)
