"""The broker's configuration file (``python -m broker --config danube_broker.yml``), the layering
of its sources, and the check that keeps a broker off the network without TLS and authentication.

The file is YAML. Its keys are the field names of :class:`~broker.config.BrokerConfig`, plus
``log_level``, ``log_format``, ``s3_endpoint_url`` and ``s3_region`` (the command-line options that are not
fields). Three optional sections group the security settings; a key ``k`` inside section ``s``
is the field ``s_k``::

    listen: 0.0.0.0:6650
    tls:  {cert_file: broker.pem, key_file: broker.key, ca_file: ca.pem}   # tls_cert_file, ...
    auth: {jwt_public_key_file: jwt.pub, jwt_issuer: danube}               # auth_jwt_..., auth_mtls
    etcd: {endpoints: [etcd-1:2379], user: broker, password_file: etcd.pw} # etcd_endpoints, ...

Relative paths in the file are relative to the file's directory. A key set to ``null`` takes
its default (so ``data_dir: null`` means ``$DANUBE_HOME/broker``). An unknown key, a key given
twice, or a value of the wrong type is a :class:`ConfigFileError` naming the file and the key.
``docs/danube_broker.example.yml`` lists every key.

Precedence, highest first: command-line flags, the ``DANUBE_*`` variables the broker reads
(``DANUBE_ETCD_ENDPOINTS``, ``DANUBE_OBJECT_STORE_URL``), the file, the defaults.
``DANUBE_HOME`` only moves the defaults (``data_dir`` is ``$DANUBE_HOME/broker``); it does not
override a ``data_dir`` the file gives.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from danube_pipeline import settings
from danube_pipeline.errors import DanubeError

from broker.config import BrokerConfig

#: Keys of the file that are not :class:`BrokerConfig` fields, with their type.
EXTRA_KEYS: dict[str, type] = {"log_level": str, "log_format": str, "s3_endpoint_url": str, "s3_region": str}
#: Sections of the file: ``{section: {k: v}}`` stands for the field ``section_k``.
SECTIONS = ("tls", "auth", "etcd")
#: ``str`` fields that also take a YAML number (``rebalance_threshold: 0.25``).
_NUMBER_AS_STRING = frozenset({"rebalance_threshold"})
#: Words that make a setting's value a secret in ``--print-config`` (``*_file`` paths are not).
SECRET_WORDS = ("password", "secret", "token")
#: Words that make an ``object_store_options`` entry a credential (fsspec/s3fs ``key``,
#: ``secret``, ``token``; botocore ``aws_secret_access_key``, ``aws_session_token``).
_CREDENTIAL_WORDS = ("key", "secret", "token", "password", "credential")
MASK = "***"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class ConfigFileError(DanubeError, ValueError):
    """The broker's configuration file cannot be used. Raised at start-up only; never sent
    over the wire. The message never quotes a value (a value may be a secret).

    Args:
        path: the configuration file.
        key: the offending key (dotted inside a section, e.g. ``tls.cert_file``), ``None``
            when the file as a whole is at fault.
        reason: what is wrong.
    """

    def __init__(self, path: str, key: str | None, reason: str) -> None:
        self.path = path
        self.key = key
        self.reason = reason
        where = f"{path}: key {key!r}" if key is not None else path
        super().__init__(f"configuration file {where}: {reason}")


def field_types() -> dict[str, Any]:
    """Every key a configuration file may hold (before sections), mapped to its type hint."""
    hints = typing.get_type_hints(BrokerConfig)
    types_by_key: dict[str, Any] = {f.name: hints[f.name] for f in dataclasses.fields(BrokerConfig)}
    types_by_key.update(EXTRA_KEYS)
    return types_by_key


def load_config_file(path: Path) -> dict[str, Any]:
    """Read and check a configuration file.

    Args:
        path: the YAML file.

    Returns:
        The settings it gives, by field name (sections flattened, ``tls.cert_file`` as
        ``tls_cert_file``), each converted to its field's type; relative paths made absolute
        against the file's directory; keys set to ``null`` left out.

    Raises:
        ConfigFileError: the file cannot be read or parsed, is not a mapping, or has an
            unknown key, a key given twice, or a value of the wrong type.
    """
    shown = str(path)
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML comes with the broker extra
        raise ConfigFileError(shown, None, "reading it needs PyYAML (pip install pyyaml)") from None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(shown, None, f"cannot be read ({type(exc).__name__})") from None
    try:
        raw = yaml.load(text, Loader=_unique_key_loader(yaml, shown))  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigFileError(shown, None, f"is not valid YAML{where}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigFileError(shown, None, "must be a mapping of setting names to values")
    flat: dict[str, tuple[str, Any]] = {}  # field -> (key as written, value)
    for key, value in raw.items():
        if key in SECTIONS and (value is None or isinstance(value, dict)):
            for sub, sub_value in (value or {}).items():
                _put(flat, f"{key}_{sub}", f"{key}.{sub}", sub_value, shown)
        else:
            _put(flat, str(key), str(key), value, shown)
    known = field_types()
    base_dir = path.resolve().parent
    values: dict[str, Any] = {}
    for name, (written, value) in flat.items():
        if name not in known:
            raise ConfigFileError(shown, written, "unknown setting (see docs/danube_broker.example.yml)")
        if value is None:
            continue  # null: the default (``None`` for every optional setting)
        values[name] = _coerce(value, known[name], name=name, written=written, path=shown, base_dir=base_dir)
    return values


def _put(flat: dict[str, tuple[str, Any]], name: str, written: str, value: Any, path: str) -> None:
    if name in flat:
        raise ConfigFileError(path, written, f"given twice (also as {flat[name][0]!r})")
    flat[name] = (written, value)


def _unique_key_loader(yaml: Any, path: str) -> Any:
    """A ``yaml.SafeLoader`` subclass that refuses a key repeated within one mapping."""

    class UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise ConfigFileError(path, str(key), "given twice")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _coerce(value: Any, hint: Any, *, name: str, written: str, path: str, base_dir: Path) -> Any:
    """``value`` converted to ``hint`` (the field's type), or a :class:`ConfigFileError`."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (hint,) = (a for a in args if a is not type(None))

    def wrong(expected: str) -> ConfigFileError:
        return ConfigFileError(path, written, f"expected {expected}, got {_yaml_type(value)}")

    origin = typing.get_origin(hint)
    if hint is bool:
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong("a number")
        return float(value)
    if hint is str:
        if name in _NUMBER_AS_STRING and isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    if hint is Path:
        if not isinstance(value, str) or not value:
            raise wrong("a file path (a string)")
        p = Path(value).expanduser()
        return p if p.is_absolute() else (base_dir / p).resolve()
    if origin in (list, tuple):
        if isinstance(value, str) and origin is list:  # "h:p,h:p", like the flag
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise wrong("a list of strings")
        return list(value) if origin is list else tuple(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise wrong("a mapping with string keys")
        return dict(value)
    raise wrong(str(hint))  # pragma: no cover - a BrokerConfig field of a type not handled here


def _yaml_type(value: Any) -> str:
    """The YAML name of ``value``'s type (never the value: it may be a secret)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def environment_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings the ``DANUBE_*`` variables give (only those set).

    Args:
        environ: the environment (default ``os.environ``).

    Returns:
        ``etcd_endpoints`` from ``DANUBE_ETCD_ENDPOINTS`` and ``object_store_url`` from
        ``DANUBE_OBJECT_STORE_URL``, each only when the variable is set and not empty.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    endpoints = [e.strip() for e in env.get("DANUBE_ETCD_ENDPOINTS", "").split(",") if e.strip()]
    if endpoints:
        values["etcd_endpoints"] = endpoints
    if env.get("DANUBE_OBJECT_STORE_URL"):
        values["object_store_url"] = env["DANUBE_OBJECT_STORE_URL"]
    return values


def layer(*sources: Mapping[str, Any]) -> dict[str, Any]:
    """Merge settings, later sources winning (``layer(file, env, flags)``).

    ``s3_endpoint_url`` and ``s3_region`` (from any source) are folded into
    ``object_store_options`` (``endpoint_url``, ``client_kwargs.region_name``), over the
    ``object_store_options`` of the file.

    Returns:
        Keyword arguments for :func:`build_config` (``log_level`` included).
    """
    merged: dict[str, Any] = {}
    for source in sources:
        merged.update(source)
    options = dict(merged.pop("object_store_options", None) or {})
    endpoint_url = merged.pop("s3_endpoint_url", None)
    region = merged.pop("s3_region", None)
    if endpoint_url:
        options["endpoint_url"] = endpoint_url
    if region:
        options["client_kwargs"] = {**dict(options.get("client_kwargs") or {}), "region_name": region}
    if options:
        merged["object_store_options"] = options
    return merged


def build_config(values: Mapping[str, Any]) -> BrokerConfig:
    """A :class:`BrokerConfig` from layered settings; absent ones take their defaults
    (``data_dir``: ``$DANUBE_HOME/broker``). ``log_level`` is ignored.

    Raises:
        ValueError: a setting :class:`BrokerConfig` refuses (``InvalidNameError`` included).
    """
    kwargs = {k: v for k, v in values.items() if k not in EXTRA_KEYS}
    kwargs["data_dir"] = Path(kwargs.get("data_dir") or settings.danube_home() / "broker").resolve()
    return BrokerConfig(**kwargs)


def effective_settings(config: BrokerConfig, *, log_level: str) -> dict[str, Any]:
    """Every setting of ``config`` as plain YAML values, secrets masked: the output of
    ``--print-config``, itself a valid configuration file.

    A setting whose name contains ``password``, ``secret`` or ``token`` is masked unless it
    is a file path (``*_file``); so is every credential in ``object_store_options`` (a key
    containing ``key``, ``secret``, ``token``, ``password`` or ``credential``), and the
    password of any URL in it.
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = _plain(getattr(config, f.name))
        if f.name == "object_store_options":
            value = _mask_credentials(value)
        elif value is not None and not f.name.endswith("_file") and any(w in f.name for w in SECRET_WORDS):
            value = MASK
        out[f.name] = value
    out["log_level"] = log_level
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _mask_credentials(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: MASK if value[k] is not None and any(w in k.lower() for w in _CREDENTIAL_WORDS)
            else _mask_credentials(value[k])
            for k in value
        }
    if isinstance(value, list):
        return [_mask_credentials(v) for v in value]
    if isinstance(value, str):
        return settings.redact_url(value)
    return value


def dump_settings(values: Mapping[str, Any]) -> str:
    """``values`` as a YAML document, in the given order."""
    import yaml

    return str(yaml.safe_dump(dict(values), sort_keys=False, default_flow_style=False))


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a listen address's host, brackets allowed) reaches this machine only:
    127.0.0.0/8, ``::1`` or ``localhost``. A wildcard (``0.0.0.0``, ``::``, empty) is not."""
    host = host.strip().strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to any interface


def listen_exposure(config: BrokerConfig) -> str | None:
    """What a client on the network would face on ``config.listen``, when it is unsafe.

    Returns:
        ``None`` for a loopback listen address, or one with TLS and authentication both on;
        otherwise ``"plaintext and unauthenticated"``, ``"plaintext"`` or
        ``"unauthenticated"``.
    """
    host, _, _ = config.listen.rpartition(":")
    if is_loopback_host(host):
        return None
    missing = [what for what, on in (("plaintext", config.tls), ("unauthenticated", config.authentication)) if not on]
    return " and ".join(missing) or None


def metrics_exposure(config: BrokerConfig) -> str | None:
    """What the network would see on ``config.metrics_listen``, when it is unsafe: the metrics
    endpoint is plain HTTP without authentication, and its labels name every topic and
    subscription served here.

    Returns:
        ``None`` without a metrics endpoint or on a loopback address; otherwise
        ``"plaintext and unauthenticated"`` (even when the gRPC port has TLS and authentication).
    """
    if config.metrics_listen is None:
        return None
    host, _, _ = config.metrics_listen.rpartition(":")
    return None if is_loopback_host(host) else "plaintext and unauthenticated"
