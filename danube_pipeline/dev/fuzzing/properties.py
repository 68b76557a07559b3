"""The named properties the long runs of ``benchmarks/fuzz.py`` iterate: the decoder
properties in process, and two per RPC against a :class:`~danube_pipeline.dev.fuzzing.target.BrokerTarget`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

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
from danube_pipeline.dev.fuzzing.rpcs import Rpc, raw_requests, requests, rpcs
from danube_pipeline.dev.fuzzing.target import BrokerTarget, check_request
from danube_pipeline.format.records import SegmentHeader


@dataclass(frozen=True)
class Property:
    """A named property: ``check`` must hold for every value ``strategy`` draws."""

    name: str
    strategy: st.SearchStrategy[Any]
    check: Callable[[Any], None]


def _unpacked(check: Callable[..., None], **kw: Any) -> Callable[[tuple[bytes, str]], None]:
    return lambda args: check(args[0], args[1], **kw)


def decoder_properties() -> list[Property]:
    """The decoder properties, in process (the same ones ``tests/test_fuzz.py`` runs)."""
    any_segment = st.tuples(st.sampled_from((2, 3)), st.binary(max_size=300)).map(
        lambda vb: SegmentHeader(0, 0, format_version=vb[0]).encode() + vb[1]
    ) | st.binary(max_size=300)
    columns_cases = segments() | segments_v2(tierable=True) | segments_v3(tierable=True)
    return [
        Property("batch_round_trip", batch_cases(), check_batch_round_trip),
        Property("segment_round_trip", st.tuples(segments(), st.integers(1, 5)), check_segment_round_trip),
        Property("batch_any_bytes", st.tuples(st.binary(max_size=300), containers), _unpacked(check_batch_bytes)),
        Property("batch_mutated", mutated_batches(), check_batch_mutation),
        Property("batch_crafted", st.tuples(crafted_batches(), containers), _unpacked(check_batch_bytes)),
        Property("segment_any_bytes", st.tuples(any_segment, containers), _unpacked(check_segment_bytes)),
        Property("segment_mutated", mutated_segments(), check_segment_mutation),
        Property("segment_crafted", st.tuples(crafted_segments(), containers), _unpacked(check_segment_bytes, strict=False)),
        Property("segment_columns", st.tuples(columns_cases.map(lambda c: c.data), containers),
                 _unpacked(check_segment_columns)),
        Property("segment_columns_mutated", mutated_segments(tierable=True).map(lambda cm: cm[1].apply(cm[0].data)),
                 lambda data: check_segment_columns(data)),
        Property("segment_columns_crafted", st.tuples(crafted_segments(), containers), _unpacked(check_segment_columns)),
    ]


def request_properties(target: BrokerTarget) -> list[Property]:
    """Two properties per RPC against ``target`` (prepared): fuzzed messages and raw garbage."""
    out = []
    for rpc in rpcs():
        def check(request: Any, rpc: Rpc = rpc) -> None:
            check_request(target, rpc, request)

        out.append(Property(f"{rpc.name}[fields]", requests(rpc, target.known), check))
        out.append(Property(f"{rpc.name}[garbage]", raw_requests(rpc, target.known), check))
    return out
