"""Security's cost and its refusals: ingest with TLS and token authentication on and off, in one
run, and a matrix of calls a secured broker must refuse with the right typed error.

Starts two brokers, each on an etcd of its own (real processes in a temporary directory): one as
today (plaintext, no authentication) and one with TLS (a throwaway CA and a certificate for
127.0.0.1), HS256 bearer tokens (issuer and audience checked) and authorization on, with a role
granting produce, consume and lookup in namespace ``bench`` bound to the benchmark's principal.
Every other setting is the same.

The ingest measurement is ``ingest.py``'s (one producer with at most W unacked, one consumer in
its own process, acks after ``fdatasync``): the client takes its CA and token from
``DANUBE_TLS_CA_FILE`` and ``DANUBE_TOKEN_FILE``, as any client does. Each side first runs one
unmeasured warm-up round. Then every round runs each side once, back to back, the order rotated
from round to round; a round's ratio is its secured rate over its plaintext rate (messages
acked over the producer's seconds), and ``tls_auth_ratio`` is the median of the rounds' ratios,
so a slow moment of a shared machine moves one round's ratio, not the figure. ``--breakdown``
adds a third side, TLS without authentication, to tell TLS's cost from the checks'.

The refusal matrix runs against the secured broker through the client library: no token, an
expired token, the wrong issuer, the wrong audience, a bad signature, ``alg=none``, produce with
consume-only rights, consume outside the granted namespace, and a plaintext client on the TLS
port. Each counts as ok when it raises the expected typed error (``AuthenticationError``,
``PermissionDeniedError``, or ``BrokerUnavailableError`` naming ``tls_ca_file``).

    .venv/bin/python benchmarks/security.py                # 7 rounds of 100,000 1 KiB messages a side
    .venv/bin/python benchmarks/security.py --messages 50000 --rounds 9 --breakdown

It ends with one line, figures of that run:
``security: refusals_checked=N refusals_ok=N tls_auth_ratio=X`` (msg/s secured / plaintext).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from danube_pipeline.auth import mint_token
from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer, etcdctl_binary
from danube_pipeline.errors import AuthenticationError, BrokerUnavailableError, PermissionDeniedError
from danube_pipeline.metadata import keys

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))
import ingest  # noqa: E402 - a sibling module of this script
from tls_certs import CertAuthority  # noqa: E402 - the tests' certificate maker

SECRET = b"benchmark-secret-benchmark-secret-0042"
ISSUER = "danube-bench"
AUDIENCE = "danube"
ADMIN = "bench-admin"
WRITER = "bench-app"
READER = "bench-reader"
OTHER_TOPIC = "/other/events"
TLS_ENV = ("DANUBE_TLS_CA_FILE", "DANUBE_TOKEN_FILE")


@dataclass
class Secured:
    """The secured broker and what its clients need."""

    broker: BrokerProcess
    ca_file: Path
    token_file: Path
    cert_file: Path
    key_file: Path


def _token(principal: str, **kwargs: object) -> str:
    kwargs.setdefault("issuer", ISSUER)
    kwargs.setdefault("audience", AUDIENCE)
    return mint_token(principal, SECRET, **kwargs)  # type: ignore[arg-type]


def _alg_none(principal: str) -> str:
    """An ``alg: none`` token with otherwise valid claims: no signature at all."""

    def b64(data: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")

    now = int(time.time())
    claims = {"sub": principal, "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 3600}
    return f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64(claims)}."


def _etcd_put(endpoints: list[str], key: str, value: dict[str, object]) -> None:
    subprocess.run(
        [etcdctl_binary(), f"--endpoints={','.join(endpoints)}", "put", key, json.dumps(value)],
        check=True, capture_output=True, timeout=30, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )


def _grant(endpoints: list[str]) -> None:
    """``bench-app`` may produce, consume and look up in ``bench``; ``bench-reader`` only consume
    and look up there (``docs/etcd-layout.md`` §7)."""
    _etcd_put(endpoints, keys.security_role("bench-writer"), {"permissions": ["produce", "consume", "lookup"]})
    _etcd_put(endpoints, keys.security_role("bench-reader"), {"permissions": ["consume", "lookup"]})
    _etcd_put(endpoints, keys.security_binding(WRITER, "namespaces/bench"), {"roles": ["bench-writer"]})
    _etcd_put(endpoints, keys.security_binding(READER, "namespaces/bench"), {"roles": ["bench-reader"]})


def _start_secured(root: Path, etcd_endpoints: list[str]) -> Secured:
    ca = CertAuthority(root / "pki", "bench-ca")
    pair = ca.issue("broker")
    secret_file = root / "jwt.secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    token_file = root / "bench-app.token"
    token_file.write_text(_token(WRITER, ttl_s=3600.0))
    token_file.chmod(0o600)
    broker = BrokerProcess(
        etcd_endpoints=etcd_endpoints, data_dir=root / "broker-secured",
        extra_args=[
            "--tls-cert-file", str(pair.cert_file), "--tls-key-file", str(pair.key_file),
            "--auth-jwt-secret-file", str(secret_file), "--auth-jwt-issuer", ISSUER,
            "--auth-jwt-audience", AUDIENCE, "--authorization", "--super-admin", ADMIN,
        ],
    )
    broker.start()
    return Secured(broker, ca.cert_file, token_file, pair.cert_file, pair.key_file)


async def _prepare(plain: str, secured: Secured, tls_only: str | None = None) -> None:
    async with DanubeClient([plain]) as client:
        await client.admin.create_topic(ingest.TOPIC)
    if tls_only is not None:
        async with DanubeClient([tls_only], tls_ca_file=secured.ca_file) as client:
            await client.admin.create_topic(ingest.TOPIC)
    async with DanubeClient([secured.broker.address], tls_ca_file=secured.ca_file, token=_token(ADMIN)) as client:
        await client.admin.create_topic(ingest.TOPIC)
        await client.admin.create_topic(OTHER_TOPIC)


# --------------------------------------------------------------------------- refusals


async def _connect(address: str, **kwargs: object) -> None:
    async with DanubeClient([address], request_timeout_ms=5_000, metadata_retries=1, **kwargs):  # type: ignore[arg-type]
        pass


async def _produce_as(address: str, ca_file: Path, principal: str, topic: str) -> None:
    async with DanubeClient([address], tls_ca_file=ca_file, token=_token(principal), request_timeout_ms=5_000) as client:
        async with client.producer(topic, producer_name="refused") as producer:
            await producer.send(b"must not be stored")


async def _consume_as(address: str, ca_file: Path, principal: str, topic: str) -> None:
    async with DanubeClient([address], tls_ca_file=ca_file, token=_token(principal), request_timeout_ms=5_000) as client:
        async with client.consumer(topic, subscription="refused") as consumer:
            await consumer.receive(timeout_ms=1_000)


def _refusals(secured: Secured) -> list[tuple[str, Callable[[], Awaitable[None]], type[Exception], str]]:
    """``(name, call, expected error class, words the message must hold)`` for every refusal."""
    address, ca = secured.broker.address, secured.ca_file
    wrong_secret = b"another-secret-another-secret-000042"
    auth = AuthenticationError
    return [
        ("no token", lambda: _connect(address, tls_ca_file=ca), auth, ""),
        ("expired token", lambda: _connect(address, tls_ca_file=ca, token=_token(WRITER, ttl_s=-120.0)), auth, ""),
        ("wrong issuer", lambda: _connect(address, tls_ca_file=ca, token=_token(WRITER, issuer="mallory")), auth, ""),
        ("wrong audience", lambda: _connect(address, tls_ca_file=ca, token=_token(WRITER, audience="other")), auth, ""),
        ("bad signature", lambda: _connect(
            address, tls_ca_file=ca, token=mint_token(WRITER, wrong_secret, issuer=ISSUER, audience=AUDIENCE)), auth, ""),
        ("alg=none", lambda: _connect(address, tls_ca_file=ca, token=_alg_none(WRITER)), auth, ""),
        ("produce with consume-only rights", lambda: _produce_as(address, ca, READER, ingest.TOPIC),
         PermissionDeniedError, ""),
        ("consume outside the granted namespace", lambda: _consume_as(address, ca, READER, OTHER_TOPIC),
         PermissionDeniedError, ""),
        ("plaintext client on the TLS port", lambda: _connect(address, token=_token(WRITER)),
         BrokerUnavailableError, "tls_ca_file"),
    ]


async def _check_refusals(secured: Secured) -> list[tuple[str, bool, str]]:
    results: list[tuple[str, bool, str]] = []
    for name, call, expected, words in _refusals(secured):
        try:
            await asyncio.wait_for(call(), 30)
        except Exception as exc:  # noqa: BLE001 - any outcome is a figure of the matrix
            ok = isinstance(exc, expected) and words in str(exc)
            results.append((name, ok, f"{type(exc).__name__}: {str(exc)[:110]}"))
        else:
            results.append((name, False, "accepted"))
    return results


# --------------------------------------------------------------------------- ingest


def _ingest(address: str, args: argparse.Namespace, pid: int, env: dict[str, str]) -> dict[str, float]:
    """One ``ingest.py`` measurement; ``env`` (the client's CA and token files) is set for it and
    for its consumer process, then removed."""
    os.environ.update(env)
    try:
        return asyncio.run(ingest._produce(address, args, pid))
    finally:
        for name in env:
            os.environ.pop(name, None)


def _start_tls_only(root: Path, etcd_endpoints: list[str], secured: Secured) -> BrokerProcess:
    """A broker serving TLS with the secured broker's certificate, without authentication."""
    broker = BrokerProcess(
        etcd_endpoints=etcd_endpoints, data_dir=root / "broker-tls",
        extra_args=["--tls-cert-file", str(secured.cert_file), "--tls-key-file", str(secured.key_file)],
    )
    broker.start()
    return broker


def _pair_orders(sides: list[str], rounds: int) -> list[list[str]]:
    """The order of the sides in each round: rotated by one every round, so that no side is
    always first (the first run of a round meets a machine the previous round left busy)."""
    return [sides[i % len(sides):] + sides[: i % len(sides)] for i in range(rounds)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="payload size in bytes")
    parser.add_argument("--messages", type=int, default=100_000, help="messages per round and side")
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds; each runs every side once")
    parser.add_argument("--warmup-messages", type=int, default=20_000,
                        help="messages of the unmeasured first round of each side")
    parser.add_argument("--window", type=int, default=256, help="most unacked messages")
    parser.add_argument("--time-limit-s", type=float, default=60.0, help="give up a round after this many seconds")
    parser.add_argument("--breakdown", action="store_true",
                        help="add a third side, TLS without authentication, to tell TLS's cost from the checks'")
    args = parser.parse_args()
    for name in TLS_ENV:
        os.environ.pop(name, None)  # the plaintext side runs with no TLS or token
    started = time.monotonic()
    sides = ["plaintext", "tls+auth"] + (["tls"] if args.breakdown else [])
    rates: dict[str, list[float]] = {side: [] for side in sides}
    complete = True
    with tempfile.TemporaryDirectory(prefix="danube-security-") as tmp:
        root = Path(tmp)
        # one etcd each: brokers on one etcd form one cluster, and a client learns every broker
        with contextlib.ExitStack() as stack:
            etcds = {side: stack.enter_context(EtcdServer(root / f"etcd-{side.replace('+', '-')}")) for side in sides}
            _grant(etcds["tls+auth"].endpoints)
            plain = BrokerProcess(etcd_endpoints=etcds["plaintext"].endpoints, data_dir=root / "broker-plain")
            plain.start()
            stack.callback(plain.stop)
            secured = _start_secured(root, etcds["tls+auth"].endpoints)
            stack.callback(secured.broker.stop)
            brokers = {"plaintext": plain, "tls+auth": secured.broker}
            if args.breakdown:
                brokers["tls"] = _start_tls_only(root, etcds["tls"].endpoints, secured)
                stack.callback(brokers["tls"].stop)
            asyncio.run(_prepare(plain.address, secured, *([brokers["tls"].address] if args.breakdown else [])))
            ca_env = {"DANUBE_TLS_CA_FILE": str(secured.ca_file)}
            envs = {"plaintext": {}, "tls+auth": {**ca_env, "DANUBE_TOKEN_FILE": str(secured.token_file)}, "tls": ca_env}
            warmup = argparse.Namespace(**{**vars(args), "messages": args.warmup_messages})
            for side in sides:  # unmeasured: first connections, first segments, caches
                _ingest(brokers[side].address, warmup, brokers[side].pid, envs[side])
            for i, order in enumerate(_pair_orders(sides, args.rounds)):
                for side in order:
                    r = _ingest(brokers[side].address, args, brokers[side].pid, envs[side])
                    rates[side].append(r["acked"] / max(r["ingest_s"], 1e-9))
                    complete = complete and r["acked"] == args.messages and r["consumed"] == args.messages + 1
                    print(f"  round {i + 1} {side:9} {rates[side][-1]:10,.0f} msg/s  p50 {r['p50_ms']:.2f} ms  "
                          f"p99 {r['p99_ms']:.2f} ms  consumed {r['consumed']:,.0f}", flush=True)
            refusals = asyncio.run(_check_refusals(secured))
    # One ratio per round, from the two runs of that round (next to each other in time); the
    # median of them is the figure: one disturbed round moves it little.
    ratios = sorted(s / p for s, p in zip(rates["tls+auth"], rates["plaintext"], strict=True))
    ratio = statistics.median(ratios)
    print(f"security: {args.rounds} rounds x {args.messages:,} messages x {args.size} B a side after a "
          f"{args.warmup_messages:,}-message warm-up, one producer (W={args.window}), one consumer in its own "
          f"process; {time.monotonic() - started:.0f} s")
    for side in sides:
        print(f"  {side:9}  median {statistics.median(rates[side]):10,.0f} msg/s   "
              f"(rounds {min(rates[side]):,.0f} to {max(rates[side]):,.0f})")
    print(f"  tls+auth / plaintext per round: {' '.join(f'{r:.2f}' for r in ratios)}; median {ratio:.2f} "
          "(target >= 0.80)")
    if args.breakdown:
        tls = statistics.median(t / p for t, p in zip(rates["tls"], rates["plaintext"], strict=True))
        auth = statistics.median(s / t for s, t in zip(rates["tls+auth"], rates["tls"], strict=True))
        print(f"  breakdown (medians per round): tls / plaintext {tls:.2f}, tls+auth / tls {auth:.2f}")
    for name, ok, outcome in refusals:
        print(f"  refusal {'ok  ' if ok else 'FAIL'} {name:40} {outcome}")
    ok_count = sum(1 for _, ok, _ in refusals if ok)
    print(f"security: refusals_checked={len(refusals)} refusals_ok={ok_count} tls_auth_ratio={ratio:.2f}")
    return 0 if complete and ok_count == len(refusals) else 1


if __name__ == "__main__":
    sys.exit(main())
