"""Test certificates: a CA written to a directory, and certificates it signs, written beside it.

A thin wrapper over :mod:`danube_pipeline.dev.certificates` (the maker ``danube-pipeline dev
--secure`` uses) that writes the files tests hand to brokers and clients. A certificate
carries both ``serverAuth`` and ``clientAuth``, so a broker's certificate also serves as its
client certificate when it calls another broker.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from danube_pipeline.dev.certificates import CertificateAuthority, cert_pem, key_pem

VALIDITY = datetime.timedelta(days=30)


@dataclass(frozen=True)
class Pair:
    """A certificate and its key, as PEM, and where they were written."""

    cert_pem: bytes
    key_pem: bytes
    cert_file: Path
    key_file: Path

    @property
    def serial(self) -> int:
        """The certificate's serial number."""
        return x509.load_pem_x509_certificate(self.cert_pem).serial_number


class CertAuthority:
    """A self-signed CA written to ``directory / f"{name}.pem"``.

    Args:
        directory: where the CA and every certificate it issues are written.
        name: the CA's common name and file stem.
    """

    def __init__(self, directory: Path, name: str = "test-ca") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.authority = CertificateAuthority.create(name, validity=VALIDITY)
        self.cert_pem = cert_pem(self.authority.cert)
        self.cert_file = directory / f"{name}.pem"
        self.cert_file.write_bytes(self.cert_pem)

    def issue(
        self,
        name: str,
        *,
        common_name: str | None = None,
        hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
        write: bool = True,
    ) -> Pair:
        """A certificate for ``hosts`` (IP addresses and DNS names as subject alternative
        names), usable as a server and a client certificate.

        Args:
            name: file stem: ``{name}.pem`` and ``{name}.key`` in the CA's directory.
            common_name: the subject's common name (default ``name``).
            hosts: subject alternative names.
            write: write the files (``False``: only compute where they would go).
        """
        cert, key = self.authority.issue(common_name or name, hosts=hosts, server=True, validity=VALIDITY)
        pair = Pair(
            cert_pem=cert_pem(cert),
            key_pem=key_pem(key),
            cert_file=self.directory / f"{name}.pem",
            key_file=self.directory / f"{name}.key",
        )
        if write:
            pair.cert_file.write_bytes(pair.cert_pem)
            pair.key_file.write_bytes(pair.key_pem)
        return pair
