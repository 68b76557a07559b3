"""Authentication, authorization and the audit line of every RPC the broker serves.

:class:`AuthInterceptor` wraps each method handler when :attr:`BrokerConfig.authentication` is
set (nothing is installed otherwise, see :func:`auth_interceptors`):

* **Who.** A bearer token (``authorization: Bearer <jwt>``, :mod:`danube_pipeline.auth.tokens`)
  names the principal in its ``sub``. Without one, a verified client certificate's subject
  (its common name, else the whole RFC 4514 subject) is the principal when ``auth_mtls`` is
  set. A peer whose verified certificate carries this broker's own certificate subject is a
  broker of the cluster and may do everything: a broker's identity comes only from its
  certificate, never from a request header. Anything else is ``UNAUTHENTICATED``
  (:class:`~danube_pipeline.errors.AuthenticationError`), with a reason that names no secret.
  A certificate is verified only on a port that requires one: the main port under
  ``tls_require_client_cert``, and the broker-to-broker port (``internal_listen``), whose
  interceptor (``brokers_only``) admits brokers and nobody else.
* **What.** With ``authorization``, each RPC needs a permission on its real resource
  (:data:`RULES`): produce and consume calls on the topic of their producer or consumer
  (``Receive``, ``Ack``, ``Nack`` included), admin calls on the topic, the namespace or the
  cluster. The roles and bindings are read from the broker's watched etcd cache
  (``docs/etcd-layout.md`` §7), so a change reaches every broker within the watch delay.
  Streams are checked again at every message: a ``Receive`` or ``SendStream`` whose binding
  is removed, or whose token expires, ends with the refusal. A ``ProduceStream`` carries the
  batches of many producers: each batch is checked on its own topic (:data:`BATCH_RULES`), and a
  refused one is answered with the refusal as data while the stream goes on; an expired token
  ends it. Super-admins hold everything.
  A refusal is ``PERMISSION_DENIED`` (:class:`~danube_pipeline.errors.PermissionDeniedError`).
* **Audit.** Logger ``danube.audit`` writes one JSON line per refused call and per admin change
  (:data:`ADMIN_CHANGES`): ``principal`` (``-`` when unauthenticated), ``rpc``, ``resource``,
  ``result`` (``ok``, ``refused`` or ``failed: <status>``); a refusal adds ``reason`` and
  ``peer``, a change ``via`` (``token``, ``certificate``, ``broker``). On the broker-to-broker
  port, where every caller has the brokers' one subject, a change also names the certificate
  that made it: ``cert_serial``, its serial number in hexadecimal.

``grpc.health.v1.Health`` is served without credentials (it tells only whether the broker
serves). An RPC of no rule is refused under authorization: a new RPC is denied until mapped.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID
from grpc import aio

from danube_pipeline.auth.permissions import Permission, Resource, Scope, granted
from danube_pipeline.auth.tokens import ReloadingTokenVerifier, TokenClaims, TokenVerifier, bearer_token
from danube_pipeline.errors import AuthenticationError, DanubeError, InvalidNameError, PermissionDeniedError
from danube_pipeline.names import TopicName

from broker import metrics
from broker.config import BrokerConfig
from broker.core import Broker
from broker.rpc.produce_stream import BATCH_CHECK, ItemCheck
from broker.rpc.status import UndecodableRequest, abort_with

__all__ = ["ADMIN_CHANGES", "AUDIT_LOGGER", "BATCH_RULES", "AuthInterceptor", "Caller", "RULES", "Rule", "auth_interceptors"]

log = logging.getLogger(__name__)
AUDIT_LOGGER = "danube.audit"
audit_log = logging.getLogger(AUDIT_LOGGER)

UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)
"""Methods served without credentials."""


# ------------------------------------------------------------------------------- resources


def _topic(path: str) -> Resource:
    """The topic of ``path``; a malformed name is checked at cluster scope (the strictest: only
    a cluster-wide grant reaches the handler, which then refuses the name)."""
    try:
        return Scope.of_topic(TopicName.parse(path))
    except InvalidNameError:
        return Scope.cluster()


def _namespace(name: str) -> Resource:
    if not name:
        return Scope.cluster()
    try:
        return Scope.of_namespace(name)
    except InvalidNameError:
        return Scope.cluster()


def _cluster(_broker: Broker, _request: Any) -> Resource:
    return Scope.cluster()


def _request_topic(_broker: Broker, request: Any) -> Resource:
    return _topic(request.topic)


def _producer_topic(broker: Broker, request: Any) -> Resource | None:
    producer = broker.producers.get(request.producer_id)
    return None if producer is None else _topic(producer.topic.path)


def _consumer_topic(broker: Broker, request: Any) -> Resource | None:
    consumer = broker.consumers.get(request.consumer_id)
    return None if consumer is None else _topic(consumer.subscription.topic)


def _no_resource(_broker: Broker, _request: Any) -> None:
    return None


def _list_namespace(_broker: Broker, request: Any) -> Resource:
    return _namespace(request.namespace)


@dataclass(frozen=True, slots=True)
class Rule:
    """What one RPC needs.

    Attributes:
        permissions: any one of them suffices; empty: authentication only.
        resource: the resource of a request; ``None`` when the request names a producer or
            consumer this broker does not know (the handler then answers ``NOT_FOUND`` and
            acts on nothing).
    """

    permissions: tuple[Permission, ...]
    resource: Callable[[Broker, Any], Resource | None]


_P = Permission
RULES: dict[str, Rule] = {
    "/danube.v1.ProducerService/CreateProducer": Rule((_P.PRODUCE,), _request_topic),
    "/danube.v1.ProducerService/SendBatch": Rule((_P.PRODUCE,), _producer_topic),
    "/danube.v1.ProducerService/SendStream": Rule((_P.PRODUCE,), _producer_topic),
    "/danube.v1.ProducerService/CloseProducer": Rule((_P.PRODUCE,), _producer_topic),
    # Authentication per message; each batch is authorized by BATCH_RULES.
    "/danube.v1.ProducerService/ProduceStream": Rule((), _no_resource),
    "/danube.v1.ConsumerService/Subscribe": Rule((_P.CONSUME,), _request_topic),
    "/danube.v1.ConsumerService/Receive": Rule((_P.CONSUME,), _consumer_topic),
    "/danube.v1.ConsumerService/Ack": Rule((_P.CONSUME,), _consumer_topic),
    "/danube.v1.ConsumerService/Nack": Rule((_P.CONSUME,), _consumer_topic),
    "/danube.v1.ConsumerService/CloseConsumer": Rule((_P.CONSUME,), _consumer_topic),
    # producers and consumers look their topic up: any of the three on it will do
    "/danube.v1.Discovery/TopicLookup": Rule((_P.LOOKUP, _P.PRODUCE, _P.CONSUME), _request_topic),
    # every client reads the broker map to connect
    "/danube.v1.Discovery/ClusterMetadata": Rule((), _cluster),
    "/danube.v1.Admin/CreateTopic": Rule((_P.MANAGE_TOPIC,), _request_topic),
    "/danube.v1.Admin/ListTopics": Rule((_P.LOOKUP,), _list_namespace),
    "/danube.v1.Admin/ListSealedSegments": Rule((_P.CONSUME, _P.MANAGE_TOPIC), _request_topic),
    "/danube.v1.Admin/SealActiveSegment": Rule((_P.MANAGE_TOPIC,), _request_topic),
    "/danube.v1.Admin/ReadSegment": Rule((_P.CONSUME,), _request_topic),
    "/danube.v1.Admin/ApplyLocalRetention": Rule((_P.MANAGE_TOPIC,), _request_topic),
    "/danube.v1.Admin/DescribeTopic": Rule((_P.LOOKUP, _P.MANAGE_TOPIC), _request_topic),
    "/danube.v1.Admin/UnloadTopic": Rule((_P.MANAGE_TOPIC,), _request_topic),
    "/danube.v1.Admin/DrainBroker": Rule((_P.MANAGE_BROKER,), _cluster),
    "/danube.v1.Admin/DeleteTopic": Rule((_P.MANAGE_TOPIC,), _request_topic),
    "/danube.v1.Admin/ResetCursor": Rule((_P.MANAGE_TOPIC,), _request_topic),
    "/danube.v1.Admin/AbandonUnavailableRange": Rule((_P.MANAGE_TOPIC,), _request_topic),
    "/danube.v1.Admin/SetTopicSchemaPolicy": Rule((_P.MANAGE_SCHEMA,), _request_topic),
    # subjects belong to no namespace: registering and changing them is cluster-wide
    "/danube.v1.SchemaRegistry/RegisterSchema": Rule((_P.MANAGE_SCHEMA,), _cluster),
    "/danube.v1.SchemaRegistry/SetCompatibilityMode": Rule((_P.MANAGE_SCHEMA,), _cluster),
    # consumers decode with the writer's schema
    "/danube.v1.SchemaRegistry/GetSchema": Rule((), _cluster),
    # followers copying a topic's log: brokers (the internal port), or an operator of the cluster
    "/danube.v1.Replication/FetchLog": Rule((_P.MANAGE_CLUSTER,), _cluster),
    "/danube.v1.Replication/OffsetForLeaderEpoch": Rule((_P.MANAGE_CLUSTER,), _cluster),
}

BATCH_RULES: dict[str, Rule] = {
    "/danube.v1.ProducerService/ProduceStream": Rule((_P.PRODUCE,), _producer_topic),
}
"""Streams whose messages carry batches of many producers: each batch is authorized on its own
(:data:`broker.rpc.produce_stream.BATCH_CHECK`), and a refusal fails that batch, not the stream."""
"""Every RPC of ``danube_pipeline/proto/danube.proto``: the permissions and the resource."""

ADMIN_CHANGES = frozenset({
    "/danube.v1.Admin/CreateTopic",
    "/danube.v1.Admin/SealActiveSegment",
    "/danube.v1.Admin/ApplyLocalRetention",
    "/danube.v1.Admin/UnloadTopic",
    "/danube.v1.Admin/DrainBroker",
    "/danube.v1.Admin/DeleteTopic",
    "/danube.v1.Admin/ResetCursor",
    "/danube.v1.Admin/AbandonUnavailableRange",
    "/danube.v1.Admin/SetTopicSchemaPolicy",
    "/danube.v1.SchemaRegistry/RegisterSchema",
    "/danube.v1.SchemaRegistry/SetCompatibilityMode",
})
"""RPCs that change the cluster: each gets an audit line with its outcome."""


# ------------------------------------------------------------------------------- callers


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller.

    Attributes:
        principal: its name.
        via: ``"token"``, ``"certificate"`` or ``"broker"`` (a peer broker's certificate).
        claims: the token's claims, for a token.
        cert_serial: the serial number (hexadecimal) of the verified certificate that named
            the caller (``via`` ``certificate`` or ``broker``).
    """

    principal: str
    via: str
    claims: TokenClaims | None = None
    cert_serial: str | None = None


def _certificate_identity(pem: bytes) -> tuple[str, str]:
    """``(principal, serial)``: the subject's common name, else the whole RFC 4514 subject,
    and the serial number in hexadecimal.

    Raises:
        ValueError: ``pem`` is not a PEM certificate.
    """
    certificate = x509.load_pem_x509_certificate(pem)
    subject = certificate.subject
    names = subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = names[0].value if names else None
    principal = value if isinstance(value, str) and value else subject.rfc4514_string()
    return principal, format(certificate.serial_number, "x")


class _AuditedContext:
    """A handler's context whose ``abort`` writes the audit line before the status reaches the client.

    grpc.aio sends the status inside ``abort``, so a line written once the exception comes back
    could appear after the caller has already seen the failure.
    """

    def __init__(self, context: Any, on_abort: Callable[[str], None]) -> None:
        self._context = context
        self._on_abort = on_abort
        self.aborted = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        if not self.aborted:
            self.aborted = True
            self._on_abort(code.name)
        await self._context.abort(code, details, trailing_metadata)
        raise AssertionError("grpc.aio's abort returned")  # it always raises


def audit(principal: str, rpc: str, resource: str, result: str, **extra: str) -> None:
    """Write one audit line (JSON) on the ``danube.audit`` logger."""
    line = {"principal": principal, "rpc": rpc, "resource": resource, "result": result, **extra}
    audit_log.info("%s", json.dumps(line, sort_keys=True, ensure_ascii=False))


class AuthInterceptor(aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates, authorizes and audits every call (see the module docstring).

    Args:
        broker: the broker core (its watched cache, producers and consumers).
        config: the security settings.
        brokers_only: for the broker-to-broker port (``internal_listen``), whose handshake
            requires a verified client certificate: admit only peers whose certificate carries
            this broker's own subject; anyone else (a token included) is ``UNAUTHENTICATED``.

    Raises:
        ValueError: a key or certificate file cannot be read or holds nothing usable.
    """

    def __init__(self, broker: Broker, config: BrokerConfig, *, brokers_only: bool = False) -> None:
        self._broker = broker
        self._config = config
        self._brokers_only = brokers_only
        self._verified_certs = config.tls_require_client_cert or brokers_only
        self._verifier: ReloadingTokenVerifier | None = None
        key_files = [f for f in (config.auth_jwt_secret_file, config.auth_jwt_public_key_file,
                                 config.auth_jwt_jwks_file) if f is not None]
        if key_files:
            self._verifier = ReloadingTokenVerifier(key_files, functools.partial(
                TokenVerifier.from_files,
                secret_file=config.auth_jwt_secret_file,
                public_key_file=config.auth_jwt_public_key_file,
                jwks_file=config.auth_jwt_jwks_file,
                issuer=config.auth_jwt_issuer,
                audience=config.auth_jwt_audience,
                leeway_s=config.auth_jwt_leeway_s,
            ))
        self._own_subject: str | None = None
        if self._verified_certs and config.tls_cert_file is not None:
            self._own_subject = _certificate_identity(config.tls_cert_file.read_bytes())[0]
        self._super_admins = frozenset(config.super_admins)
        self._cert_principals: collections.OrderedDict[bytes, tuple[str, str]] = collections.OrderedDict()
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    # ---- who

    def _peer_certificate(self, context: Any) -> tuple[str, str] | None:
        """The verified client certificate's ``(principal, serial)``, if the port verifies
        client certificates."""
        if not self._verified_certs:
            return None  # a certificate the port did not verify names nobody
        pems = (context.auth_context() or {}).get("x509_pem_cert") or []
        if not pems:
            return None
        pem = bytes(pems[0])
        identity = self._cert_principals.get(pem)
        if identity is None:
            try:
                identity = _certificate_identity(pem)
            except ValueError:
                return None
            self._cert_principals[pem] = identity
            if len(self._cert_principals) > 256:
                self._cert_principals.popitem(last=False)
        return identity

    def authenticate(self, context: Any) -> Caller:
        """The caller of ``context``.

        Raises:
            AuthenticationError: no credentials the broker accepts.
        """
        authorization = [
            v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
            for k, v in (context.invocation_metadata() or ())
            if k.lower() == "authorization"
        ]
        identity = self._peer_certificate(context)
        cert, serial = identity if identity is not None else (None, None)
        if cert is not None and cert == self._own_subject and not authorization:
            return Caller(cert, "broker", cert_serial=serial)
        if self._brokers_only:
            raise AuthenticationError("this port serves the cluster's brokers only (a certificate with the "
                                      "brokers' subject, without a token); clients use the main port")
        if authorization:
            if self._verifier is None:
                raise AuthenticationError("this broker takes no bearer tokens")
            claims = self._verifier.current().verify(bearer_token(authorization))
            return Caller(claims.principal, "token", claims)
        if self._config.auth_mtls and cert is not None:
            return Caller(cert, "certificate", cert_serial=serial)
        raise AuthenticationError("no credentials: send 'authorization: Bearer <token>'"
                                  + (" or a client certificate" if self._config.auth_mtls else ""))

    def still_authenticated(self, caller: Caller) -> None:
        """Raises: AuthenticationError: the caller's token expired meanwhile."""
        if caller.claims is not None and self._verifier is not None:
            self._verifier.current().verify_times(caller.claims)

    # ---- what

    def authorize(self, caller: Caller, method: str, request: Any) -> str:
        """Check ``caller`` may call ``method`` with ``request``.

        Returns:
            The resource, as text (for the audit line).

        Raises:
            PermissionDeniedError: a needed permission is not granted.
        """
        return self._authorize(caller, method, RULES.get(method), request)

    def _authorize(self, caller: Caller, method: str, rule: Rule | None, request: Any) -> str:
        """:meth:`authorize` under ``rule`` (``None``: the RPC has none)."""
        if isinstance(request, UndecodableRequest) or request is None:
            resource: Resource | None = None  # the handler refuses it before acting
        elif rule is None:
            resource = Scope.cluster()
        else:
            resource = rule.resource(self._broker, request)
        where = "-" if resource is None else str(resource)
        if not self._config.authorization or caller.via == "broker":
            return where
        if rule is None:
            raise PermissionDeniedError(caller.principal, "an RPC of no rule", method)
        if resource is None or not rule.permissions:
            return where
        read = self._broker.cache.get
        for permission in rule.permissions:
            if granted(caller.principal, permission, resource, read, super_admins=self._super_admins):
                return where
        raise PermissionDeniedError(caller.principal, rule.permissions[0].value, where)

    # ---- the interceptor

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        wrapped = self._handlers.get(method)
        if wrapped is None:
            wrapped = self._handlers[method] = self._wrap(method, handler)
        return wrapped

    async def _refuse(self, context: Any, method: str, principal: str, resource: str, exc: DanubeError) -> None:
        audit(principal, method, resource, "refused", reason=str(exc), peer=str(context.peer()))
        await abort_with(context, exc)

    async def _admit(self, context: Any, method: str, request: Any) -> tuple[Caller, str]:
        """Authenticate and authorize the call; abort it when refused."""
        counted = metrics.active().auth  # allow and deny at each call's admission
        try:
            caller = self.authenticate(context)
        except AuthenticationError as exc:
            counted.authenticated(False)
            await self._refuse(context, method, "-", "-", exc)
            raise
        counted.authenticated(True)
        try:
            where = self.authorize(caller, method, request)
        except PermissionDeniedError as exc:
            counted.authorized(False)
            await self._refuse(context, method, caller.principal, exc.resource, exc)
            raise
        if self._config.authorization:
            counted.authorized(True)
        return caller, where

    async def _recheck(self, context: Any, method: str, caller: Caller, request: Any) -> None:
        """For each message of a stream: the token is still valid and the permission still held."""
        try:
            self.still_authenticated(caller)
            self.authorize(caller, method, request)
        except (AuthenticationError, PermissionDeniedError) as exc:
            resource = exc.resource if isinstance(exc, PermissionDeniedError) else "-"
            await self._refuse(context, method, caller.principal, resource, exc)

    def _batch_check(self, context: Any, method: str, caller: Caller) -> ItemCheck | None:
        """The check of each batch of a :data:`BATCH_RULES` stream; ``None`` when nothing is
        checked (no authorization, or a broker calling)."""
        rule = BATCH_RULES.get(method)
        if rule is None or not self._config.authorization or caller.via == "broker":
            return None
        counted = metrics.active().auth

        def check(batch: Any) -> DanubeError | None:
            try:
                self._authorize(caller, method, rule, batch)
            except PermissionDeniedError as exc:
                counted.authorized(False)
                audit(caller.principal, method, exc.resource, "refused", reason=str(exc), peer=str(context.peer()))
                return exc
            return None

        return check

    def _audited(self, method: str, caller: Caller, resource: str, failure: str | None) -> None:
        """The audit line of an admin change (one of ``ADMIN_CHANGES``); ``failure`` is the
        status code's or the exception's name."""
        result = "ok" if failure is None else f"failed: {failure}"
        extra = {"cert_serial": caller.cert_serial} if self._brokers_only and caller.cert_serial else {}
        audit(caller.principal, method, resource, result, via=caller.via, **extra)

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` with the checks around its behaviour (same kind, same (de)serializers)."""
        options = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                caller, resource = await self._admit(context, method, request)
                if method not in ADMIN_CHANGES:  # nothing to audit: no wrapper on the produce path
                    return await inner_uu(request, context)
                audited = _AuditedContext(context, lambda code: self._audited(method, caller, resource, code))
                try:
                    response = await inner_uu(request, audited)
                except BaseException as exc:
                    if not audited.aborted:
                        self._audited(method, caller, resource, type(exc).__name__)
                    raise
                self._audited(method, caller, resource, None)
                return response

            return grpc.unary_unary_rpc_method_handler(unary_unary, **options)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                caller, _resource = await self._admit(context, method, request)
                items = inner_us(request, context)
                try:
                    async for item in items:
                        await self._recheck(context, method, caller, request)
                        yield item
                finally:
                    await items.aclose()

            return grpc.unary_stream_rpc_method_handler(unary_stream, **options)
        if handler.stream_stream is not None:
            inner_ss = handler.stream_stream

            async def stream_stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                caller, _resource = await self._admit(context, method, None)
                BATCH_CHECK.set(self._batch_check(context, method, caller))

                async def checked() -> AsyncIterator[Any]:
                    async for request in requests:
                        await self._recheck(context, method, caller, request)
                        yield request

                items = inner_ss(checked(), context)
                try:
                    async for item in items:
                        yield item
                finally:
                    await items.aclose()

            return grpc.stream_stream_rpc_method_handler(stream_stream, **options)
        raise ValueError(f"{method}: client-streaming RPCs are not served")  # none in danube.proto


def auth_interceptors(broker: Broker, *, brokers_only: bool = False) -> Sequence[aio.ServerInterceptor]:
    """The interceptors of the broker's gRPC server: none without authentication.

    Args:
        broker: the broker core.
        brokers_only: for the broker-to-broker port: admit only the cluster's brokers
            (:class:`AuthInterceptor`).

    Raises:
        ValueError: a key or certificate file cannot be read or holds nothing usable.
    """
    config = broker.config
    if brokers_only:
        return [AuthInterceptor(broker, config, brokers_only=True)]
    return [AuthInterceptor(broker, config)] if config.authentication else []
