"""Which partition a producer's message goes to (``docs/etcd-layout.md`` §3.1).

* A message with a ``key`` goes to partition ``(murmur2(utf8(key)) & 0x7fffffff) % N``: Kafka's
  default partitioner (``org.apache.kafka.common.utils.Utils.murmur2`` and ``toPositive``), so a
  key always lands in the same partition while N stays the same, keeps its order there, and lands
  in the partition a Kafka producer would choose for the same key bytes and N.
* A message without a key goes round-robin, one message at a time, from a random first
  partition (so that producers started together do not all begin with partition 0).
"""

from __future__ import annotations

import random

__all__ = ["Partitioner", "murmur2"]

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """MurmurHash2 as Kafka computes it (``Utils.murmur2``): 32 bits, seed ``0x9747b28c``.

    Args:
        data: the key's bytes.

    Returns:
        The hash as a signed 32-bit integer, equal to Java's ``int`` result.
    """
    length = len(data)
    h = (_SEED ^ length) & _MASK
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = data[i] | data[i + 1] << 8 | data[i + 2] << 16 | data[i + 3] << 24
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length % 4
    if tail == 3:
        h ^= data[whole + 2] << 16
    if tail >= 2:
        h ^= data[whole + 1] << 8
    if tail >= 1:
        h ^= data[whole]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


class Partitioner:
    """Chooses the partition of each message of one producer.

    Args:
        partitions: the topic's partition count N (> 0).

    Raises:
        ValueError: ``partitions`` is not positive.
    """

    def __init__(self, partitions: int) -> None:
        if partitions <= 0:
            raise ValueError("partitions must be > 0")
        self.partitions = partitions
        self._next = random.randrange(partitions)

    def partition(self, key: str | None) -> int:
        """The partition index (``0..N-1``) for a message with ``key`` (``None``: no key)."""
        if key is not None:
            return (murmur2(key.encode()) & 0x7FFFFFFF) % self.partitions
        index = self._next
        self._next = (index + 1) % self.partitions
        return index
