"""Certificates and keys for the local control plane (CA, serving, admin client, service accounts).

Short-lived, generated per cluster directory with the ``cryptography`` library;
nothing here is meant for anything but loopback tests.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVICE_IP = "10.0.0.1"
SERVING_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class Pki:
    """Paths of every credential the components need."""

    directory: Path

    def path(self, name: str) -> Path:
        return self.directory / name

    @property
    def ca_cert(self) -> Path:
        return self.path("ca.crt")

    @property
    def serving_cert(self) -> Path:
        return self.path("apiserver.crt")

    @property
    def serving_key(self) -> Path:
        return self.path("apiserver.key")

    @property
    def admin_cert(self) -> Path:
        return self.path("admin.crt")

    @property
    def admin_key(self) -> Path:
        return self.path("admin.key")

    @property
    def service_account_key(self) -> Path:
        return self.path("sa.key")

    @property
    def service_account_public_key(self) -> Path:
        return self.path("sa.pub")


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _write_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _certificate(
    subject: x509.Name,
    public_key,
    issuer: x509.Name,
    issuer_key,
    *,
    ca: bool,
    usage: list | None = None,
    names: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if names or ips:
        alternative = [x509.DNSName(name) for name in names]
        alternative += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(alternative), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def generate(directory: Path, serving_ips: tuple[str, ...] = ()) -> Pki:
    """Write a fresh CA, apiserver serving pair, admin client pair and service-account keys;
    ``serving_ips`` are further addresses the apiserver is reached at (the host's, when
    Pods on real nodes call it through the ``kubernetes`` Service)."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("dlo-test-ca")
    ca = _certificate(ca_name, ca_key.public_key(), ca_name, ca_key, ca=True)
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    for cert_path, key_path, subject, usage, names, ips in (
        (
            pki.serving_cert,
            pki.serving_key,
            _name("kube-apiserver"),
            [ExtendedKeyUsageOID.SERVER_AUTH],
            SERVING_NAMES,
            ("127.0.0.1", SERVICE_IP, *serving_ips),
        ),
        (
            pki.admin_cert,
            pki.admin_key,
            _name("dlo-admin", "system:masters"),
            [ExtendedKeyUsageOID.CLIENT_AUTH],
            (),
            (),
        ),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = _certificate(
            subject, key.public_key(), ca_name, ca_key, ca=False, usage=usage, names=names, ips=ips
        )
        cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_path)

    service_account_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(service_account_key, pki.service_account_key)
    pki.service_account_public_key.write_bytes(
        service_account_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki
