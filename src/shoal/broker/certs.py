"""Throwaway TLS material with the ``openssl`` command: a CA and certificates it signs.

For tests, demos and a first ``shoal broker --profile secure``; production brokers use
certificates from the site's own CA (``shoal broker --cafile/--certfile/--keyfile``).
Keys are EC P-256, written with mode 0600.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from shoal.errors import BrokerError, BrokerNotFoundError

DEFAULT_HOSTS: Final = ("localhost", "127.0.0.1", "::1")
_CURVE: Final = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    """A CA: its certificate (what clients trust) and its private key."""

    cert_file: Path
    key_file: Path


@dataclass(frozen=True, slots=True)
class CertFiles:
    """A certificate, its key, and the CA certificate that signed it."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def _openssl() -> str:
    tool = shutil.which("openssl")
    if tool is None:
        raise BrokerNotFoundError(
            "openssl is not on PATH; install it (`sudo apt-get install -y openssl`) or give "
            "the broker certificate files"
        )
    return tool


def _run(args: list[str]) -> None:
    result = subprocess.run([_openssl(), *args], capture_output=True, check=False)
    if result.returncode != 0:
        raise BrokerError(
            f"openssl {args[0]} failed: {result.stderr.decode(errors='replace').strip()}"
        )


def make_ca(
    directory: Path, name: str = "shoal throwaway CA", days: int = 3650
) -> CertificateAuthority:
    """Create a self-signed CA in ``directory`` (``<name>.crt``/``.key``, file-safe name)."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = _stem(name)
    ca = CertificateAuthority(directory / f"{stem}.crt", directory / f"{stem}.key")
    _run(
        [
            "req",
            "-x509",
            *_CURVE,
            "-keyout",
            str(ca.key_file),
            "-out",
            str(ca.cert_file),
            "-days",
            str(days),
            "-subj",
            f"/CN={name}",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-addext",
            "subjectKeyIdentifier=hash",
        ]
    )
    ca.key_file.chmod(0o600)
    return ca


def make_certificate(
    ca: CertificateAuthority,
    directory: Path,
    common_name: str,
    *,
    hosts: tuple[str, ...] = DEFAULT_HOSTS,
    client: bool = False,
    days: int = 825,
) -> CertFiles:
    """A certificate for a server (names in ``hosts``) or, with ``client``, a client."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = _stem(common_name)
    key, csr, cert = (directory / f"{stem}{s}" for s in (".key", ".csr", ".crt"))
    ext = directory / f"{stem}.ext"
    names = ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in hosts)
    ext.write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyAgreement\n"
        f"extendedKeyUsage={'clientAuth' if client else 'serverAuth'}\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n" + (f"subjectAltName={names}\n" if names else "")
    )
    _run(
        [
            "req",
            "-new",
            *_CURVE,
            "-keyout",
            str(key),
            "-out",
            str(csr),
            "-subj",
            f"/CN={common_name}",
        ]
    )
    _run(
        [
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca.cert_file),
            "-CAkey",
            str(ca.key_file),
            "-CAcreateserial",
            "-out",
            str(cert),
            "-days",
            str(days),
            "-extfile",
            str(ext),
        ]
    )
    key.chmod(0o600)
    csr.unlink(missing_ok=True)
    ext.unlink(missing_ok=True)
    return CertFiles(ca.cert_file, cert, key)


def _stem(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-") or "cert"


def _is_ip(host: str) -> bool:
    return host.replace(".", "").isdigit() or ":" in host
