# Danube Pipeline. `make demo` runs the main job, `make test` the test suite; both set up
# the environment first (virtualenv in .venv, Python packages, Java 17 and the SQLite JDBC jar).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast dev bench proto typecheck clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install-system-deps.sh
	bash scripts/install-system-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(BIN)/danube-pipeline demo

test: setup typecheck
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not spark and not e2e" $(PYTEST_ARGS)

dev: setup
	$(BIN)/danube-pipeline dev

bench: setup
	$(BIN)/python benchmarks/ingest.py

typecheck: setup
	$(BIN)/python -m mypy danube_pipeline broker assets benchmarks

proto: setup
	cd danube_pipeline/proto && ../../$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. danube.proto
	sed -i 's/^import danube_pb2 as danube__pb2/from danube_pipeline.proto import danube_pb2 as danube__pb2/' danube_pipeline/proto/danube_pb2_grpc.py

clean:
	rm -rf .danube
