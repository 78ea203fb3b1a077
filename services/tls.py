"""Service-to-service mTLS: who may call a worker. With `--tls-cert`, `--tls-key` and
`--tls-ca` (`PDSERVE_TLS_*`) a worker's gRPC port takes only callers presenting a
certificate the CA signed, and the coordinator and decode workers present theirs when they
call workers. Peers check the name `--tls-server-name` (default `pdserve-internal`) in each
other's certificates rather than pod addresses, which change; one certificate carrying that
name (usages server and client auth) can serve a whole release. Servers read their
certificate files again when they change, so a renewed certificate is taken without a
restart; new connections then use it.

The coordinator's public ports are the edge: a server certificate there
(`--public-tls-cert` / `--public-tls-key`) asks no client certificate, the API key is the
door. `make_throwaway` writes a CA and one certificate for `serve --internal-tls`."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdserve.common.config import Option
from pdserve.services.engine_args import FROM_ENV, add_options

DEFAULT_SERVER_NAME = "pdserve-internal"

# Every service (`add_tls_args`).
TLS_OPTIONS = (
    Option("tls_cert", str, None, "this service's certificate (PEM)"),
    Option("tls_key", str, None, "its private key (PEM)"),
    Option(
        "tls_ca",
        str,
        None,
        "the CA bundle peers' certificates must chain to; with the three set, worker "
        "ports take only callers with such a certificate",
    ),
    Option(
        "tls_server_name",
        str,
        DEFAULT_SERVER_NAME,
        "the name every internal certificate carries and peers check (default: %(default)s)",
    ),
    Option(
        "health_port",
        int,
        -1,
        "a plain gRPC port serving only grpc.health.v1, for probes that cannot present "
        "a certificate; 0 picks a free one, -1 is off (default: %(default)s)",
    ),
)


def add_tls_args(p: argparse.ArgumentParser) -> None:
    add_options(p.add_argument_group(f"mTLS between services ({FROM_ENV})"), TLS_OPTIONS)


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path
    server_name: str = DEFAULT_SERVER_NAME

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TlsFiles | None:
        """The files the flags name, None when none is given. Raises ValueError when only
        some are, or one cannot be read."""
        given = {"--tls-cert": args.tls_cert, "--tls-key": args.tls_key, "--tls-ca": args.tls_ca}
        if not any(given.values()):
            return None
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            raise ValueError(f"mTLS: --tls-cert, --tls-key and --tls-ca go together; give "
                             f"{', '.join(missing)} too")  # fmt: skip
        files = cls(Path(args.tls_cert), Path(args.tls_key), Path(args.tls_ca),
                    args.tls_server_name or DEFAULT_SERVER_NAME)  # fmt: skip
        files.read()
        return files

    @classmethod
    def from_env(cls, environ: dict[str, str]) -> TlsFiles | None:
        if not environ.get("PDSERVE_TLS_CERT"):
            return None
        return cls(
            Path(environ["PDSERVE_TLS_CERT"]),
            Path(environ["PDSERVE_TLS_KEY"]),
            Path(environ["PDSERVE_TLS_CA"]),
            environ.get("PDSERVE_TLS_SERVER_NAME") or DEFAULT_SERVER_NAME,
        )

    def env(self) -> dict[str, str]:
        """The environment that gives a child process these files (`from_env`'s inverse)."""
        return {
            "PDSERVE_TLS_CERT": str(self.cert),
            "PDSERVE_TLS_KEY": str(self.key),
            "PDSERVE_TLS_CA": str(self.ca),
            "PDSERVE_TLS_SERVER_NAME": self.server_name,
        }

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for name, path in (("certificate", self.cert), ("key", self.key), ("CA", self.ca)):
            try:
                out.append(path.read_bytes())
            except OSError as e:
                raise ValueError(f"mTLS: cannot read the {name} {path}: {e}") from None
        return out[0], out[1], out[2]

    def _mtimes(self) -> tuple[float, ...]:
        return tuple(os.stat(p).st_mtime for p in (self.cert, self.key, self.ca))

    def server_credentials(self) -> grpc.ServerCredentials:
        """Client certificates required; the files are read again when they change."""
        cert, key, ca = self.read()
        seen = [self._mtimes()]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            try:
                now = self._mtimes()
                if now == seen[0]:
                    return None
                cert, key, ca = self.read()
            except (OSError, ValueError):  # a file mid-replacement: keep the old one
                return None
            seen[0] = now
            return grpc.ssl_server_certificate_configuration([(key, cert)], ca)

        return grpc.dynamic_ssl_server_credentials(
            grpc.ssl_server_certificate_configuration([(key, cert)], ca),
            fetch,
            require_client_authentication=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_channel_credentials(ca, key, cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)]


_internal: TlsFiles | None = None


def use_internal_tls(files: TlsFiles | None) -> None:
    """This process's identity towards workers (set once at start)."""
    global _internal
    _internal = files


def internal_tls() -> TlsFiles | None:
    return _internal


def internal_channel(
    address: str, options: Sequence[tuple[str, Any]] = (), tls: TlsFiles | None = None
) -> grpc.aio.Channel:
    """A channel to a worker: mTLS with this process's certificate when it has one."""
    tls = tls or _internal
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=[*options, *tls.channel_options()]
    )


def public_server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    try:
        pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    except OSError as e:
        raise ValueError(f"public TLS: cannot read {e.filename}: {e.strerror}") from None
    return grpc.ssl_server_credentials([pair])


def make_throwaway(folder: Path, server_name: str = DEFAULT_SERVER_NAME, days: int = 7) -> TlsFiles:
    """A new CA and one certificate it signed (server and client auth, for `server_name`,
    localhost and 127.0.0.1), written into `folder` (private: 0700 / 0600)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve throwaway CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    names = [x509.DNSName(server_name), x509.DNSName("localhost"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]  # fmt: skip
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "tls.crt", folder / "tls.key", folder / "ca.crt", server_name)
    pem = serialization.Encoding.PEM
    _write(files.ca, ca.public_bytes(pem))
    _write(files.cert, cert.public_bytes(pem))
    _write(files.key, key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))  # fmt: skip
    return files


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
