"""Permissions, roles and bindings (``docs/etcd-layout.md`` §7), and the one decision that
reads them.

A role is a named set of permissions (``/security/roles/{role}``). A binding attaches roles to a
principal at one scope: the cluster, a namespace or a topic
(``/security/bindings/{principal}/{scope}``). A principal holds a permission on a topic when a
role bound to it at the cluster, at the topic's namespace or at the topic (a partition counts as
its partitioned topic) grants it; on a namespace, at the cluster or that namespace; on the
cluster, at the cluster only. Everything not granted is denied.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from danube_pipeline.metadata import keys
from danube_pipeline.metadata.values import JsonValue
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.partitions import split_partition_name

__all__ = [
    "Binding",
    "Permission",
    "Resource",
    "Role",
    "Scope",
    "granted",
    "scopes_of",
]


class Permission(enum.StrEnum):
    """What a role may grant (Danube's set)."""

    LOOKUP = "lookup"
    PRODUCE = "produce"
    CONSUME = "consume"
    MANAGE_NAMESPACE = "manage_namespace"
    MANAGE_TOPIC = "manage_topic"
    MANAGE_SCHEMA = "manage_schema"
    MANAGE_BROKER = "manage_broker"
    MANAGE_CLUSTER = "manage_cluster"


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a binding applies: the cluster (both ``None``), a namespace, or a topic.

    Attributes:
        namespace: the namespace, for a namespace or topic scope.
        topic: the topic (without its namespace), for a topic scope.
    """

    namespace: str | None = None
    topic: str | None = None

    @classmethod
    def cluster(cls) -> Scope:
        return cls()

    @classmethod
    def of_namespace(cls, namespace: str) -> Scope:
        """Raises: InvalidNameError: a malformed namespace."""
        return cls(validate_part("namespace", namespace))

    @classmethod
    def of_topic(cls, topic: TopicName) -> Scope:
        return cls(topic.namespace, topic.topic)

    @classmethod
    def parse(cls, text: str) -> Scope:
        """``cluster``, ``namespaces/{ns}`` or ``topics/{ns}/{topic}`` (the key's tail, §7.2).

        Raises:
            ValueError: none of these forms (``InvalidNameError`` for a malformed name).
        """
        parts = text.strip("/").split("/")
        if parts == ["cluster"]:
            return cls()
        if len(parts) == 2 and parts[0] == "namespaces":
            return cls.of_namespace(parts[1])
        if len(parts) == 3 and parts[0] == "topics":
            return cls.of_topic(TopicName(validate_part("namespace", parts[1]), validate_part("topic", parts[2])))
        raise ValueError(f"a scope is 'cluster', 'namespaces/{{ns}}' or 'topics/{{ns}}/{{topic}}', got {text!r}")

    @property
    def key_tail(self) -> str:
        """The scope as the last part of a binding key."""
        if self.namespace is None:
            return "cluster"
        if self.topic is None:
            return f"namespaces/{self.namespace}"
        return f"topics/{self.namespace}/{self.topic}"

    def __str__(self) -> str:
        if self.namespace is None:
            return "cluster"
        if self.topic is None:
            return f"namespace {self.namespace}"
        return f"topic /{self.namespace}/{self.topic}"


Resource = Scope
"""What an RPC acts on has the same three shapes as a binding's scope."""


def scopes_of(resource: Resource) -> list[Scope]:
    """The binding scopes that cover ``resource``: the cluster, its namespace, the topic itself
    and, for a partition, its partitioned topic."""
    if resource.namespace is None:
        return [Scope()]
    scopes = [Scope(), Scope(resource.namespace)]
    if resource.topic is not None:
        scopes.append(resource)
        parent = split_partition_name(TopicName(resource.namespace, resource.topic))
        if parent is not None:
            scopes.append(Scope.of_topic(parent[0]))
    return scopes


def _strings(value: JsonValue, field: str) -> list[str]:
    if not isinstance(value, dict):
        return []
    items = value.get(field)
    return [x for x in items if isinstance(x, str)] if isinstance(items, list) else []


@dataclass(frozen=True, slots=True)
class Role:
    """``/security/roles/{name}``: ``{"permissions": ["produce", "consume"]}`` (§7.1).

    Unknown permission names in a stored role are ignored (they grant nothing).
    """

    name: str
    permissions: frozenset[Permission]

    def to_json(self) -> dict[str, list[str]]:
        return {"permissions": sorted(p.value for p in self.permissions)}

    @classmethod
    def from_json(cls, name: str, value: JsonValue) -> Role:
        known = {p.value for p in Permission}
        return cls(name, frozenset(Permission(p) for p in _strings(value, "permissions") if p in known))


@dataclass(frozen=True, slots=True)
class Binding:
    """``/security/bindings/{principal}/{scope}``: ``{"roles": ["producer"]}`` (§7.2)."""

    principal: str
    scope: Scope
    roles: tuple[str, ...]

    def to_json(self) -> dict[str, list[str]]:
        return {"roles": sorted(set(self.roles))}

    @classmethod
    def from_json(cls, principal: str, scope: Scope, value: JsonValue) -> Binding:
        return cls(principal, scope, tuple(_strings(value, "roles")))


def granted(
    principal: str,
    permission: Permission,
    resource: Resource,
    read: Callable[[str], JsonValue | None],
    *,
    super_admins: Iterable[str] = (),
) -> bool:
    """Whether ``principal`` holds ``permission`` on ``resource``.

    Args:
        principal: who asks.
        permission: what it needs.
        resource: what on.
        read: reads one etcd key (the broker's watched cache: ``LocalCache.get``).
        super_admins: principals granted everything.

    Returns:
        ``True`` when a super-admin, or a role bound at a scope covering ``resource`` grants it.
    """
    if principal in super_admins:
        return True
    for scope in scopes_of(resource):
        binding = read(keys.security_binding(principal, scope.key_tail))
        for role in _strings(binding, "roles"):
            if permission.value in _strings(read(keys.security_role(role)), "permissions"):
                return True
    return False
