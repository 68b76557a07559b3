# Danube Pipeline. `make demo` runs the main job, `make test` the test suite; both set up what
# they need first: a virtualenv in .venv with the package and the extras of that command
# (pyproject.toml, resolved against the versions locked in constraints.txt), plus Java 17 and
# the SQLite JDBC jar (scripts/install-system-deps.sh).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# `make test` runs pytest on this many worker processes (pytest-xdist; 0 runs it in this one).
PYTEST_WORKERS ?= 2
DEV_HOME ?=
# `make dev BROKERS=3`: etcd and three brokers (ports 6650, 6651, 6652; data in broker, broker-2, ...).
BROKERS ?= 1
# `make dev SECURE=1`: TLS (client certificates required), tokens and authorization, files in .danube/dev/security.
SECURE ?=
# `make dev METRICS=1`: brokers serve /metrics (127.0.0.1:9400, 9401, ...), the writer too (127.0.0.1:9641),
# and Prometheus (Debian's package) scrapes them with the alert rules, at http://127.0.0.1:9090.
METRICS ?=

.PHONY: setup demo test test-fast dev bench bench-peers proto typecheck clean

# One stamp per extra: `make demo` installs `.[demo]`, `make test` installs `.[dev]`. The filter
# hides setuptools' notice that an editable install imports from this checkout (it is meant to).
$(BIN)/python:
	bash scripts/install-system-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

EXTENSIONS := danube_pipeline/lake/_framing.c danube_pipeline/format/_batch_builder.c broker/storage/wal/_commit_round.c

$(VENV)/.installed-%: pyproject.toml setup.py constraints.txt scripts/install-system-deps.sh $(EXTENSIONS) | $(BIN)/python
	bash scripts/install-system-deps.sh
	PYTHONWARNINGS='ignore:Editable installation:UserWarning' $(BIN)/python -m pip install --quiet -c constraints.txt -e '.[$*]'
	touch $@

setup: $(VENV)/.installed-dev

demo: $(VENV)/.installed-demo
	$(BIN)/danube-pipeline demo

test: $(VENV)/.installed-dev typecheck
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

test-fast: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal -m "not spark and not e2e" $(PYTEST_ARGS)

# etcd, BROKERS brokers (ports 6650, 6651, ...) and the Dagster UI and daemon, until Ctrl-C, in
# $(DEV_HOME) or .danube/dev. (Brokers without Dagster: python -m danube_pipeline.dev.localcluster --brokers N.)
dev: $(VENV)/.installed-demo
	$(BIN)/danube-pipeline dev --brokers $(BROKERS) $(if $(DEV_HOME),--home $(DEV_HOME)) $(if $(SECURE),--secure) $(if $(METRICS),--metrics)

bench: $(VENV)/.installed-dev
	$(BIN)/python benchmarks/ingest.py

# Danube beside Redis Streams and NATS JetStream at equal durability (benchmarks/README.md).
bench-peers: $(VENV)/.installed-bench
	bash scripts/install-bench-deps.sh
	$(BIN)/python benchmarks/peers.py

typecheck: $(VENV)/.installed-dev
	$(BIN)/python -m mypy danube_pipeline broker assets benchmarks tests

proto: $(VENV)/.installed-dev
	cd danube_pipeline/proto && ../../$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. danube.proto
	sed -i 's/^import danube_pb2 as danube__pb2/from danube_pipeline.proto import danube_pb2 as danube__pb2/' danube_pipeline/proto/danube_pb2_grpc.py

clean:
	rm -rf .danube
