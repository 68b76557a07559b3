"""One connection to etcd: its endpoint, its request timeouts and deadlines, and the raw calls.

:class:`EtcdConnection` holds the ``aetcd`` client (``aetcd`` 1.0, asyncio gRPC for the etcd v3
API) and the calls every higher layer is built on: a raw range read and a transaction that
return the etcd header revision, lease keep-alive and revoke, and opening and cancelling a
watch. :class:`~danube_pipeline.metadata.store.MetadataStore` adds the JSON key-value
operations of ``docs/etcd-layout.md`` on top.

Each unary etcd request waits at most ``request_timeout_s``, and never past the deadline of the
enclosing :func:`deadline_scope` (the broker opens one per RPC with the client's deadline).
Every failure is raised as :class:`~danube_pipeline.errors.MetadataStoreError`.

:class:`EtcdSecurity` secures the connection: TLS (a CA bundle, optionally a client
certificate) and etcd user authentication (etcd's ``Auth.Authenticate`` at connect, its token
then sent on every call and renewed when etcd calls it invalid). ``aetcd`` 1.0 always opens a
plaintext channel and never renews its token, so :class:`_EtcdClient` opens the channel in its
place, with :class:`_EtcdToken` carrying the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aetcd
import grpc
from aetcd import rpc, watcher

from danube_pipeline.aio import wait_set
from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.metadata.etcd import split_endpoint, wrap_errors

_CHANNEL_OPTIONS = (
    # Reconnect to a restarted etcd within about a second (gRPC's default backoff grows to 2 min).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)



@dataclass(frozen=True, slots=True)
class EtcdSecurity:
    """How the connection to etcd is secured.

    Attributes:
        ca_file: PEM CA bundle verifying etcd's certificate; TLS is on when this or
            ``cert_file`` is set (without it, grpc's default roots verify etcd).
        cert_file: PEM client certificate chain (etcd's ``--client-cert-auth``), with
            ``key_file``.
        key_file: its PEM private key.
        user: etcd user name (etcd authentication, with ``password``).
        password: the user's password; never shown in ``repr``.

    Raises:
        ValueError: only one of ``cert_file`` and ``key_file``, or only one of ``user`` and
            ``password``.
    """

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("an etcd client certificate needs both a certificate and a key file")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd authentication needs both a user and a password")

    @property
    def tls(self) -> bool:
        """Whether etcd is reached over TLS."""
        return self.ca_file is not None or self.cert_file is not None

    @classmethod
    def from_env(cls) -> EtcdSecurity:
        """The security the ``DANUBE_ETCD_*`` variables give (each unset one: none):
        ``DANUBE_ETCD_TLS_CA_FILE``, ``DANUBE_ETCD_TLS_CERT_FILE``, ``DANUBE_ETCD_TLS_KEY_FILE``,
        ``DANUBE_ETCD_USER``, and the password from the file ``DANUBE_ETCD_PASSWORD_FILE``
        names, else ``DANUBE_ETCD_PASSWORD``.

        Raises:
            OSError: the password file cannot be read.
            ValueError: as the class.
        """

        def path(variable: str) -> Path | None:
            value = os.environ.get(variable, "").strip()
            return Path(value) if value else None

        user = os.environ.get("DANUBE_ETCD_USER") or None
        return cls(
            ca_file=path("DANUBE_ETCD_TLS_CA_FILE"),
            cert_file=path("DANUBE_ETCD_TLS_CERT_FILE"),
            key_file=path("DANUBE_ETCD_TLS_KEY_FILE"),
            user=user,
            password=read_password(path("DANUBE_ETCD_PASSWORD_FILE")) if user else None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS channel credentials from the files (read now).

        Raises:
            OSError: a file cannot be read.
        """
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes() if self.ca_file is not None else None,
            private_key=self.key_file.read_bytes() if self.key_file is not None else None,
            certificate_chain=self.cert_file.read_bytes() if self.cert_file is not None else None,
        )


def read_password(password_file: Path | None) -> str | None:
    """The etcd password: the first line of ``password_file``, else ``DANUBE_ETCD_PASSWORD``,
    else ``None``.

    Raises:
        OSError: the file cannot be read.
    """
    if password_file is not None:
        lines = password_file.read_text(encoding="utf-8").splitlines()
        return lines[0] if lines else ""
    return os.environ.get("DANUBE_ETCD_PASSWORD")


AUTHENTICATE_METHOD = "/etcdserverpb.Auth/Authenticate"


class _EtcdToken:
    """etcd user authentication on a channel: the token from ``Auth.Authenticate`` goes as
    ``token`` metadata on every call (:meth:`interceptors`), and a unary call refused with
    ``invalid auth token`` (an etcd restart drops its simple tokens; JWT tokens expire)
    authenticates again and is retried once. etcd does not check the token of a lease
    keep-alive; a watch refused for its token is opened again by its owner, with the token the
    next unary call renewed. aetcd 1.0 authenticates once at connect and keeps that token."""

    def __init__(self, user: str, password: str, *, timeout_s: float) -> None:
        self._request = rpc.AuthenticateRequest(name=user, password=password)
        self._timeout_s = timeout_s
        self._stub: Any = None
        self.token: str | None = None
        self._lock = asyncio.Lock()

    @staticmethod
    def invalid_token(exc: grpc.aio.AioRpcError) -> bool:
        """Whether etcd refused a call for its token (restarted, or the token expired)."""
        return exc.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid auth token" in (exc.details() or "")

    def bind(self, channel: grpc.aio.Channel) -> None:
        """Authenticate through ``channel`` (the channel the interceptors are on)."""
        self._stub = rpc.AuthStub(channel)

    async def authenticate(self, stale: str | None = None) -> None:
        """Get a new token, unless another call already replaced ``stale``.

        Raises:
            grpc.aio.AioRpcError: etcd refused the user or password, or could not be reached.
        """
        async with self._lock:
            if self.token is not None and self.token != stale:
                return
            response = await self._stub.Authenticate(self._request, timeout=self._timeout_s)
            self.token = str(response.token)

    def details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        """``details`` with the token added (when there is one)."""
        if self.token is None:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add("token", self.token)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """The channel's interceptors, one per kind of call (grpc files an interceptor under
        the first kind it implements only)."""
        return [_EtcdTokenUnaryUnary(self), _EtcdTokenUnaryStream(self), _EtcdTokenStreamStream(self)]

    def __repr__(self) -> str:  # never show the password or the token
        return "_EtcdToken(***)"


# grpc ships no type hints: the interceptor bases are Any to mypy. etcd has no stream-unary call.


class _EtcdTokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, auth: _EtcdToken) -> None:
        self._auth = auth

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        method = client_call_details.method
        if (method.decode() if isinstance(method, bytes) else method) == AUTHENTICATE_METHOD:
            return await continuation(client_call_details, request)
        if self._auth.token is None:
            await self._auth.authenticate()
        used = self._auth.token
        call = await continuation(self._auth.details(client_call_details), request)
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            if not self._auth.invalid_token(exc):
                return call
            await self._auth.authenticate(stale=used)
            return await continuation(self._auth.details(client_call_details), request)
        return call


class _EtcdTokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, auth: _EtcdToken) -> None:
        self._auth = auth

    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._auth.details(client_call_details), request)


class _EtcdTokenStreamStream(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, auth: _EtcdToken) -> None:
        self._auth = auth

    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request_iterator: Any
    ) -> Any:
        if self._auth.token is None:
            await self._auth.authenticate()
        return await continuation(self._auth.details(client_call_details), request_iterator)


class _EtcdClient(aetcd.Client):  # type: ignore[misc]
    """``aetcd.Client`` with TLS and renewable user authentication: aetcd 1.0's own
    :meth:`connect` always opens a plaintext channel and keeps its first token forever. The
    stubs and the watcher are set up as aetcd's connect does.

    Args:
        credentials: TLS channel credentials, ``None`` for plaintext.
        auth: the user authentication interceptor, ``None`` for none.
        kwargs: ``aetcd.Client``'s arguments, without ``username`` and ``password``.
    """

    _is_connecting: bool

    def __init__(self, *, credentials: grpc.ChannelCredentials | None, auth: _EtcdToken | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials
        self._auth = auth

    async def connect(self) -> None:
        """Open the channel and, with a user, authenticate.

        Raises:
            grpc.aio.AioRpcError: authentication refused or etcd unreachable.
        """
        if self._connected.is_set():
            return
        if self._is_connecting:
            if not await wait_set(self._connected, self._connect_wait_timeout):
                raise TimeoutError(f"etcd {self._host}:{self._port}: another connect still running after "
                                   f"{self._connect_wait_timeout} s")
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            interceptors = self._auth.interceptors() if self._auth is not None else None
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(target, self._credentials, options=options, interceptors=interceptors)
            else:
                channel = grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
            self.channel = channel
            if self._auth is not None:
                self._auth.bind(channel)
                await self._auth.authenticate()
            self.kvstub = rpc.KVStub(channel)
            self.clusterstub = rpc.ClusterStub(channel)
            self.leasestub = rpc.LeaseStub(channel)
            self.maintenancestub = rpc.MaintenanceStub(channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(channel), timeout=self._timeout, metadata=None)
            self._connected.set()
        except BaseException:
            if self.channel is not None:
                with contextlib.suppress(Exception):
                    await self.channel.close()
                self.channel = None
            raise
        finally:
            self._is_connecting = False


def _client(host: str, port: int, security: EtcdSecurity, *, request_timeout_s: float) -> aetcd.Client:
    """An unconnected aetcd client for ``host:port`` with ``security``.

    Raises:
        OSError: a TLS file cannot be read.
    """
    kwargs: dict[str, Any] = {"host": host, "port": port, "timeout": request_timeout_s, "options": dict(_CHANNEL_OPTIONS)}
    if not security.tls and security.user is None:
        return aetcd.Client(**kwargs)
    credentials = security.channel_credentials() if security.tls else None
    auth = None
    if security.user is not None and security.password is not None:
        auth = _EtcdToken(security.user, security.password, timeout_s=request_timeout_s)
    return _EtcdClient(credentials=credentials, auth=auth, **kwargs)


_deadline: ContextVar[float | None] = ContextVar("danube_etcd_deadline", default=None)


@contextlib.contextmanager
def deadline_scope(budget_s: float | None) -> Iterator[None]:
    """Bound every etcd request made inside the block (and in tasks it creates) to end within
    ``budget_s`` seconds from now; ``None`` adds no bound. Scopes nest: the earlier deadline wins.

    A request that would outlive the deadline fails with
    :class:`~danube_pipeline.errors.MetadataStoreError` when it is reached.
    """
    if budget_s is None:
        yield
        return
    deadline = time.monotonic() + budget_s
    outer = _deadline.get()
    token = _deadline.set(deadline if outer is None else min(deadline, outer))
    try:
        yield
    finally:
        _deadline.reset(token)


def remaining_budget_s() -> float | None:
    """Seconds left before the innermost :func:`deadline_scope` ends, ``None`` outside one."""
    deadline = _deadline.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class EtcdConnection:
    """A connection to one etcd endpoint, with the raw calls the metadata layer is built on.

    Create with :meth:`connect`; close with :meth:`close` or ``async with``.
    """

    def __init__(self, client: aetcd.Client, endpoint: str, *, request_timeout_s: float) -> None:
        """Wrap an already connected aetcd client; use :meth:`connect` instead."""
        self._client = client
        self._endpoint = endpoint
        self._request_timeout_s = request_timeout_s
        self._closed = False

    @classmethod
    async def connect(
        cls,
        endpoints: Sequence[str],
        *,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 10.0,
        security: EtcdSecurity | None = None,
    ) -> Self:
        """Connect to the first etcd endpoint that answers.

        Args:
            endpoints: ``host:port`` strings (an ``http://`` or ``https://`` prefix is accepted
                and ignored: ``security`` decides TLS), tried in order.
            connect_timeout_s: how long each endpoint gets to answer a probe read.
            request_timeout_s: deadline of every later unary etcd request.
            security: TLS and user authentication; default :meth:`EtcdSecurity.from_env`
                (plaintext without a user when no ``DANUBE_ETCD_*`` security variable is set).

        Returns:
            A connected store.

        Raises:
            MetadataStoreError: if ``endpoints`` is empty or malformed, no endpoint answers
                (a refused TLS handshake or refused credentials included), or a security file
                cannot be read.
        """
        if not endpoints:
            raise MetadataStoreError("connect", "no etcd endpoints given")
        if security is None:
            try:
                security = EtcdSecurity.from_env()
            except (OSError, ValueError) as exc:
                raise MetadataStoreError("connect", f"etcd security settings: {exc}") from exc
        failures: list[str] = []
        for endpoint in endpoints:
            host, port = split_endpoint(endpoint)
            try:
                client = _client(host, port, security, request_timeout_s=request_timeout_s)
            except OSError as exc:
                raise MetadataStoreError("connect", f"etcd TLS files: {exc}") from exc
            store = cls(client, f"{host}:{port}", request_timeout_s=request_timeout_s)
            try:
                async with asyncio.timeout(connect_timeout_s):
                    await store.range_raw(b"/", None, limit=1)
            except (MetadataStoreError, TimeoutError) as exc:
                failures.append(f"{endpoint}: {exc or 'timed out'}")
                with contextlib.suppress(Exception):
                    await client.close()
                continue
            return store
        raise MetadataStoreError(
            "connect", "no etcd endpoint answered (" + "; ".join(failures) + ")"
        )

    @property
    def endpoint(self) -> str:
        """The ``host:port`` this store is connected to."""
        return self._endpoint

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called; every operation then raises."""
        return self._closed

    async def close(self) -> None:
        """Close the connection (idempotent); open watches end, later calls raise
        :class:`MetadataStoreError`."""
        self._closed = True
        with contextlib.suppress(Exception):
            await self._client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _timeout(self, operation: str) -> float:
        """Seconds the next etcd request may take: ``request_timeout_s``, or less to end by
        the deadline of the enclosing :func:`deadline_scope`.

        Raises:
            MetadataStoreError: the deadline has passed.
        """
        deadline = _deadline.get()
        if deadline is None:
            return self._request_timeout_s
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MetadataStoreError(operation, "no time left before the request's deadline")
        return min(self._request_timeout_s, remaining)

    async def _connected(self) -> aetcd.Client:
        if self._closed:
            raise MetadataStoreError("request", "the metadata store is closed")
        await self._client.connect()
        return self._client

    async def range_raw(
        self, key: bytes, range_end: bytes | None, *, revision: int = 0, limit: int = 0
    ) -> Any:
        """One etcd ``Range`` request, answered as etcd's raw ``RangeResponse`` (its header
        carries the revision); ``range_end`` ``None`` reads the one key."""
        with wrap_errors("get"):
            timeout = self._timeout("get")
            client = await self._connected()
            request = rpc.RangeRequest(
                key=key,
                range_end=range_end or b"",
                revision=revision,
                limit=limit,
                sort_order=rpc.RangeRequest.ASCEND,
                sort_target=rpc.RangeRequest.KEY,
            )
            return await client.kvstub.Range(request, timeout=timeout, metadata=client.metadata)

    async def _txn(
        self, operation: str, compare: Sequence[Any], success: Sequence[Any]
    ) -> tuple[bool, int]:
        response = await self.txn_raw(operation, compare, success)
        return bool(response.succeeded), int(response.header.revision)

    async def txn_raw(self, operation: str, compare: Sequence[Any], success: Sequence[Any]) -> Any:
        """One etcd ``Txn`` request (no failure branch), answered as etcd's raw
        ``TxnResponse``: ``succeeded``, the header revision, and one response per operation
        of ``success`` when it ran."""
        with wrap_errors(operation):
            timeout = self._timeout(operation)
            client = await self._connected()
            return await client.kvstub.Txn(
                rpc.TxnRequest(compare=list(compare), success=list(success), failure=[]),
                timeout=timeout,
                metadata=client.metadata,
            )

    async def refresh_lease(self, lease_id: int, *, timeout_s: float | None = None) -> int:
        """Send one keep-alive for ``lease_id``; return the TTL etcd granted (0 = the lease is gone).

        Raises:
            MetadataStoreError: etcd did not answer within ``timeout_s`` (default the request
                timeout).
        """
        with wrap_errors("lease keep-alive"):
            client = await self._connected()
            async for reply in client.leasestub.LeaseKeepAlive(
                [rpc.LeaseKeepAliveRequest(ID=lease_id)],
                timeout=timeout_s or self._request_timeout_s,
                metadata=client.metadata,
            ):
                return int(reply.TTL)
        return 0

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke ``lease_id``: etcd deletes every key attached to it."""
        with wrap_errors("lease revoke"):
            client = await self._connected()
            await client.revoke_lease(lease_id)

    async def open_watch(self, key: bytes, range_end: bytes, start_revision: int) -> aetcd.Watch:
        """Start an etcd watch of ``key`` .. ``range_end`` from ``start_revision`` (inclusive)."""
        with wrap_errors("watch"):
            client = await self._connected()
            return await client.watch(key, range_end=range_end, start_revision=start_revision)

    @staticmethod
    async def cancel_watch(watch: aetcd.Watch) -> None:
        """Cancel ``watch``, waiting at most 2 s; errors are ignored."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await watch.cancel()
