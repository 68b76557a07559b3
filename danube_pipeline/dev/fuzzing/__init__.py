"""Hypothesis strategies and properties for fuzzing the record and segment decoders and the
broker's request handling: one copy, shared by ``tests/test_fuzz.py`` (bounded runs in
``make test``) and ``benchmarks/fuzz.py`` (long runs). Needs the ``dev`` extra (hypothesis).

* :mod:`~danube_pipeline.dev.fuzzing.formats`: batches and segments (valid, mutated, crafted
  with a recomputed CRC) and the values they are built from.
* :mod:`~danube_pipeline.dev.fuzzing.decoders`: the decoder properties (``check_*``).
* :mod:`~danube_pipeline.dev.fuzzing.rpcs`: every RPC of ``danube.proto`` and its fuzzed
  requests (messages from the descriptors, garbage bytes).
* :mod:`~danube_pipeline.dev.fuzzing.target`: :class:`~danube_pipeline.dev.fuzzing.target.BrokerTarget`
  (raw gRPC calls to a real broker) and ``check_request``.
* :mod:`~danube_pipeline.dev.fuzzing.properties`: the named properties the long runs iterate.

Every ``check_*`` function takes values drawn from the strategies here and raises
``AssertionError`` when its property breaks. A decoder that raises an exception its docstring
does not document is reported as an ``AssertionError`` naming the decoder and the exception
(the original chained).

Decoders and their documented errors:

* :func:`~danube_pipeline.format.batches.parse_header`, :func:`~danube_pipeline.format.batches.validate_batch`:
  :class:`MalformedRequestError`, :class:`MessageTooLargeError`.
* :func:`~danube_pipeline.format.segments.decode_segment`: :class:`CorruptRecordError`,
  :class:`OffsetRangeError`; :func:`~danube_pipeline.format.segments.iter_stored_batches`,
  :func:`~danube_pipeline.format.records.iter_records`, :meth:`SegmentHeader.decode`:
  :class:`CorruptRecordError`.
* :func:`~danube_pipeline.lake.segment_columns.decode_segment_columns`: the same errors as
  ``decode_segment``, with the same messages (``check_segment_columns``).
* :func:`~danube_pipeline.format.segments.scan_segment`: :class:`CorruptRecordError` for an unusable
  header only; after a valid header it never raises and its ``valid_length`` is a prefix whose
  records all decode.

Requests: ``BrokerTarget`` sends requests to a real broker over raw gRPC (generic
multi-callables, so garbage bytes go out as they are) and ``check_request`` requires a
status in ``ALLOWED_CODES`` and a broker still serving afterwards.
"""
