"""The accumulator's side of ``Producer.send_many``: a run of messages split into batches as
one-by-one appends would split it, one future per batch, offsets per message, and refusals
that queue nothing.
"""

from __future__ import annotations

import asyncio

import pytest

from danube_pipeline.client._accumulator import Accumulator, Batch, MessageIds, span_offsets
from danube_pipeline.errors import MalformedRequestError, MessageTooLargeError
from danube_pipeline.format.batches import RECORD_OVERHEAD_BYTES, batch_records

pytestmark = pytest.mark.unit


def _payloads(batch: Batch) -> list[bytes]:
    return [r.payload for r in batch_records(batch.builder.build(producer_id=1, producer_name="p"))]


@pytest.mark.asyncio
async def test_append_many_splits_as_one_by_one_appends_would() -> None:
    """The same messages through ``append_many`` and through ``append`` give batches of the
    same contents, closed at the same count and byte limits."""
    r = RECORD_OVERHEAD_BYTES
    messages = [bytes([i]) * (i % 7) for i in range(40)] + [b"x" * 200, b"after"]
    by_one: list[Batch] = []
    by_many: list[Batch] = []
    one = Accumulator(max_batch_messages=6, max_batch_bytes=4 * r + 20, linger_ms=0, on_ready=by_one.append)
    many = Accumulator(max_batch_messages=6, max_batch_bytes=4 * r + 20, linger_ms=0, on_ready=by_many.append)
    for m in messages[:3]:  # an open batch with per-message futures first
        one.append(m)
        many.append(m)
    for m in messages[3:]:
        one.append(m)
    spans = many.append_many(messages[3:])
    one.close_batch()
    many.close_batch()
    assert [_payloads(b) for b in by_many] == [_payloads(b) for b in by_one]
    assert any(len(_payloads(b)) == 1 and _payloads(b)[0] == b"x" * 200 for b in by_many)  # alone
    assert sum(count for _, _, count in spans) == len(messages) - 3
    first = spans[0]
    assert first[0] is by_many[0] and first[1] == 3  # after the three messages with futures
    assert len(by_many[0].futures) == 3  # records of append_many get no future
    assert all(not b.futures for b in by_many[1:])


@pytest.mark.asyncio
async def test_offsets_follow_each_batch_and_errors_fail_the_run() -> None:
    ready: list[Batch] = []
    acc = Accumulator(max_batch_messages=4, max_batch_bytes=1 << 20, linger_ms=0, on_ready=ready.append)
    single = acc.append(b"a")
    spans = acc.append_many([b"b", b"c", b"d", b"e", b"f"])
    after = acc.append(b"g")
    acc.close_batch()
    loop = asyncio.get_running_loop()
    run = span_offsets(loop, spans)
    assert [b.message_count for b in ready] == [4, 3]
    assert ready[1].futures == [None, None, after]  # aligned with the record index
    ready[0].resolve(100)
    ready[1].resolve(500)
    assert (await single, await after) == (100, 502)
    assert list(await run) == [101, 102, 103, 500, 501]
    ids = run.result()
    assert isinstance(ids, MessageIds) and len(ids) == 5 and ids[3] == 500 and ids[-1] == 501
    assert ids[1:3] == [102, 103] and ids == [101, 102, 103, 500, 501]
    with pytest.raises(IndexError):
        ids[5]

    spans = acc.append_many([b"h", b"i", b"j", b"k", b"l"])
    acc.close_batch()
    failed_run = span_offsets(loop, spans)
    ready[2].resolve(600)
    ready[3].fail(MalformedRequestError("refused"))
    with pytest.raises(MalformedRequestError):
        await failed_run
    assert (await span_offsets(loop, [])) == []


@pytest.mark.asyncio
async def test_refusals_queue_nothing() -> None:
    ready: list[Batch] = []
    acc = Accumulator(max_batch_messages=100, max_batch_bytes=1 << 20, linger_ms=0, on_ready=ready.append)
    acc.max_message_size_bytes = 10
    acc.append(b"kept")
    with pytest.raises(MessageTooLargeError) as info:
        acc.append_many([b"ok", b"x" * 11, b"ok"])
    assert info.value.size_bytes == 11
    with pytest.raises(MalformedRequestError):
        acc.append_many([b"ok", b"ok"], key="\ud800")  # a lone surrogate: not UTF-8
    acc.close_batch()
    assert [_payloads(b) for b in ready] == [[b"kept"]]
