"""Named fault points, for tests only: product code calls :func:`point` at a place where a
test wants to inject a fault; every point is a no-op unless armed.

**For tests only.** Nothing in production arms a point. Arming is the only place that reads
the environment: the variable :data:`FAULT_POINTS_ENV` (``DANUBE_FAULT_POINTS``), read once, at
the first :func:`point` call of the process, holds ``name=action`` pairs separated by commas,
e.g. ``DANUBE_FAULT_POINTS=dead_letter.after_publish=sigkill``. A test arms a child process
(a broker it starts) by putting :func:`environment` into the child's environment, or arms its
own process with :func:`arm`.

The points (:data:`POINTS`):

``dead_letter.after_publish`` (:data:`DEAD_LETTER_AFTER_PUBLISH`)
    In the broker's dispatcher (:mod:`broker.dispatch.dispatcher`), right after a dead-letter
    publish is durable and before the message is acknowledged on its topic: the crash window
    of :mod:`broker.dispatch.dead_letter_topic`.

``retention.after_expire_commit`` (:data:`RETENTION_AFTER_EXPIRE_COMMIT`)
    In a retention run (:mod:`danube_pipeline.lake.retention.steps`), right after the snapshot
    expiry is committed and before the files only the expired snapshots referenced are
    deleted: the crash window of :mod:`danube_pipeline.lake.retention.expiry`.

``topic.after_create`` (:data:`TOPIC_AFTER_CREATE`)
    In the broker's topic creation (:meth:`broker.topics.lifecycle.TopicLoader.create_topic`),
    right after etcd applied the creating transaction and before anything is answered: a
    creation whose answer is lost.

``wal.before_fdatasync`` (:data:`WAL_BEFORE_FDATASYNC`)
    In a WAL group commit (:mod:`broker.storage.wal.group_commit`), in the thread that writes
    and syncs, right before the write and its ``fdatasync``: armed with ``delay:<seconds>``,
    a slow disk.

The actions (:data:`ACTIONS`):

``sigkill`` (:data:`SIGKILL`)
    Log an ERROR line (``fault injection <point>: killing the process <when>``) and send
    SIGKILL to the process itself: it dies at once, as a crashed or killed process does, with
    nothing flushed or closed.

``delay:<seconds>`` (:data:`DELAY`)
    Log a WARNING line and block the calling thread for that many seconds (``time.sleep``),
    e.g. ``wal.before_fdatasync=delay:3``.

An unknown point or action in :data:`FAULT_POINTS_ENV` raises :class:`ValueError` at the first
:func:`point` call, so a test's typo does not pass silently.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

FAULT_POINTS_ENV = "DANUBE_FAULT_POINTS"
"""The environment variable that arms fault points: ``name=action[,name=action...]``."""

DEAD_LETTER_AFTER_PUBLISH = "dead_letter.after_publish"
"""After a dead-letter publish is durable, before the message is acknowledged on its topic."""

TOPIC_AFTER_CREATE = "topic.after_create"
"""After a topic creation's etcd transaction is applied, before the creation is answered."""

RETENTION_AFTER_EXPIRE_COMMIT = "retention.after_expire_commit"
"""After retention's snapshot expiry is committed, before the expired files are deleted."""

WAL_BEFORE_FDATASYNC = "wal.before_fdatasync"
"""In a WAL group commit's sync thread, before the write and its ``fdatasync``."""

POINTS: Mapping[str, str] = {
    DEAD_LETTER_AFTER_PUBLISH: "after a dead-letter publish",
    RETENTION_AFTER_EXPIRE_COMMIT: "after a snapshot expiry commit, before its files are deleted",
    TOPIC_AFTER_CREATE: "after a topic creation's etcd write",
    WAL_BEFORE_FDATASYNC: "before a WAL group commit's write and fdatasync",
}
"""Every fault point, with when it fires (for the log line)."""

SIGKILL = "sigkill"
"""Action: log an ERROR line, then SIGKILL the process itself."""

DELAY = "delay"
"""Action ``delay:<seconds>``: log a WARNING line, then block the calling thread that long."""

ACTIONS = (SIGKILL, DELAY)
"""Every action a point can be armed with (``delay`` takes ``:<seconds>``)."""


def _valid_action(action: str) -> bool:
    kind, sep, arg = action.partition(":")
    if kind == DELAY and sep:
        try:
            return float(arg) >= 0
        except ValueError:
            return False
    return not sep and action == SIGKILL

_armed: dict[str, str] | None = None
"""Armed points and their actions; ``None`` until the environment is read."""


def parse(value: str) -> dict[str, str]:
    """The armed points of a :data:`FAULT_POINTS_ENV` value.

    Args:
        value: ``name=action`` pairs separated by commas; blanks around them are ignored, and
            an empty value arms nothing.

    Returns:
        The action of each armed point, by point name.

    Raises:
        ValueError: a pair is not ``name=action``, or names an unknown point or action.
    """
    armed: dict[str, str] = {}
    for pair in value.split(","):
        pair = pair.strip()
        if not pair:
            continue
        name, sep, action = pair.partition("=")
        name, action = name.strip(), action.strip()
        if not sep or name not in POINTS or not _valid_action(action):
            raise ValueError(
                f"{FAULT_POINTS_ENV}: {pair!r} is not name=action with a name in {sorted(POINTS)} "
                f"and an action in {list(ACTIONS)}"
            )
        armed[name] = action
    return armed


def environment(armed: Mapping[str, str]) -> dict[str, str]:
    """The environment entry that arms ``armed`` in a child process.

    Args:
        armed: the action of each point to arm, by point name (e.g.
            ``{DEAD_LETTER_AFTER_PUBLISH: SIGKILL}``).

    Returns:
        ``{FAULT_POINTS_ENV: "name=action,..."}``, to merge into the child's environment.

    Raises:
        ValueError: an unknown point or action.
    """
    value = ",".join(f"{name}={action}" for name, action in armed.items())
    parse(value)
    return {FAULT_POINTS_ENV: value}


def _armed_points() -> dict[str, str]:
    global _armed
    if _armed is None:
        _armed = parse(os.environ.get(FAULT_POINTS_ENV, ""))
    return _armed


def arm(name: str, action: str = SIGKILL) -> None:
    """Arm fault point ``name`` in this process (besides what the environment arms).

    Raises:
        ValueError: an unknown point or action.
    """
    if name not in POINTS or not _valid_action(action):
        raise ValueError(f"unknown fault point {name!r} or action {action!r}")
    _armed_points()[name] = action


def disarm(name: str) -> None:
    """Disarm fault point ``name`` in this process (no-op when it is not armed)."""
    _armed_points().pop(name, None)


def point(name: str) -> None:
    """Fault point ``name``: do its armed action, or nothing when it is not armed.

    Args:
        name: one of :data:`POINTS`.

    Raises:
        ValueError: :data:`FAULT_POINTS_ENV` does not parse (at the first call only).
    """
    action = _armed_points().get(name)
    if action is None:
        return
    if action == SIGKILL:
        log.error("fault injection %s: killing the process %s", name, POINTS[name])
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.startswith(f"{DELAY}:"):
        delay_s = float(action.partition(":")[2])
        log.warning("fault injection %s: blocking this thread for %.3f s %s", name, delay_s, POINTS[name])
        time.sleep(delay_s)


__all__ = [
    "ACTIONS",
    "DEAD_LETTER_AFTER_PUBLISH",
    "DELAY",
    "FAULT_POINTS_ENV",
    "POINTS",
    "RETENTION_AFTER_EXPIRE_COMMIT",
    "SIGKILL",
    "TOPIC_AFTER_CREATE",
    "WAL_BEFORE_FDATASYNC",
    "arm",
    "disarm",
    "environment",
    "parse",
    "point",
]
