"""Certificates for development and tests: a self-signed CA and the certificates it signs.

Keys are ECDSA P-256 (fast to make), signatures SHA-256, made with ``cryptography``. One
maker for every caller: ``danube-pipeline dev --secure`` (:mod:`danube_pipeline.dev.secure`),
the tests and the benchmarks.

Example::

    ca = CertificateAuthority.create("danube-dev-ca", validity=datetime.timedelta(days=3650))
    cert, key = ca.issue("danube-broker", hosts=["127.0.0.1", "localhost"], server=True,
                         validity=datetime.timedelta(days=365))
    path.write_bytes(cert_pem(cert))
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["BACKDATE", "CertificateAuthority", "cert_pem", "key_pem", "subject_alt_names"]

BACKDATE = datetime.timedelta(minutes=5)
"""How far before ``now`` a certificate becomes valid (clocks of one machine's processes agree,
but a certificate made this second must already verify)."""


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    """``cert`` as PEM."""
    return cert.public_bytes(serialization.Encoding.PEM)


def subject_alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """Subject alternative names for ``hosts``: an IP address entry for each address, a DNS
    name for anything else; duplicates dropped, order kept."""
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _now(now: datetime.datetime | None) -> datetime.datetime:
    return now if now is not None else datetime.datetime.now(datetime.timezone.utc)


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    """A self-signed CA and its private key, in memory.

    Attributes:
        cert: the CA certificate (``BasicConstraints(ca=True, path_length=0)``: it signs leaf
            certificates only).
        key: its private key.
    """

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(
        cls, common_name: str, *, validity: datetime.timedelta, now: datetime.datetime | None = None
    ) -> CertificateAuthority:
        """A new CA named ``common_name``, valid from :data:`BACKDATE` before ``now`` (default:
        the current time, UTC) until ``now + validity``."""
        start = _now(now)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start - BACKDATE)
            .not_valid_after(start + validity)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    def issue(
        self,
        common_name: str,
        *,
        hosts: Sequence[str] = (),
        server: bool,
        validity: datetime.timedelta,
        now: datetime.datetime | None = None,
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        """A certificate for ``common_name`` signed by this CA, and its new private key.

        Args:
            common_name: the subject's common name (a client certificate's principal).
            hosts: subject alternative names (:func:`subject_alt_names`); none when empty.
            server: ``serverAuth`` and ``clientAuth`` in the extended key usage (a server that
                also calls its peers with it); ``False``: ``clientAuth`` only.
            validity: how long it is valid after ``now``.
            now: the issue time (default: the current time, UTC); valid from :data:`BACKDATE`
                before it.

        Returns:
            ``(certificate, private_key)``.
        """
        start = _now(now)
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server else [
            ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start - BACKDATE)
            .not_valid_after(start + validity)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )
        if hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName(subject_alt_names(hosts)), critical=False)
        return builder.sign(self.key, hashes.SHA256()), key
