"""TLS for the broker's gRPC port and for its calls to other brokers.

:func:`server_credentials` builds the port's credentials with grpc's dynamic certificate
configuration (``grpc.dynamic_ssl_server_credentials``): before every new handshake grpc asks
:class:`ReloadingCertificates` for the current configuration, which looks at the certificate,
key and CA files (size, modification time, inode) and reads them again when one changed. A
rotated certificate is therefore served to new connections without a restart; connections
already open keep the certificate they were set up with. A new pair that does not load (a
half-written file, a key that does not match the certificate) is logged and ignored: the
previous configuration stays in use until the files are consistent again.

grpc's TLS stack negotiates TLS 1.2 or 1.3 only (its default minimum version is TLS 1.2).

:func:`broker_channel` opens the channel one broker uses to call another (forwarding a topic
deletion, a dead-letter batch, an unload): plaintext when the broker serves plaintext, else
mutual TLS with the broker's own certificate as client certificate and ``tls_ca_file`` as the
roots that verify the peer, so a broker's identity comes only from its verified certificate.
grpc's Python API can only require a client certificate or not ask for one
(``require_client_authentication``): a broker presents its certificate, but the peer sees it
only on a port that requires one: its main port under ``tls_require_client_cert``, or its
broker-to-broker port (``internal_listen``, :func:`internal_server_credentials`), which always
does. Brokers call each other there when the peer registered one (``internal_addr``,
``docs/etcd-layout.md`` §1.2).

:class:`BrokerChannels` keeps long-lived broker-to-broker channels (the rebalancer's unloads)
and opens them again, closing the old ones, when the broker's certificate, key or CA file
changes, so a rotated certificate reaches outgoing calls without a restart.

:func:`etcd_security` turns the broker's ``etcd_*`` settings into the etcd connection's
:class:`~danube_pipeline.metadata.connection.EtcdSecurity`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from danube_pipeline.metadata.connection import EtcdSecurity, read_password

from broker.config import BrokerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _FileStamp:
    """What identifies one version of a file without reading it."""

    size: int
    mtime_ns: int
    inode: int


def _stamp(path: Path) -> _FileStamp:
    """The stamp of ``path``.

    Raises:
        OSError: the file cannot be stat'ed.
    """
    st = os.stat(path)
    return _FileStamp(st.st_size, st.st_mtime_ns, st.st_ino)


def check_key_pair(cert_pem: bytes, key_pem: bytes) -> None:
    """Check that ``key_pem`` is the private key of the first certificate in ``cert_pem``.

    Args:
        cert_pem: a PEM certificate chain, the leaf first.
        key_pem: a PEM private key (unencrypted).

    Raises:
        ValueError: either does not parse (an encrypted key included), or the key does not
            match the certificate.
    """
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        certificate = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (TypeError, UnsupportedAlgorithm) as exc:  # TypeError: an encrypted key
        raise ValueError(f"the certificate or key cannot be used: {exc}") from exc
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    if certificate.public_key().public_bytes(encoding, public) != key.public_key().public_bytes(encoding, public):
        raise ValueError("the private key does not match the certificate")


class ReloadingCertificates:
    """The broker's server certificate configuration, read again from its files when they change.

    Args:
        cert_file: PEM certificate chain served, the leaf first.
        key_file: its PEM private key.
        ca_file: PEM CA bundle verifying client certificates, or ``None``.

    Attributes:
        initial: the configuration read at construction (grpc's initial configuration).
        reloads: how many times a changed set of files was loaded after the first (for tests
            and diagnostics).

    Raises:
        OSError: at construction, a file cannot be read.
        ValueError: at construction, the key does not match the certificate, or either does
            not parse.
    """

    def __init__(self, cert_file: Path, key_file: Path, ca_file: Path | None) -> None:
        self._paths = (cert_file, key_file, ca_file)
        self._lock = threading.Lock()  # grpc calls the fetcher from its own threads
        self.reloads = 0
        self._stamps = self._current_stamps()
        self._refused: tuple[_FileStamp | None, ...] | None = None
        self.initial = self._load()

    def _current_stamps(self) -> tuple[_FileStamp | None, ...]:
        return tuple(None if path is None else _stamp(path) for path in self._paths)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert_file, key_file, ca_file = self._paths
        cert_pem = cert_file.read_bytes()
        key_pem = key_file.read_bytes()
        check_key_pair(cert_pem, key_pem)
        roots = ca_file.read_bytes() if ca_file is not None else None
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)], root_certificates=roots)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's certificate configuration fetcher: the configuration read from the files if
        they changed since the last load, else ``None`` (keep the current one).

        Never raises: files that cannot be read or do not match are logged once per version
        (without their content) and the current configuration is kept.
        """
        with self._lock:
            try:
                stamps = self._current_stamps()
            except OSError:
                return None  # a file is being replaced: the next handshake looks again
            if stamps in (self._stamps, self._refused):
                return None
            try:
                config = self._load()
            except (OSError, ValueError) as exc:
                log.warning("TLS certificate files changed but cannot be loaded, keeping the current ones: %s", exc)
                self._refused = stamps
                return None
            self._stamps = stamps
            self.reloads += 1
        log.info("TLS certificate reloaded from %s", self._paths[0])
        return config


def server_credentials(
    config: BrokerConfig, *, require_client_cert: bool | None = None
) -> tuple[grpc.ServerCredentials, ReloadingCertificates]:
    """The gRPC port's TLS credentials, reloading the certificate files on change.

    Args:
        config: a broker configuration with ``tls`` on (``tls_cert_file`` and
            ``tls_key_file`` set; ``tls_ca_file`` for client certificates).
        require_client_cert: require and verify client certificates; ``None`` follows
            ``config.tls_require_client_cert``.

    Returns:
        The credentials for ``add_secure_port`` and the reloader behind them.

    Raises:
        ValueError: ``tls_key_file`` is missing, client certificates required without
            ``tls_ca_file``, or the key does not match the certificate.
        OSError: a file cannot be read.
    """
    if config.tls_cert_file is None or config.tls_key_file is None:
        raise ValueError("TLS needs both tls_cert_file and tls_key_file")
    require = config.tls_require_client_cert if require_client_cert is None else require_client_cert
    if require and config.tls_ca_file is None:
        raise ValueError("client certificates need tls_ca_file (the CA that signs them)")
    certificates = ReloadingCertificates(config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
    credentials = grpc.dynamic_ssl_server_credentials(
        certificates.initial, certificates.fetch, require_client_authentication=require
    )
    return credentials, certificates


def internal_server_credentials(config: BrokerConfig) -> tuple[grpc.ServerCredentials, ReloadingCertificates]:
    """The credentials of the broker-to-broker port (``internal_listen``): the broker's own
    certificate, reloaded on change, and client certificates always required and verified
    against ``tls_ca_file``. A client without a certificate of that CA fails the handshake.

    Raises:
        ValueError: TLS files or ``tls_ca_file`` missing, or the key does not match the
            certificate.
        OSError: a file cannot be read.
    """
    return server_credentials(config, require_client_cert=True)


def broker_channel_credentials(config: BrokerConfig) -> grpc.ChannelCredentials | None:
    """The credentials of a broker-to-broker channel, ``None`` for plaintext (TLS off).

    The files are read at every call, so a channel opened after a rotation presents the new
    certificate.

    Raises:
        OSError: a file cannot be read.
    """
    return _files_credentials(broker_tls_files(config))


def _files_credentials(tls_files: tuple[Path | None, Path, Path] | None) -> grpc.ChannelCredentials | None:
    """Mutual-TLS channel credentials read now from ``(ca_file, cert_file, key_file)``;
    ``None`` (plaintext) for ``None``.

    Raises:
        OSError: a file cannot be read.
    """
    if tls_files is None:
        return None
    ca_file, cert_file, key_file = tls_files
    return grpc.ssl_channel_credentials(
        root_certificates=ca_file.read_bytes() if ca_file is not None else None,
        private_key=key_file.read_bytes(),
        certificate_chain=cert_file.read_bytes(),
    )


class BrokerChannels:
    """Long-lived channels from this broker to other brokers, one per address, opened again
    when the certificate, key or CA file changes (size, modification time, inode, as
    :class:`ReloadingCertificates` looks at them): the channels opened with the old files are
    closed and the next call opens a new one that presents the new certificate.

    Args:
        tls_files: ``(ca_file, cert_file, key_file)`` for mutual TLS with the broker's own
            certificate (:func:`broker_tls_files`); ``None`` opens plaintext channels.
        options: gRPC channel options (``grpc.max_receive_message_length`` for fetches).

    Attributes:
        reopened: how many times a change of the files closed the open channels (for tests
            and diagnostics).
    """

    def __init__(
        self, tls_files: tuple[Path | None, Path, Path] | None, *, options: Sequence[tuple[str, int]] = ()
    ) -> None:
        self._tls_files = tls_files
        self._options = list(options)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stamps: tuple[_FileStamp | None, ...] | None = None
        self.reopened = 0

    def _current_stamps(self) -> tuple[_FileStamp | None, ...] | None:
        """The files' stamps; ``None`` while one cannot be stat'ed (being replaced)."""
        if self._tls_files is None:
            return ()
        try:
            return tuple(None if path is None else _stamp(path) for path in self._tls_files)
        except OSError:
            return None

    async def channel(self, address: str) -> grpc.aio.Channel:
        """The channel to the broker at ``address`` (``host:port``), opened again if the TLS
        files changed since the open channels were made.

        Raises:
            OSError: a TLS file cannot be read.
        """
        stamps = self._current_stamps()
        if stamps is not None and stamps != self._stamps:
            if self._channels:
                self.reopened += 1
                log.info("broker certificate files changed: reopening %d broker-to-broker channels",
                         len(self._channels))
            await self.close()
            self._stamps = stamps
        channel = self._channels.get(address)
        if channel is None:
            credentials = _files_credentials(self._tls_files)
            if credentials is None:
                channel = grpc.aio.insecure_channel(address, options=self._options)
            else:
                channel = grpc.aio.secure_channel(address, credentials, options=self._options)
            self._channels[address] = channel
        return channel

    async def discard(self, address: str) -> None:
        """Close the channel to ``address`` (after it failed); the next call opens a new one."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        """Close every channel (idempotent)."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


def broker_tls_files(config: BrokerConfig) -> tuple[Path | None, Path, Path] | None:
    """``(tls_ca_file, tls_cert_file, tls_key_file)`` for a client this broker opens to other
    brokers (mutual TLS with its own certificate), ``None`` when TLS is off."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    return config.tls_ca_file, config.tls_cert_file, config.tls_key_file


def etcd_security(config: BrokerConfig) -> EtcdSecurity | None:
    """The etcd connection's security from the broker's ``etcd_*`` settings; ``None`` when
    none is set (then the ``DANUBE_ETCD_*`` variables apply, :meth:`EtcdSecurity.from_env`).

    The password comes from ``etcd_password_file``, else ``DANUBE_ETCD_PASSWORD``.

    Raises:
        OSError: the password file cannot be read.
        ValueError: a user without a password, or a client certificate without its key.
    """
    if not any(
        (config.etcd_tls_ca_file, config.etcd_tls_cert_file, config.etcd_tls_key_file, config.etcd_user)
    ):
        return None
    password = read_password(config.etcd_password_file) if config.etcd_user else None
    if config.etcd_user and password is None:
        raise ValueError("etcd_user needs etcd_password_file or DANUBE_ETCD_PASSWORD")
    return EtcdSecurity(
        ca_file=config.etcd_tls_ca_file,
        cert_file=config.etcd_tls_cert_file,
        key_file=config.etcd_tls_key_file,
        user=config.etcd_user,
        password=password,
    )


def broker_channel(config: BrokerConfig, address: str) -> grpc.aio.Channel:
    """A channel from this broker to the broker at ``address`` (``host:port``, its advertised
    address, which its certificate must name): plaintext when TLS is off, else mutual TLS.

    Raises:
        OSError: a certificate file cannot be read.
    """
    credentials = broker_channel_credentials(config)
    if credentials is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, credentials)


__all__ = [
    "BrokerChannels",
    "ReloadingCertificates",
    "broker_channel",
    "broker_channel_credentials",
    "broker_tls_files",
    "check_key_pair",
    "etcd_security",
    "internal_server_credentials",
    "server_credentials",
]
