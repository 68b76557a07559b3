"""Fuzzing with hypothesis, bounded for ``make test``: the record and segment decoders in
process, and every RPC of ``danube.proto`` against a real broker.

The strategies and properties live in :mod:`danube_pipeline.dev.fuzzing`, shared with the long
runs of ``benchmarks/fuzz.py``. Example counts keep this module near 40 s on two cores.
No example database is written (``database=None``): a failure prints its falsifying example.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from danube_pipeline.format.batches import BATCH_HEADER_SIZE, BatchBuilder
from danube_pipeline.dev.fuzzing.decoders import (
    check_batch_bytes,
    check_batch_mutation,
    check_batch_round_trip,
    check_segment_bytes,
    check_segment_columns,
    check_segment_mutation,
    check_segment_round_trip,
)
from danube_pipeline.dev.fuzzing.formats import (
    BatchCase,
    Mutation,
    SegmentCase,
    batch_cases,
    containers,
    crafted_batches,
    crafted_segments,
    mutated_batches,
    mutated_segments,
    segments,
    segments_v2,
    segments_v3,
)
from danube_pipeline.dev.fuzzing.rpcs import DISRUPTIVE_RPCS, Rpc, raw_requests, requests, rpcs
from danube_pipeline.dev.fuzzing.target import BrokerTarget, check_request
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer, etcdctl_binary
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.format.records import SegmentHeader, crc32c

pytestmark = pytest.mark.fuzz

DECODER = settings(deadline=None, database=None)
# Each request example is a real gRPC call plus a health check (a few ms); creating topics,
# producers and schemas writes to etcd. Request data is drawn inside hypothesis' generation
# of 70 KB strings, which can trip too_slow on a loaded 2-core machine: the cost is in the
# inputs by design, so that health check is off for the request tests only.
REQUESTS = settings(deadline=None, database=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
GARBAGE = settings(REQUESTS, max_examples=15)

_HEADER_ONLY = SegmentHeader(0, 0).encode()
_BATCH_MAGIC_ONLY = bytes(16) + b"\x02" + bytes(BATCH_HEADER_SIZE - 17)


def _segment_with_key_length(key_length: int) -> bytes:
    """A version 2 segment of one one-record batch whose key_length is ``key_length``, CRC
    recomputed (so only the record framing is wrong)."""
    builder = BatchBuilder(0)
    builder.append_payload(b"x", 0)
    batch = bytearray(builder.build(producer_id=1, producer_name="p"))
    at = BATCH_HEADER_SIZE + 1 + 8  # after the 1-byte producer name: record_length, timestamp_delta
    batch[at : at + 4] = key_length.to_bytes(4, "little", signed=True)
    batch[12:16] = crc32c(bytes(batch[16:])).to_bytes(4, "little")
    return SegmentHeader(0, 0).encode() + bytes(batch)


# ------------------------------------------------------------------ decoders, in process


@pytest.mark.unit
@settings(DECODER, max_examples=150)
@given(batch_cases())
def test_batch_round_trip(case: BatchCase) -> None:
    check_batch_round_trip(case)


@pytest.mark.unit
@settings(DECODER, max_examples=150)
@given(segments(), st.integers(1, 5))
def test_segment_round_trip(case: SegmentCase, interval: int) -> None:
    check_segment_round_trip((case, interval))


@pytest.mark.unit
@settings(DECODER, max_examples=500)
@given(st.binary(max_size=300), containers)
@example(b"", "bytes")
@example(_BATCH_MAGIC_ONLY, "memoryview")
@example(_BATCH_MAGIC_ONLY[:12] + b"\xff\xff\xff\xff" + _BATCH_MAGIC_ONLY[16:], "bytes")
def test_batch_decoders_on_any_bytes(data: bytes, container: str) -> None:
    check_batch_bytes(data, container)


@pytest.mark.unit
@settings(DECODER, max_examples=300)
@given(mutated_batches())
def test_batch_bit_flips_byte_changes_and_truncations(case: tuple[BatchCase, Mutation]) -> None:
    check_batch_mutation(case)


@pytest.mark.unit
@settings(DECODER, max_examples=300)
@given(crafted_batches(), containers)
def test_batch_with_recomputed_crc_splits_if_accepted(data: bytes, container: str) -> None:
    check_batch_bytes(data, container)


@pytest.mark.unit
@settings(DECODER, max_examples=500)
@given(st.binary(max_size=300).map(lambda b: _HEADER_ONLY + b) | st.binary(max_size=300), containers)
@example(_HEADER_ONLY, "bytes")
@example(_HEADER_ONLY[:31], "bytes")
@example(_HEADER_ONLY + bytes(8), "memoryview")
@example(SegmentHeader(0, 0, format_version=1).encode() + b"\x28" + bytes(7), "bytes")
def test_segment_decoders_on_any_bytes(data: bytes, container: str) -> None:
    check_segment_bytes(data, container)


@pytest.mark.unit
@settings(DECODER, max_examples=300)
@given(mutated_segments())
def test_segment_bit_flips_byte_changes_and_truncations(case: tuple[SegmentCase, Mutation]) -> None:
    check_segment_mutation(case)


@pytest.mark.unit
@settings(DECODER, max_examples=300)
@given(crafted_segments(), containers)
# Decoded at b57fc27 into a record with no key (key_length -2 is neither -1 nor a length) though
# validate_batch refuses the batch; decode_segment now checks the framing (CorruptRecordError).
@example(_segment_with_key_length(-2), "bytes")
@example(_segment_with_key_length(1000), "memoryview")
def test_segment_with_recomputed_crc_raises_only_documented_errors(data: bytes, container: str) -> None:
    check_segment_bytes(data, container, strict=False)


@pytest.mark.unit
@settings(DECODER, max_examples=150)
@given(segments() | segments_v2(tierable=True) | segments_v3(tierable=True), containers)
def test_segment_columns_equal_the_reference_decoder(case: SegmentCase, container: str) -> None:
    check_segment_columns(case.data, container)


@pytest.mark.unit
@settings(DECODER, max_examples=300)
@given(mutated_segments(tierable=True))
def test_segment_columns_refuse_mutations_as_the_reference_decoder(case: tuple[SegmentCase, Mutation]) -> None:
    segment, mutation = case
    check_segment_columns(mutation.apply(segment.data))


@pytest.mark.unit
@settings(DECODER, max_examples=300)
@given(crafted_segments(), containers)
@example(_segment_with_key_length(-2), "bytes")
@example(_segment_with_key_length(1000), "memoryview")
def test_segment_columns_on_crafted_segments(data: bytes, container: str) -> None:
    check_segment_columns(data, container)


# ------------------------------------------------------------------ requests, real broker

RPCS = rpcs()
PROTO = Path(pb.__file__).with_name("danube.proto")


@pytest.mark.unit
def test_every_rpc_of_the_proto_is_fuzzed() -> None:
    """Every RPC but the disruptive ones (tested in ``tests/test_cluster.py`` and
    ``tests/test_topic_admin.py``)."""
    declared = re.findall(r"^\s*rpc\s+(\w+)\(", PROTO.read_text(), flags=re.MULTILINE)
    services = re.findall(r"^service\s+(\w+)", PROTO.read_text(), flags=re.MULTILINE)
    left_out = sorted(name.split(".")[1] for name in DISRUPTIVE_RPCS)
    assert left_out == ["AbandonUnavailableRange", "DeleteTopic", "DrainBroker", "ResetCursor", "UnloadTopic"]
    assert sorted(r.method for r in RPCS) == sorted(set(declared) - set(left_out))
    assert {r.service for r in RPCS} == set(services) == {
        "ProducerService", "ConsumerService", "Discovery", "Admin", "SchemaRegistry", "Replication"}


class Broker:
    """One broker for the module; restarted (and the target prepared again) if a test killed it,
    so one crash does not fail every later test."""

    def __init__(self, etcd: EtcdServer, data_dir: Path) -> None:
        self.process = BrokerProcess(etcd_endpoints=etcd.endpoints, data_dir=data_dir)
        self.target: BrokerTarget | None = None

    def up(self) -> BrokerTarget:
        if self.target is not None and self.process.running:
            return self.target
        if self.target is not None:
            self.target.close()
        self.process.stop()
        self.process.start()
        self.target = BrokerTarget(self.process.address, alive=lambda: self.process.running)
        self.target.prepare()
        return self.target

    def stop(self) -> None:
        if self.target is not None:
            self.target.close()
        self.process.stop()


@pytest.fixture(scope="module")
def broker(etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A broker of its own against the session etcd, emptied first (as ``etcd_endpoints`` does)."""
    subprocess.run(
        [etcdctl_binary(), f"--endpoints={etcd.client_url}", "del", "", "--from-key"],
        check=True, capture_output=True, timeout=30, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )
    b = Broker(etcd, tmp_path_factory.mktemp("fuzz") / "broker")
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def target(broker: Broker) -> BrokerTarget:
    return broker.up()


@pytest.mark.integration
@pytest.mark.parametrize("rpc", RPCS, ids=lambda r: r.name)
def test_request_with_fuzzed_fields(target: BrokerTarget, rpc: Rpc) -> None:
    """Messages with any field values (names with control characters, 70,000-character
    strings, u64 extremes, unknown enum numbers, any batch bytes; known ids mixed in) are
    answered with an allowed status, and the broker keeps serving."""

    @REQUESTS
    @given(request=requests(rpc, target.known))
    def fuzz(request: list[Message]) -> None:
        check_request(target, rpc, request)

    fuzz()
    target.assert_produce_consume()


@pytest.mark.integration
@pytest.mark.parametrize("rpc", RPCS, ids=lambda r: r.name)
def test_request_of_garbage_bytes(target: BrokerTarget, rpc: Rpc) -> None:
    """Payloads that do not parse as the request message (or parse after a mutation) are
    answered with an allowed status (INVALID_ARGUMENT for undecodable ones), never UNKNOWN."""

    @GARBAGE
    @given(request=raw_requests(rpc, target.known))
    @example(request=[b"\x80"])
    def fuzz(request: list[bytes]) -> None:
        check_request(target, rpc, request)

    fuzz()
    target.assert_produce_consume()


@pytest.mark.integration
def test_register_schema_nested_past_the_recursion_limit(target: BrokerTarget) -> None:
    """Found by the fields fuzzer at b57fc27: a schema text of JSON nested ~1,000 deep made the
    broker answer INTERNAL (RecursionError while parsing the JSON)."""
    (rpc,) = [r for r in RPCS if r.name == "SchemaRegistry.RegisterSchema"]
    for raw in ("[" * 5000 + "]" * 5000, '{"type": ' * 5000 + '"int"' + "}" * 5000):
        check_request(target, rpc, [pb.RegisterSchemaRequest(subject="fuzz-subject", raw_schema=raw)])
