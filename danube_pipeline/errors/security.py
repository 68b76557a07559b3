"""Errors of authentication and authorization: who the caller is, and what it may do.

Part of :mod:`danube_pipeline.errors`, which re-exports every name. Their messages never carry
a token, a key or a secret: only the reason, the principal, the permission and the resource."""

from __future__ import annotations

import grpc

from danube_pipeline.errors.base import DanubeError, bounded


class AuthenticationError(DanubeError):
    """The caller could not be authenticated: no credentials, or a token or certificate the
    broker does not accept (expired, not yet valid, wrong issuer or audience, bad signature,
    an algorithm the broker does not take).

    Args:
        reason: why, in words that name no secret (never the token itself).
    """

    grpc_code = grpc.StatusCode.UNAUTHENTICATED

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"not authenticated: {bounded(reason)}")


class PermissionDeniedError(DanubeError):
    """An authenticated principal lacks the permission an RPC needs on its resource
    (``docs/etcd-layout.md`` §7, roles and bindings).

    Args:
        principal: who called (a token's ``sub``, a certificate's subject).
        permission: the permission needed, e.g. ``"produce"``.
        resource: what on, e.g. ``"topic /default/orders"``, ``"namespace default"``,
            ``"cluster"``.
    """

    grpc_code = grpc.StatusCode.PERMISSION_DENIED

    def __init__(self, principal: str, permission: str, resource: str) -> None:
        self.principal = principal
        self.permission = permission
        self.resource = resource
        super().__init__(
            f"permission denied: {bounded(principal)!r} lacks {permission!r} on {bounded(resource)}"
        )
