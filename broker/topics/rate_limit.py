"""Token buckets that pace publishing and dispatch to a rate read live from the topic's policy.

``max_publish_rate`` (one bucket per topic) and ``max_subscription_dispatch_rate`` (one per
subscription) of the namespace policy and its per-topic override (``docs/etcd-layout.md`` §2.1,
§3.8) are messages per second; 0 means unlimited. Like Pulsar's publish and dispatch rate
limits (Pulsar docs, "Namespace policies: publish rate / dispatch rate"), a limit slows its
callers down and never fails them: :meth:`RateLimiter.acquire` waits until the messages fit.

The bucket holds at most one second of messages (``rate * burst_s`` tokens, at least one) and
starts full, so a producer that stays within the rate is never held back, and a batch is taken
whole: a batch of ``n`` messages takes ``n`` tokens at once, going into debt when there are
fewer, and waits until the debt is paid back at ``rate`` tokens per second. ``N`` messages sent
at once therefore finish no earlier than ``N / rate - burst_s`` seconds later.

The rate is read again at least every :data:`MAX_WAIT_STEP_S` while a caller waits, so a rate
changed in etcd (through the broker's cache) applies to waiting callers within that time; a
rate lowered to 0 releases them at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_WAIT_STEP_S = 0.2
"""Longest sleep between two reads of the rate while a caller waits, in seconds."""
DEFAULT_BURST_S = 1.0
"""Seconds of messages the bucket holds when full."""


class RateLimiter:
    """A token bucket of messages per second whose rate is read live.

    Args:
        rate_per_s: returns the current limit in messages per second; 0 (or less) = unlimited.
        name: what is limited, for logs (``"/ns/topic publish"``).
        burst_s: the bucket holds ``rate * burst_s`` tokens when full (at least one).
        clock: monotonic time in seconds.

    Attributes:
        throttled_ms: milliseconds callers spent waiting in :meth:`acquire`, summed.
        throttled_messages: messages that had to wait.
    """

    def __init__(
        self,
        rate_per_s: Callable[[], int],
        *,
        name: str,
        burst_s: float = DEFAULT_BURST_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst_s <= 0:
            raise ValueError(f"burst_s must be positive, got {burst_s}")
        self._rate = rate_per_s
        self.name = name
        self.burst_s = burst_s
        self._clock = clock
        self._tokens: float | None = None  # None: unlimited last time we looked (full on the next limit)
        self._updated = clock()
        self._lock = asyncio.Lock()
        self.throttled_ms = 0.0
        self.throttled_messages = 0
        self._episode_logged = False

    def rate(self) -> int:
        """The current limit in messages per second, 0 when unlimited."""
        rate = self._rate()
        return max(0, rate)

    def _refill(self, rate: int) -> float:
        """Bring the bucket up to now at ``rate`` (> 0) and return its tokens."""
        now = self._clock()
        capacity = max(1.0, rate * self.burst_s)
        if self._tokens is None:
            tokens = capacity
        else:
            tokens = min(capacity, self._tokens + (now - self._updated) * rate)
        self._tokens, self._updated = tokens, now
        return tokens

    async def acquire(self, count: int) -> float:
        """Take ``count`` messages' worth of tokens, waiting while the bucket is in debt.

        Callers are served in arrival order. Never fails because of the limit.

        Args:
            count: messages (>= 1; smaller values take nothing).

        Returns:
            Seconds this call waited (0.0 when the rate allowed the messages at once).
        """
        if count <= 0:
            return 0.0
        async with self._lock:
            rate = self.rate()
            if rate == 0:
                self._tokens = None
                return 0.0
            self._tokens = self._refill(rate) - count
            if self._tokens >= 0:
                self._episode_logged = False
                return 0.0
            started = self._clock()
            if not self._episode_logged:
                self._episode_logged = True
                log.info("%s: rate limit of %d msg/s reached; callers are slowed down (backpressure)", self.name, rate)
            while True:
                deficit = -self._tokens
                if deficit <= 0:
                    break
                try:
                    await asyncio.sleep(min(deficit / rate, MAX_WAIT_STEP_S))
                except asyncio.CancelledError:  # the caller gave up: its messages were not sent
                    self._tokens += count
                    raise
                new_rate = self.rate()
                if new_rate == 0:  # limit lifted: the debt is forgiven
                    self._tokens = None
                    break
                if new_rate != rate:
                    log.info("%s: rate limit changed from %d to %d msg/s", self.name, rate, new_rate)
                    rate = new_rate
                self._refill(rate)
            waited = self._clock() - started
            self.throttled_ms += waited * 1000
            self.throttled_messages += count
            return waited


__all__ = ["DEFAULT_BURST_S", "MAX_WAIT_STEP_S", "RateLimiter"]
