"""A TCP proxy that can be blackholed, for ``benchmarks/chaos.py``: one broker reaches etcd
only through it, so cutting it cuts that broker off from etcd while clients still reach the
broker directly (a network partition between a broker and etcd).

While :attr:`BlackholeProxy.blackholed`, bytes either way are read and dropped and new
connections are accepted but go nowhere: nothing answers and nothing is refused, as with a
dropped route (a refused connection would tell the broker at once). :meth:`BlackholeProxy.heal`
forwards again and closes every held connection, so the broker's client reconnects with clean
streams instead of resuming mid-frame.
"""

from __future__ import annotations

import asyncio
import contextlib


class BlackholeProxy:
    """Forward every connection made to :attr:`address` to ``target`` (``host:port``)."""

    def __init__(self, target: str, *, host: str = "127.0.0.1", port: int = 0) -> None:
        target_host, _, target_port = target.rpartition(":")
        self._target = (target_host or "127.0.0.1", int(target_port))
        self._host = host
        self._port = port
        self.blackholed = False
        self.connections = 0
        """Connections accepted so far."""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        """``host:port`` the proxy listens on (after :meth:`start`)."""
        return f"{self._host}:{self._port}"

    async def start(self) -> str:
        """Listen; returns :attr:`address`.

        Raises:
            OSError: the port could not be bound.
        """
        self._server = await asyncio.start_server(self._serve, self._host, self._port)
        self._port = int(self._server.sockets[0].getsockname()[1])
        return self.address

    def blackhole(self) -> None:
        """Stop forwarding: drop every byte, hold every connection, accept new ones idly."""
        self.blackholed = True

    def heal(self) -> None:
        """Forward again; close the connections held meanwhile (their streams are torn)."""
        self.blackholed = False
        for writer in list(self._writers):
            writer.close()

    async def close(self) -> None:
        """Stop listening and close every connection. Idempotent."""
        if self._server is not None:
            self._server.close()
        self.heal()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        self.connections += 1
        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            pumps: list[asyncio.Task[None]] = []
            if not self.blackholed:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self._target), 5)
                upstream = up_writer
                self._writers.add(up_writer)
                pumps.append(asyncio.create_task(self._pump(up_reader, writer)))
            pumps.append(asyncio.create_task(self._pump(reader, upstream)))
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
        except (OSError, TimeoutError, asyncio.CancelledError):
            pass  # a cancellation comes only from close(): the connection ends here
        finally:
            for w in (writer, upstream):
                if w is not None:
                    self._writers.discard(w)
                    w.close()
            if task is not None:
                self._handlers.discard(task)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter | None) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                if dst is not None and not self.blackholed:
                    dst.write(data)
                    await dst.drain()
