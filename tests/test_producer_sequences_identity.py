"""The sequence state with idempotent identities (``broker/topics/producer_sequences.py``), on
its own: fencing by epoch, the state rebuilt from batch headers, and the move handover. The
processes and etcd are in ``tests/test_producer_identity.py``; these are the state's rules."""

from __future__ import annotations

import asyncio

import pytest

from broker.topics.producer_identity import MAX_EPOCH, ProducerIdentity
from broker.topics.producer_sequences import HANDOVER_BATCHES, ProducerSequences
from danube_pipeline.errors import DuplicateSequenceError, ProducerFencedError
from danube_pipeline.format.batches import BatchBuilder, BatchHeader, parse_header, set_base_offset
from danube_pipeline.format.segments import StoredBatch

pytestmark = pytest.mark.unit

async_test = pytest.mark.asyncio


def header(header_id: int, base_sequence: int, count: int = 2, name: str = "p") -> BatchHeader:
    return parse_header(batch(header_id, base_sequence, count, name))


def batch(header_id: int, base_sequence: int, count: int = 2, name: str = "p") -> bytes:
    builder = BatchBuilder(1)
    for i in range(count):
        builder.append(f"{base_sequence + i}".encode(), timestamp_us=1)
    return builder.build(producer_id=header_id, producer_name=name, base_sequence=base_sequence)


def stored(header_id: int, base_sequence: int, offset: int, count: int = 2) -> StoredBatch:
    base, rest = set_base_offset(batch(header_id, base_sequence, count), offset)
    return StoredBatch(offset, count, base + bytes(rest))


def written(sequences: ProducerSequences, h: BatchHeader, offset: int) -> None:
    future: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
    sequences.record(h, future, offset)
    future.set_result((offset, offset + h.record_count - 1))


@async_test
async def test_a_newer_epoch_starts_at_zero_and_fences_the_older_one() -> None:
    sequences = ProducerSequences("/default/t")
    old, new = ProducerIdentity(7, 0), ProducerIdentity(7, 1)
    sequences.begin("p", old)
    written(sequences, header(old.header_id, 0), 0)
    written(sequences, header(old.header_id, 2), 2)
    sequences.begin("p", new)
    assert sequences.check(header(new.header_id, 0)) is None  # sequences start again
    with pytest.raises(ProducerFencedError) as fenced:
        sequences.check(header(old.header_id, 4))
    assert (fenced.value.producer_epoch, fenced.value.current_epoch) == (0, 1)
    sequences.begin("p", old)  # a late creation of the older instance changes nothing
    with pytest.raises(ProducerFencedError):
        sequences.check(header(old.header_id, 4))


@async_test
async def test_the_state_rebuilt_from_headers_is_resumed_by_its_instance_only() -> None:
    first, second = ProducerIdentity(7, 3), ProducerIdentity(7, 4)
    sequences = ProducerSequences("/default/t")
    # The WAL: epoch 3 wrote 0..3, then epoch 4 wrote 0..1 (its sequences started again).
    sequences.scan([stored(first.header_id, 0, 0), stored(first.header_id, 2, 2), stored(second.header_id, 0, 4)])
    sequences.begin("p", second)
    resent = sequences.check(header(second.header_id, 0))
    assert resent is not None and await resent == (4, 5)  # answered with its offsets
    with pytest.raises(DuplicateSequenceError):
        sequences.check(header(second.header_id, 1, count=1))
    assert sequences.check(header(second.header_id, 2)) is None
    with pytest.raises(ProducerFencedError):
        sequences.check(header(first.header_id, 4))


@async_test
async def test_the_handover_carries_the_identity_and_the_in_flight_window() -> None:
    identity = ProducerIdentity(9, 2)
    before = ProducerSequences("/default/t")
    before.begin("p", identity)
    for n in range(20):
        written(before, header(identity.header_id, 2 * n), 100 + 2 * n)
    value = before.to_json()
    assert value["producers"]["p"]["producer_id"] == 9 and value["producers"]["p"]["epoch"] == 2
    assert len(value["producers"]["p"]["batches"]) == HANDOVER_BATCHES >= 8
    after = ProducerSequences("/default/t")
    after.load(value)
    # A WAL from an earlier ownership (lower offsets, another session) does not replace it.
    after.scan([stored(12345, 0, 10)])
    after.begin("p", identity)
    for n in range(20 - HANDOVER_BATCHES, 20):
        resent = after.check(header(identity.header_id, 2 * n))
        assert resent is not None and await resent == (100 + 2 * n, 101 + 2 * n)
    assert after.check(header(identity.header_id, 40)) is None


def test_an_exhausted_epoch_gets_a_new_producer_id() -> None:
    last = ProducerIdentity(5, MAX_EPOCH)
    bumped = last.bumped()
    assert bumped.epoch == 0 and bumped.producer_id != 5
    assert ProducerIdentity(5, 1).bumped() == ProducerIdentity(5, 2)
    assert ProducerIdentity.from_json({"producer_id": 5, "epoch": 1}) == ProducerIdentity(5, 1)
    assert ProducerIdentity.from_json({"producer_id": 0, "epoch": 1}) is None
