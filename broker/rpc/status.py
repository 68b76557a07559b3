"""The one place that turns exceptions into gRPC statuses on the broker side.

A :class:`~danube_pipeline.errors.DanubeError` becomes its class's ``grpc_code``, its message
as details, and trailing metadata carrying its class name and constructor arguments
(:func:`danube_pipeline.error_codec.encode_error_metadata`), so the client rebuilds the same typed
exception with the same fields (``danube_pipeline.error_codec.error_from_status``). Anything else is
a bug: it is logged with its traceback and answered ``INTERNAL``.

Two more things happen here for every RPC:

* Requests are decoded by :func:`tolerant_handler`: bytes that are not the request message
  reach the servicer as :class:`UndecodableRequest` and are answered ``INVALID_ARGUMENT``
  (:class:`~danube_pipeline.errors.MalformedRequestError`), where gRPC's own decoding would
  answer ``UNKNOWN`` and log a traceback.
* The client's deadline bounds the broker's etcd operations
  (:func:`danube_pipeline.metadata.connection.deadline_scope`): an etcd call that would outlive it
  fails first with :class:`~danube_pipeline.errors.MetadataStoreError`, which the client
  receives instead of ``DEADLINE_EXCEEDED``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from grpc import aio

from danube_pipeline.error_codec import encode_error_metadata
from danube_pipeline.errors import (
    DanubeError,
    MalformedRequestError,
)
from danube_pipeline.metadata.connection import deadline_scope

log = logging.getLogger(__name__)

DEADLINE_MARGIN_S = 0.25
"""etcd operations of an RPC end this long before the client's deadline (or a tenth of the
time left, if less), leaving time to send the typed error back."""


class UndecodableRequest:
    """What a request that does not decode as its message becomes (see :func:`tolerant_handler`).

    Attributes:
        message_type: the full protobuf name of the expected message.
        reason: the decoder's error, bounded.
    """

    __slots__ = ("message_type", "reason")

    def __init__(self, message_type: str, reason: str) -> None:
        self.message_type = message_type
        self.reason = reason

    def error(self) -> MalformedRequestError:
        """The error the RPC answers with."""
        return MalformedRequestError(f"the request does not decode as {self.message_type}: {self.reason}")


def _tolerant_deserializer(message_class: type[Message]) -> Callable[[bytes], Message | UndecodableRequest]:
    name = message_class.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Message | UndecodableRequest:
        try:
            return message_class.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return UndecodableRequest(name, str(exc)[:200] or type(exc).__name__)

    return deserialize


def tolerant_handler(service: ServiceDescriptor, servicer: object) -> grpc.GenericRpcHandler:
    """The gRPC handler of every method of ``service``, calling the same-named methods of
    ``servicer`` (what the generated ``add_*Servicer_to_server`` registers), with requests
    decoded by a deserializer that never raises: undecodable bytes arrive as
    :class:`UndecodableRequest`, which :func:`rpc` answers ``INVALID_ARGUMENT``.

    Args:
        service: the protobuf service descriptor (``danube_pb2.DESCRIPTOR.services_by_name``).
        servicer: an object with one :func:`rpc`-decorated method per RPC.

    Returns:
        A handler for ``server.add_generic_rpc_handlers``.
    """
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        behaviour = getattr(servicer, method.name)
        deserialize = _tolerant_deserializer(method.input_type._concrete_class)
        serialize = method.output_type._concrete_class.SerializeToString
        if method.client_streaming and method.server_streaming:
            factory = grpc.stream_stream_rpc_method_handler
        elif method.server_streaming:
            factory = grpc.unary_stream_rpc_method_handler
        elif method.client_streaming:
            factory = grpc.stream_unary_rpc_method_handler
        else:
            factory = grpc.unary_unary_rpc_method_handler
        handlers[method.name] = factory(behaviour, request_deserializer=deserialize, response_serializer=serialize)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


async def checked_requests(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The requests of a client stream; an undecodable one ends it with its error.

    Raises:
        MalformedRequestError: a request did not decode.
    """
    async for request in requests:
        if isinstance(request, UndecodableRequest):
            raise request.error()
        yield request


def _deadline_budget(context: Any) -> float | None:
    """Seconds the RPC's etcd operations may take: the client's time left less a margin."""
    remaining: float | None = context.time_remaining()
    if remaining is None:
        return None
    return max(remaining - min(DEADLINE_MARGIN_S, remaining / 10), 0.0)


async def abort_with(context: aio.ServicerContext[Any, Any], exc: BaseException) -> NoReturn:
    """Abort the RPC with the status matching ``exc``.

    Raises:
        grpc.aio.AbortError: always (that is how grpc.aio ends an RPC with a status).
    """
    if isinstance(exc, DanubeError):
        await context.abort(exc.grpc_code, str(exc), trailing_metadata=encode_error_metadata(exc))
    log.error("unexpected error in RPC", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def _passthrough(exc: BaseException) -> bool:
    return isinstance(exc, (aio.AbortError, asyncio.CancelledError, GeneratorExit))


def _scope_until(deadline: float | None) -> contextlib.AbstractContextManager[None]:
    """A :func:`deadline_scope` ending at ``deadline`` (monotonic seconds; ``None``: unbounded)."""
    return deadline_scope(None if deadline is None else max(0.0, deadline - time.monotonic()))


async def _close_quietly(items: AsyncGenerator[Any, None]) -> None:
    """Close a stream handler's generator; a failure in its clean-up is logged, never raised
    (the stream may be closed by a task nobody awaits: grpc.aio's or the loop's finalizer)."""
    try:
        await items.aclose()
    except Exception:
        log.exception("unexpected error in RPC clean-up")


def rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a servicer method (coroutine or async generator) with the status mapping.

    A stream handler runs each step (up to its next item) inside the RPC's
    :func:`deadline_scope`, never across a ``yield``: grpc.aio may close a stream the client
    cancelled from another task, whose context could not leave a scope opened in the handler's.
    """
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            items: AsyncGenerator[Any, None] | None = None
            try:
                if isinstance(request, UndecodableRequest):
                    raise request.error()
                if not isinstance(request, Message):  # a client stream
                    request = checked_requests(request)
                budget_s = _deadline_budget(context)
                deadline = None if budget_s is None else time.monotonic() + budget_s
                items = fn(self, request, context)
                while True:
                    with _scope_until(deadline):
                        try:
                            item = await anext(items)
                        except StopAsyncIteration:
                            break
                    yield item
            except BaseException as exc:
                if _passthrough(exc) or not isinstance(exc, Exception):
                    raise
                try:
                    await abort_with(context, exc)
                except aio.AbortError:
                    raise
                except Exception:  # noqa: BLE001 - the call is over (the client left): no status can go
                    return
            finally:
                if items is not None:
                    await _close_quietly(items)

        return stream_wrapper

    @functools.wraps(fn)
    async def unary_wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            if isinstance(request, UndecodableRequest):
                raise request.error()
            with deadline_scope(_deadline_budget(context)):
                return await fn(self, request, context)
        except BaseException as exc:
            if _passthrough(exc) or not isinstance(exc, Exception):
                raise
            await abort_with(context, exc)

    return unary_wrapper


__all__ = ["UndecodableRequest", "abort_with", "checked_requests", "rpc", "tolerant_handler"]
