"""A real PostgreSQL server for the tests: Debian's ``postgresql`` binaries, own data directory.

* :class:`PostgresServer`: ``initdb`` into a fresh directory, then ``postgres`` on a free
  loopback port with password (SCRAM) authentication; stopped by its pid.
* ``postgres`` (session fixture): one running server for the whole session.
* ``postgres_url`` (function fixture): a new, empty database on it, as
  ``postgresql+psycopg2://danube:<password>@127.0.0.1:<port>/<db>``.

PostgreSQL refuses to run as root, so when the tests run as root the server runs as the
``postgres`` system user that Debian's package creates. Missing binaries fail the fixture (they
are never skipped): ``scripts/install-system-deps.sh`` installs them.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg2
import pytest

from danube_pipeline.dev.localcluster import ChildProcess, free_port

BINDIR_ENV = "DANUBE_POSTGRES_BINDIR"
DEBIAN_BINDIRS = "/usr/lib/postgresql/*/bin"
SUPERUSER = "danube"
# Characters that must be percent-encoded in a URL's user-info, to prove every consumer decodes it.
PASSWORD = "s3cr@t:/pw"
_databases = itertools.count(1)


def postgres_bindir() -> Path:
    """The directory holding ``initdb`` and ``postgres``: ``$DANUBE_POSTGRES_BINDIR``, else the
    newest ``/usr/lib/postgresql/<version>/bin`` (Debian's layout).

    Raises:
        RuntimeError: no such directory has both binaries.
    """
    override = os.environ.get(BINDIR_ENV)
    if override:
        candidates = [Path(override)]
    else:
        candidates = sorted(Path("/").glob(DEBIAN_BINDIRS.lstrip("/")), key=lambda p: _version(p), reverse=True)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "postgres").is_file():
            return bindir
    raise RuntimeError(
        f"PostgreSQL server binaries (initdb, postgres) not found in {override or DEBIAN_BINDIRS}: "
        f"run `bash scripts/install-system-deps.sh` (apt-get install postgresql) or set {BINDIR_ENV}"
    )


def _version(bindir: Path) -> int:
    name = bindir.parent.name
    return int(name) if name.isdigit() else 0


class PostgresServer(ChildProcess):
    """One PostgreSQL server on ``127.0.0.1:<port>``, its cluster in a temporary directory.

    Args:
        port: TCP port; default a free one.
    """

    def __init__(self, *, port: int | None = None) -> None:
        self.bindir = postgres_bindir()
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.user = SUPERUSER
        self.password = PASSWORD
        self._run_as: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            try:
                self._run_as = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError(
                    "running as root and there is no 'postgres' system user to run PostgreSQL as "
                    "(Debian's postgresql package creates it)"
                ) from None
        # not under pytest's tmp_path: its parent is private to root, and the server runs as postgres
        self.root = Path(tempfile.mkdtemp(prefix="danube-postgres-"))
        self.data_dir = self.root / "data"
        self.log_path = self.root / "postgres.log"
        super().__init__()

    def url(self, database: str = "postgres", *, driver: str = "postgresql+psycopg2") -> str:
        """``<driver>://danube:<password>@127.0.0.1:<port>/<database>``, password percent-encoded."""
        return f"{driver}://{quote(self.user, safe='')}:{quote(self.password, safe='')}@{self.host}:{self.port}/{database}"

    def _identity(self) -> tuple[int | None, int | None, list[int] | None]:
        """``(user, group, extra_groups)`` for ``subprocess``: the ``postgres`` user's, or
        ``None`` (this process's own) when not running as root."""
        if self._run_as is None:
            return None, None, None
        return self._run_as.pw_uid, self._run_as.pw_gid, []

    def start(self, *, timeout_s: float = 60.0) -> None:
        """``initdb`` the cluster (first start only), start ``postgres`` and wait until it accepts
        connections.

        Raises:
            RuntimeError: ``initdb`` failed, or the server exited or did not accept connections
                within ``timeout_s`` (the message holds its log's tail).
        """
        if self._run_as is not None:
            os.chown(self.root, self._run_as.pw_uid, self._run_as.pw_gid)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC"}
        user, group, extra_groups = self._identity()
        if not self.data_dir.exists():
            pwfile = self.root / "pwfile"
            pwfile.write_text(self.password + "\n")
            if self._run_as is not None:
                os.chown(pwfile, self._run_as.pw_uid, self._run_as.pw_gid)
            init = subprocess.run(
                [str(self.bindir / "initdb"), "-D", str(self.data_dir), "-U", self.user, "--pwfile", str(pwfile),
                 "--auth", "scram-sha-256", "-E", "UTF8", "--locale", "C.UTF-8", "--no-sync"],
                capture_output=True, env=env, cwd=self.root, timeout=120, check=False,
                user=user, group=group, extra_groups=extra_groups,
            )
            pwfile.unlink()
            if init.returncode != 0:
                raise RuntimeError(f"initdb failed ({init.returncode}): {init.stderr.decode(errors='replace')[-2000:]}")
        log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            [str(self.bindir / "postgres"), "-D", str(self.data_dir), "-p", str(self.port),
             "-c", f"listen_addresses={self.host}", "-c", f"unix_socket_directories={self.root}",
             # a test server: durability off for speed
             "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
             "-c", "max_connections=200"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
            user=user, group=group, extra_groups=extra_groups,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self._proc.returncode}: {self._log_tail()}")
            try:
                psycopg2.connect(self.url(driver="postgresql"), connect_timeout=2).close()
                return
            except psycopg2.OperationalError as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"postgres not ready within {timeout_s}s ({exc}): {self._log_tail()}") from exc
            time.sleep(0.1)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def create_database(self, name: str | None = None) -> str:
        """``CREATE DATABASE`` (a new name unless given).

        Returns:
            The database's name.
        """
        name = name or f"test_{os.getpid()}_{next(_databases)}"
        conn = psycopg2.connect(self.url(driver="postgresql"))
        try:
            conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return name

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """Stop the server by its pid: SIGINT (PostgreSQL's "fast" shutdown), SIGKILL after
        ``timeout_s``."""
        process, self._proc = self._proc, None
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=timeout_s)

    def remove(self) -> None:
        """Stop the server and delete its directory."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One running PostgreSQL server for the session, removed at the end."""
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture
def postgres_url(postgres: PostgresServer) -> str:
    """A new empty database on the session server, as a SQLAlchemy URL with psycopg2."""
    return postgres.url(postgres.create_database())
