"""TLS material for test servers: a certificate authority, a server and a client
certificate generated with ``cryptography``, and the config lines, client arguments and URL
query that use them.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvplug_testing.ports import HOST


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a test certificate authority, a server and a client certificate."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path | str) -> TLSFiles:
    """Generate a CA and, signed by it, a server certificate for 127.0.0.1 and localhost and a
    client certificate, into ``directory`` (needs the ``cryptography`` package)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = Path(directory)
    now = datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017 (3.10 has no datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("kvplug test CA"))
        .issuer_name(name("kvplug test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common: str, usage: x509.ObjectIdentifier) -> tuple[x509.Certificate, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.IPAddress(ipaddress.ip_address(HOST)),
                        x509.DNSName("localhost"),
                    ]
                ),
                critical=False,
            )
        )
        return builder.sign(ca_key, hashes.SHA256()), key

    server, server_key = leaf("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH)
    client, client_key = leaf("kvplug test client", ExtendedKeyUsageOID.CLIENT_AUTH)
    files = TLSFiles(
        ca_cert=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )
    files.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files.client_cert.write_bytes(client.public_bytes(serialization.Encoding.PEM))
    write_key(files.server_key, server_key)
    write_key(files.client_key, client_key)
    return files


def tls_config_lines(
    files: TLSFiles, port: int, *, auth_clients: bool, replication: bool = True
) -> list[str]:
    """Config lines for a TLS-only process (server or sentinel) on ``port``. With
    ``replication`` its outgoing connections (a replica to its master, also after a failover
    turns a master into a replica; a sentinel to the servers and to the other sentinels) use
    TLS too, presenting the client certificate, which a peer with ``tls-auth-clients yes``
    accepts (the server certificate is for server use only)."""
    return [
        "port 0",
        f"tls-port {port}",
        f"tls-cert-file {files.server_cert}",
        f"tls-key-file {files.server_key}",
        f"tls-client-cert-file {files.client_cert}",
        f"tls-client-key-file {files.client_key}",
        f"tls-ca-cert-file {files.ca_cert}",
        f"tls-auth-clients {'yes' if auth_clients else 'no'}",
        f"tls-replication {'yes' if replication else 'no'}",
    ]


def tls_client_settings(files: TLSFiles) -> dict[str, Any]:
    """redis-py client arguments for a process set up with ``files`` (client certificate
    included, so it also passes ``tls-auth-clients yes``)."""
    return {
        "ssl": True,
        "ssl_ca_certs": str(files.ca_cert),
        "ssl_certfile": str(files.client_cert),
        "ssl_keyfile": str(files.client_key),
    }


def tls_query(files: TLSFiles, *, client_certificate: bool) -> str:
    """The ``ssl_*`` query of a kvplug URL for a process set up with ``files``."""
    query = f"ssl_ca_certs={files.ca_cert}"
    if client_certificate:
        query += f"&ssl_certfile={files.client_cert}&ssl_keyfile={files.client_key}"
    return query


__all__ = ["TLSFiles", "make_tls_files", "tls_client_settings", "tls_config_lines", "tls_query"]


TLS_OPERATION_BUDGET = 30.0
"""Seconds one contract-suite step may take over TLS (the suite's default is 10)."""


class OverTLS:
    """Mixin for a contract-suite class whose backend speaks TLS: each step of the suite gets
    :data:`TLS_OPERATION_BUDGET` seconds. The budget only tells a hang from slowness; every
    handshake and record costs CPU in Python's ssl, and the suite's step of 200 concurrent
    tasks outran 10 s on a 2-core machine under a CPU hog and a parallel test session."""

    @pytest.fixture
    def run(self, kvplug_runner: Any) -> Callable[..., Any]:
        def run(coroutine: Any, timeout: float | None = None) -> Any:
            return kvplug_runner.run(
                coroutine, TLS_OPERATION_BUDGET if timeout is None else timeout
            )

        return run


class OverTLSWithoutServerControl(OverTLS):
    """:class:`OverTLS` for a class the suite cannot pause or stop the server of (Sentinel): the
    backend's own ``timeout`` option gets the budget too, since 200 concurrent operations over
    TLS queued past 10 s each on a 2-core machine under heavy load. Only where no deadline test
    runs: those would wait out the longer deadline."""

    @pytest.fixture
    def kvplug_options(self) -> dict[str, Any]:
        return {"timeout": TLS_OPERATION_BUDGET}
