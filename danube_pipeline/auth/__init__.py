"""Authentication and authorization shared by the broker and the tools: JWT bearer tokens
(:mod:`.tokens`), and permissions, roles and bindings (:mod:`.permissions`,
``docs/etcd-layout.md`` §7)."""

from danube_pipeline.auth.permissions import Binding, Permission, Resource, Role, Scope, granted, scopes_of
from danube_pipeline.auth.tokens import ReloadingTokenVerifier, TokenClaims, TokenVerifier, bearer_token, mint_token

__all__ = [
    "Binding",
    "Permission",
    "ReloadingTokenVerifier",
    "Resource",
    "Role",
    "Scope",
    "TokenClaims",
    "TokenVerifier",
    "bearer_token",
    "granted",
    "mint_token",
    "scopes_of",
]
