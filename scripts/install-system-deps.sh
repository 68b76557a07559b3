#!/usr/bin/env bash
# Installs what pip cannot: Java 17 (for Spark), the SQLite and PostgreSQL JDBC drivers (for
# Iceberg's JdbcCatalog in Spark), the PostgreSQL server (its initdb and postgres binaries: the
# tests run their own server for the shared-catalog tests), Prometheus and promtool (`make dev
# METRICS=1` and the alert-rule tests), plus python3-venv, a C compiler and Python's headers when
# missing.
# Idempotent: installs only what is missing. Uses apt when running as root; otherwise prints
# exactly what to install and fails.
set -euo pipefail

need_java=0
if command -v java >/dev/null 2>&1; then
  major=$(java -version 2>&1 | awk -F'"' '/version/ {split($2, v, "."); print (v[1] == "1") ? v[2] : v[1]; exit}')
  if [ -z "${major}" ] || [ "${major}" -lt 17 ]; then need_java=1; fi
else
  need_java=1
fi
jdbc_jar="${DANUBE_SQLITE_JDBC_JAR:-/usr/share/java/sqlite-jdbc.jar}"
need_jdbc=0; [ -f "${jdbc_jar}" ] || need_jdbc=1
pg_jdbc_jar="${DANUBE_POSTGRESQL_JDBC_JAR:-/usr/share/java/postgresql.jar}"
need_pg_jdbc=0; [ -f "${pg_jdbc_jar}" ] || need_pg_jdbc=1
need_postgres=1
for bindir in ${DANUBE_POSTGRES_BINDIR:-} /usr/lib/postgresql/*/bin; do
  if [ -x "${bindir}/initdb" ] && [ -x "${bindir}/postgres" ]; then need_postgres=0; break; fi
done
# Debian's prometheus package brings promtool too (the rules and configuration checks). On a
# machine with systemd it also starts its own service on port 9090: `make dev METRICS=1` then
# needs DANUBE_PROMETHEUS_LISTEN=127.0.0.1:9091 (or `systemctl disable --now prometheus`).
need_prometheus=1
if command -v promtool >/dev/null 2>&1 || [ -x "$(dirname "${DANUBE_PROMETHEUS_BIN:-/nonexistent/x}")/promtool" ]; then
  need_prometheus=0
fi
need_venv=0; python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need_venv=1
# A C compiler and Python's headers build the record walker (danube_pipeline/lake/_framing.c) and
# the producer's batch builder (danube_pipeline/format/_batch_builder.c); without them the install
# still works, with the slower pure-Python twins.
need_cc=0; command -v cc >/dev/null 2>&1 || need_cc=1
need_headers=0
python3 -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  >/dev/null 2>&1 || need_headers=1

pkgs=()
[ "${need_java}" = 1 ] && pkgs+=(openjdk-17-jre-headless)
[ "${need_jdbc}" = 1 ] && pkgs+=(libxerial-sqlite-jdbc-java)
[ "${need_pg_jdbc}" = 1 ] && pkgs+=(libpostgresql-jdbc-java)
[ "${need_postgres}" = 1 ] && pkgs+=(postgresql)
[ "${need_prometheus}" = 1 ] && pkgs+=(prometheus)
[ "${need_venv}" = 1 ] && pkgs+=(python3-venv)
[ "${need_cc}" = 1 ] && pkgs+=(gcc libc6-dev)
[ "${need_headers}" = 1 ] && pkgs+=(python3-dev)
[ "${#pkgs[@]}" = 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing system packages: ${pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
  exit 0
fi
echo "error: missing system packages: ${pkgs[*]}" >&2
echo "install them with: sudo apt-get install ${pkgs[*]}" >&2
echo "(or point DANUBE_SQLITE_JDBC_JAR / DANUBE_POSTGRESQL_JDBC_JAR at the JDBC jars," >&2
echo " DANUBE_POSTGRES_BINDIR at a directory holding initdb and postgres, DANUBE_PROMETHEUS_BIN at a" >&2
echo " prometheus binary with promtool beside it, and put Java 17 on PATH)" >&2
exit 1
