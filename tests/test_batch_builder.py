"""The record framing of ``danube_pipeline/format/_batch_builder.c`` against its pure-Python
twin in :mod:`danube_pipeline.format.batches`: the same bytes over random inputs, the same
refusals, and a builder left unchanged by a refused call.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.format import batches
from danube_pipeline.format.batches import (
    BatchBuilder,
    Payload,
    batch_records,
    native_batch_builder,
    validate_batch,
)

pytestmark = pytest.mark.unit

_native = batches._native  # the C functions, None without the extension
T0 = 1_700_000_000_000_000


def _random_payloads(rng: random.Random, count: int) -> list[Payload]:
    sizes = [rng.choice((0, 1, 2, 13, 100, 255, 256, 1000, 4096)) for _ in range(count)]
    raw = [rng.randbytes(size) for size in sizes]
    kinds = (bytes, bytearray, memoryview)
    return [rng.choice(kinds)(p) for p in raw]


def test_the_extension_is_built() -> None:
    # scripts/install-system-deps.sh installs gcc, so every install here builds it; without
    # it the comparisons below would compare Python with itself.
    assert native_batch_builder()
    assert _native is not None


@pytest.mark.parametrize("seed", range(20))
def test_c_and_python_frame_identical_bytes(seed: int) -> None:
    assert _native is not None
    frame_payload, frame_payloads = _native
    rng = random.Random(seed)
    payloads = _random_payloads(rng, rng.randrange(0, 60))
    delta = rng.choice((0, 1, 999, 2**31, 2**32 - 1))
    prefix = rng.randbytes(rng.randrange(0, 40))  # records already in the builder
    in_c, in_python = bytearray(prefix), bytearray(prefix)
    assert frame_payloads(in_c, payloads, delta) == batches._frame_payloads_python(in_python, payloads, delta)
    assert in_c == in_python
    one_by_one = bytearray(prefix)
    for payload in payloads:
        frame_payload(one_by_one, payload, delta)
    assert one_by_one == in_python


@pytest.mark.parametrize("seed", range(10))
def test_builder_fast_paths_match_the_general_append(seed: int) -> None:
    """``append_payload`` and ``append_payloads`` (C) write what ``append`` (Python, the path
    for keys and attributes) writes for the same records, mixed with keyed records."""
    rng = random.Random(seed)
    fast, general = BatchBuilder(T0), BatchBuilder(T0)
    expected: list[tuple[str | None, dict[str, str], bytes, int]] = []
    for _ in range(rng.randrange(1, 30)):
        ts = T0 + rng.randrange(0, 10**6)
        choice = rng.random()
        if choice < 0.3:
            key = rng.choice((None, "", "k", "ключ"))
            attributes = rng.choice(({}, {"a": "1"}, {"é": "", "b": "x" * 300}))
            payload = rng.randbytes(rng.randrange(0, 50))
            fast.append(payload, timestamp_us=ts, key=key, attributes=attributes)
            general.append(payload, timestamp_us=ts, key=key, attributes=attributes)
            expected.append((key, attributes, payload, ts))
        elif choice < 0.6:
            payload = rng.randbytes(rng.randrange(0, 50))
            fast.append_payload(payload, ts)
            general.append(payload, timestamp_us=ts)
            expected.append((None, {}, payload, ts))
        else:
            run = [bytes(p) for p in _random_payloads(rng, rng.randrange(0, 8))]
            fast.append_payloads(run, ts)
            for payload in run:
                general.append(payload, timestamp_us=ts)
                expected.append((None, {}, payload, ts))
    assert fast.record_count == general.record_count == len(expected)
    built = fast.build(producer_id=7, producer_name="p", base_sequence=3)
    assert built == general.build(producer_id=7, producer_name="p", base_sequence=3)
    validate_batch(built)
    records = list(batch_records(built))
    assert [(r.key, r.attributes, r.payload, r.publish_time_us) for r in records] == expected


def test_pure_python_install_frames_the_same_batch() -> None:
    """With ``DANUBE_NO_EXTENSIONS`` set the builder uses the Python path, to the same bytes."""
    code = (
        "import sys\n"
        "from danube_pipeline.format.batches import BatchBuilder, native_batch_builder\n"
        "b = BatchBuilder(5)\n"
        "b.append_payload(b'abc', 7)\n"
        "b.append_payloads([b'', bytearray(b'zz'), memoryview(b'q' * 300)], 9)\n"
        "b.append(b'k', timestamp_us=9, key='key', attributes={'a': 'b'})\n"
        "sys.stdout.write(repr(native_batch_builder()) + ' ' + b.build(producer_id=1, producer_name='n').hex())\n"
    )
    env = {**os.environ, "DANUBE_NO_EXTENSIONS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    native, data = out.split()
    assert native == "False"
    b = BatchBuilder(5)
    b.append_payload(b"abc", 7)
    b.append_payloads([b"", bytearray(b"zz"), memoryview(b"q" * 300)], 9)
    b.append(b"k", timestamp_us=9, key="key", attributes={"a": "b"})
    assert bytes.fromhex(data) == b.build(producer_id=1, producer_name="n")


@pytest.mark.parametrize("implementation", ["c", "python"])
def test_refused_payloads_leave_the_records_unchanged(implementation: str) -> None:
    assert _native is not None
    frame_payloads = _native[1] if implementation == "c" else batches._frame_payloads_python
    records = bytearray(b"before")
    with pytest.raises(TypeError):
        frame_payloads(records, [b"ok", 12, b"never"], 0)  # type: ignore[list-item]
    assert records == b"before"
    with pytest.raises(TypeError):
        frame_payloads(records, [b"ok", "text"], 0)  # type: ignore[list-item]
    assert records == b"before"


def test_builder_refusals_are_malformed_request_errors_and_change_nothing() -> None:
    builder = BatchBuilder(T0)
    builder.append_payload(b"first", T0)
    size = builder.size_bytes
    with pytest.raises(MalformedRequestError, match="timestamp delta"):
        builder.append_payload(b"late", T0 + 2**32)
    with pytest.raises(MalformedRequestError, match="timestamp delta"):
        builder.append_payloads([b"a", b"b"], T0 + 2**32)
    assert (builder.size_bytes, builder.record_count) == (size, 1)
    builder.append_payloads([b"early"], T0 - 5)  # the clock stepped back: stored at the first's time
    builder.append_payloads([], T0)  # nothing to frame
    records = list(batch_records(builder.build(producer_id=1, producer_name="p")))
    assert [(r.payload, r.publish_time_us) for r in records] == [(b"first", T0), (b"early", T0)]
