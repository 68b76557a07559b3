"""Logging a failing background activity once per outage.

A background activity that retries (a cursor flush, a lease keep-alive, a watch reload) fails
on every attempt while etcd or the disk is down. :class:`OutageLog` turns that into two lines:
a warning at the first failure, and an info line with the count and duration when an attempt
succeeds again. The attempts in between are logged at debug level.
"""

from __future__ import annotations

import logging
import time


class OutageLog:
    """The state of one retried activity: healthy, or failing since some time.

    Args:
        logger: where the two lines go.
        activity: what is retried, e.g. ``"cursor writes to etcd"``.

    Attributes:
        failures: failed attempts in the current outage (0 while healthy).
        outages: outages seen so far.
    """

    def __init__(self, logger: logging.Logger, activity: str) -> None:
        self._log = logger
        self.activity = activity
        self.failures = 0
        self.outages = 0
        self._since = 0.0

    @property
    def failing(self) -> bool:
        """Whether the last attempt failed."""
        return self.failures > 0

    def failed(self, error: BaseException | str) -> None:
        """Record a failed attempt: a warning if it starts an outage, debug otherwise."""
        if self.failures == 0:
            self._since = time.monotonic()
            self.outages += 1
            self._log.warning("%s failing (retried; logged again when it recovers): %s", self.activity, error)
        else:
            self._log.debug("%s still failing: %s", self.activity, error)
        self.failures += 1

    def succeeded(self) -> None:
        """Record a successful attempt: ends an outage with one info line."""
        if self.failures:
            self._log.info(
                "%s recovered after %d failed attempts in %.1f s",
                self.activity, self.failures, time.monotonic() - self._since,
            )
            self.failures = 0


__all__ = ["OutageLog"]
