"""``danube_broker_rpc_total`` and ``danube_broker_rpc_duration_ms``: a ``grpc.aio`` server
interceptor counting every call by service, method and result, and timing it.

The result is the call's status code name (``OK``, ``INVALID_ARGUMENT``, ...), read from the
context once the call is done (``ServicerContext.add_done_callback``), so streams are counted
when they end and their messages pass through untouched. A call that ended with an exception
and no code set is ``UNKNOWN``, as gRPC answers it; a cancelled one ``CANCELLED``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from broker.metrics.families import BrokerMetrics, active


class MetricsInterceptor(aio.ServerInterceptor):  # type: ignore[misc]
    """Counts and times every RPC of the server it is given to (the first interceptor, so
    calls refused by authentication are counted too).

    Args:
        metrics: the broker's metrics.
    """

    def __init__(self, metrics: BrokerMetrics) -> None:
        self._metrics = metrics
        self._handlers: dict[str, grpc.RpcMethodHandler | None] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        wrapped = self._handlers.get(method)
        if wrapped is None:
            wrapped = self._handlers[method] = self._wrap(method, handler)
        return wrapped

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` with a done callback registered on each call's context."""
        service, _, name = method.lstrip("/").rpartition("/")
        counter, duration = self._metrics.rpc(service, name)

        def watch(context: Any) -> None:
            started = time.perf_counter()

            def done(ctx: Any) -> None:
                duration.observe((time.perf_counter() - started) * 1000.0)
                code = ctx.code()
                if code is None:
                    code = grpc.StatusCode.CANCELLED if ctx.cancelled() else grpc.StatusCode.OK
                counter(getattr(code, "name", str(code))).inc()

            context.add_done_callback(done)

        options = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}  # fmt: skip
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                watch(context)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **options)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> Any:
                watch(context)
                async for item in _relay(inner_us(request, context)):
                    yield item

            return grpc.unary_stream_rpc_method_handler(unary_stream, **options)
        if handler.stream_stream is not None:
            inner_ss = handler.stream_stream

            async def stream_stream(requests: Any, context: Any) -> Any:
                watch(context)
                async for item in _relay(inner_ss(requests, context)):
                    yield item

            return grpc.stream_stream_rpc_method_handler(stream_stream, **options)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def stream_unary(requests: Any, context: Any) -> Any:
                watch(context)
                return await inner_su(requests, context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, **options)
        return handler


async def _relay(items: Any) -> Any:
    """Yield what the handler's response stream yields, and close it however the call ends."""
    try:
        async for item in items:
            yield item
    finally:
        await items.aclose()


def metrics_interceptors() -> list[aio.ServerInterceptor]:
    """The metrics interceptor of the installed metrics, or none while metrics are off."""
    metrics = active()
    return [MetricsInterceptor(metrics)] if isinstance(metrics, BrokerMetrics) else []
