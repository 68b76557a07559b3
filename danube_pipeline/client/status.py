"""The client side of the error round trip: a failed gRPC call becomes a typed Danube error.

This is the one place where a gRPC failure becomes a
:class:`~danube_pipeline.errors.DanubeError`, for the client library and also for
broker-to-broker forwarding (``broker/dispatch/dead_letter_forwarding.py`` calls another
broker as a client). The broker sends the server-side error class name and its constructor
arguments in trailing metadata (:data:`~danube_pipeline.error_codec.ERROR_CLASS_METADATA_KEY`,
:data:`~danube_pipeline.error_codec.ERROR_FIELDS_METADATA_KEY`); :func:`from_rpc_error` reads
them and rebuilds the typed exception through its own constructor with
:func:`~danube_pipeline.error_codec.error_from_status`, so ``except TopicNotFoundError as e:
e.topic`` works on the client and the retry logic reads the class's ``retriable`` /
``invalid_metadata`` flags (the aiokafka pattern).

A transport failure (connection refused, broker gone) arrives as ``UNAVAILABLE`` without a
class name; it becomes a :class:`~danube_pipeline.errors.BrokerUnavailableError` carrying the
address that failed. So does an ``INTERNAL`` status that gRPC's client made up itself, with
no broker answer behind it (:data:`CLIENT_SIDE_INTERNAL_DETAILS`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import grpc

from danube_pipeline.error_codec import (
    ERROR_CLASS_METADATA_KEY,
    ERROR_FIELDS_METADATA_KEY,
    error_from_status,
)
from danube_pipeline.errors import (
    BrokerUnavailableError,
    DanubeError,
)


def _trailing(exc: grpc.aio.AioRpcError, key: str) -> str | None:
    metadata = exc.trailing_metadata()
    if not metadata:
        return None
    for k, value in metadata:
        if k == key:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def _error_class(exc: grpc.aio.AioRpcError) -> str | None:
    return _trailing(exc, ERROR_CLASS_METADATA_KEY)


#: How ``INTERNAL`` statuses raised by gRPC's own client start. "Internal error from Core" is
#: what ``grpc.aio`` reports when a stream write fails because Core already closed the stream,
#: e.g. the broker died mid-stream (grpc/grpc#36066, grpcio 1.62 to 1.85 at least); an HTTP/2
#: stream reset arrives as "Received RST_STREAM ...". The broker's own ``INTERNAL`` answers
#: start with "internal error:" (``broker/rpc/status.py``) and are not transport failures.
CLIENT_SIDE_INTERNAL_DETAILS = ("Internal error from Core", "Received RST_STREAM")


#: What gRPC reports when a plaintext client's HTTP/2 preface reaches a TLS port: the server's
#: TLS handshake fails and it closes the connection. The same words follow other closed
#: connections too, so :data:`TLS_HINT` is phrased as a condition.
PLAINTEXT_ON_TLS_DETAILS = "Socket closed"
TLS_HINT = "if the broker serves TLS, give tls_ca_file"


def is_transport_failure(exc: grpc.aio.AioRpcError) -> bool:
    """Whether ``exc`` is a connection-level failure rather than an answer from a broker.

    Args:
        exc: the failed call's error.

    Returns:
        True, when there is no Danube error class in trailing metadata, for ``UNAVAILABLE``
        and for ``INTERNAL`` with details starting with one of
        :data:`CLIENT_SIDE_INTERNAL_DETAILS`.
    """
    if _error_class(exc) is not None:
        return False
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    return code == grpc.StatusCode.INTERNAL and (exc.details() or "").startswith(CLIENT_SIDE_INTERNAL_DETAILS)


def from_rpc_error(exc: grpc.aio.AioRpcError, address: str) -> DanubeError:
    """Convert a failed call into the typed Danube exception.

    Args:
        exc: the error raised by a ``grpc.aio`` call.
        address: ``"host:port"`` of the broker the call went to.

    Returns:
        An exception instance (not raised). It is a
        :class:`~danube_pipeline.error_codec.RemoteError` and, when the broker named a known class
        (or the transport failed), also an instance of that class.
    """
    code = exc.code()
    details = exc.details() or ""
    if is_transport_failure(exc):
        reason = details
        if code == grpc.StatusCode.UNAVAILABLE and PLAINTEXT_ON_TLS_DETAILS in details:
            reason = f"{details} ({TLS_HINT})"
        fields = json.dumps({"address": address, "reason": reason})
        return error_from_status(code, details, BrokerUnavailableError.__name__, fields)
    return error_from_status(code, details, _error_class(exc), _trailing(exc, ERROR_FIELDS_METADATA_KEY))


@contextlib.contextmanager
def rpc_errors(address: str) -> Iterator[None]:
    """Re-raise any ``grpc.aio.AioRpcError`` in the block as its Danube exception.

    Args:
        address: ``"host:port"`` of the broker the calls in the block go to.

    Raises:
        DanubeError: converted by :func:`from_rpc_error`.
        BrokerUnavailableError: the channel was closed under the call (retriable).
    """
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, address) from exc
    except grpc.aio.UsageError as exc:
        # The channel was closed under the call (another caller discarded it after its stream
        # failed): as retriable as a broken connection; the retry takes a fresh channel.
        raise unavailable(address, f"channel closed: {exc}") from exc


def unavailable(address: str, reason: str) -> BrokerUnavailableError:
    """A client-side :class:`BrokerUnavailableError` (no RPC failed, e.g. retries ran out).

    Args:
        address: the broker address, or a comma-separated list of the ones tried.
        reason: why, for the message.

    Returns:
        The exception instance, not raised.
    """
    return BrokerUnavailableError(address, reason)
