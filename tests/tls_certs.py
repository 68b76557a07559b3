"""Test certificates made with ``cryptography``: a CA, and server or client certificates it signs.

Keys are ECDSA P-256 (fast to make). A certificate carries both ``serverAuth`` and
``clientAuth`` in its extended key usage, so a broker's certificate also serves as its client
certificate when it calls another broker.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_ONE_DAY = datetime.timedelta(days=1)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


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
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _ONE_DAY)
            .not_valid_after(now + 30 * _ONE_DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.cert_pem = self.cert.public_bytes(serialization.Encoding.PEM)
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
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name or name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _ONE_DAY)
            .not_valid_after(now + 30 * _ONE_DAY)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        pair = Pair(
            cert_pem=cert.public_bytes(serialization.Encoding.PEM),
            key_pem=_key_pem(key),
            cert_file=self.directory / f"{name}.pem",
            key_file=self.directory / f"{name}.key",
        )
        if write:
            pair.cert_file.write_bytes(pair.cert_pem)
            pair.key_file.write_bytes(pair.key_pem)
        return pair
