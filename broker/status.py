"""The one place that turns exceptions into gRPC statuses on the broker side.

A :class:`~danube_pipeline.errors.DanubeError` becomes its class's ``grpc_code``, its message
as details, and trailing metadata carrying its class name and constructor arguments
(:func:`danube_pipeline.errors.encode_error_metadata`), so the client rebuilds the same typed
exception with the same fields (``danube_pipeline.errors.error_from_status``). Anything else is
a bug: it is logged with its traceback and answered ``INTERNAL``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
from grpc import aio

from danube_pipeline.errors import DanubeError, encode_error_metadata

log = logging.getLogger(__name__)


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


def rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a servicer method (coroutine or async generator) with the status mapping."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except BaseException as exc:
                if _passthrough(exc) or not isinstance(exc, Exception):
                    raise
                await abort_with(context, exc)

        return stream_wrapper

    @functools.wraps(fn)
    async def unary_wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            return await fn(self, request, context)
        except BaseException as exc:
            if _passthrough(exc) or not isinstance(exc, Exception):
                raise
            await abort_with(context, exc)

    return unary_wrapper


__all__ = ["abort_with", "rpc"]
