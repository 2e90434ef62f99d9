"""Broker profiles: the ``broker/<profile>.conf`` and ``.acl`` templates, filled in as files.

A profile's ``${name}`` placeholders are filled in at start; ``${acl_file}`` brings the ACL
(one block per user role, ``shoal.broker.access``), ``${tls_port}`` a TLS listener. The
running of ``mosquitto`` itself is ``shoal.broker.embedded``'s.
"""

from __future__ import annotations

import re
import shutil
import string
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from shoal._resources import resource_dir
from shoal.broker.access import BrokerUser, render_acl
from shoal.broker.certs import make_ca, make_certificate
from shoal.errors import BrokerError, BrokerNotFoundError, ConfigError
from shoal.schemas.topics import Topics


class ConfigTemplate(string.Template):
    """Only ``${name}`` is a placeholder, so ``$SYS`` in comments stays as written."""

    pattern = r"""
        \$(?:
            (?P<escaped>\$)
          | \{(?P<braced>[_a-z][_a-z0-9]*)\}
          | (?P<named>(?!x)x)
          | (?P<invalid>(?!x)x)
        )
    """  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The broker side of TLS.

    Attributes:
        cert_file: the broker's certificate (PEM).
        key_file: its private key.
        ca_file: the CA clients trust for it; also the CA client certificates must chain to.
        require_client_certificate: refuse clients without a certificate from ``ca_file``.
    """

    cert_file: Path
    key_file: Path
    ca_file: Path
    require_client_certificate: bool = False


def broker_profiles() -> list[str]:
    """Names of the profiles in ``broker/`` (``dev``, ``edge``, ...)."""
    return sorted(p.stem for p in resource_dir("broker").glob("*.conf"))


def profile_template(profile: str) -> tuple[Path, str]:
    """Where a profile's config template is, and its text.

    Raises:
        ConfigError: there is no such profile.
    """
    path = resource_dir("broker") / f"{profile}.conf"
    if not path.is_file():
        available = ", ".join(broker_profiles())
        raise ConfigError(f"unknown broker profile {profile!r}; available: {available}")
    return path, path.read_text()


def fill(template: str, values: Mapping[str, str], source: Path) -> str:
    """``template`` (read from ``source``) with its placeholders filled in.

    Raises:
        ConfigError: a placeholder has no value or is malformed.
    """
    try:
        return ConfigTemplate(template).substitute(values)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"broker template {source} has a bad placeholder: {exc}") from exc


def override(config: str, overrides: Mapping[str, str]) -> str:
    """``config`` with each option in ``overrides`` set to its value (replaced or added)."""
    for option, value in overrides.items():
        if not re.fullmatch(r"[a-z_]+", option) or "\n" in value:
            raise ConfigError(f"not a Mosquitto option: {option!r} {value!r}")
        line = f"{option} {value}"
        config, found = re.subn(rf"(?m)^{option}\s.*$", line, config)
        if not found:
            config = f"{config.rstrip()}\n{line}\n"
    return config


def write_acl(path: Path, profile: str, users: Iterable[BrokerUser], topics: Topics) -> None:
    """Render ``broker/<profile>.acl`` for ``users`` below ``topics``' root into ``path``."""
    template_path = resource_dir("broker") / f"{profile}.acl"
    if not template_path.is_file():
        raise ConfigError(f"broker profile {profile!r} uses an ACL but {template_path} is missing")
    values = {"root": topics.root or "(none)", "users": render_acl(users, topics)}
    text = fill(template_path.read_text(), values, template_path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    tmp.replace(path)


def write_passwords(path: Path, users: Iterable[BrokerUser]) -> None:
    """Write a Mosquitto password file (hashed with ``mosquitto_passwd``) for ``users``."""
    # Written beside the file and renamed, so a reloading broker never reads half of it.
    tmp = path.with_suffix(".tmp")
    tmp.write_text("")
    tmp.chmod(0o600)
    listed = list(users)
    if listed:
        tool = shutil.which("mosquitto_passwd")
        if tool is None:
            raise BrokerNotFoundError(
                "mosquitto_passwd is not on PATH (it ships with the mosquitto package)"
            )
        for user in listed:
            # -b takes the password on the command line; it lives for milliseconds and
            # only on this machine (mosquitto_passwd 2.0 cannot read it from stdin in batch).
            result = subprocess.run(
                [tool, "-b", str(tmp), user.name, user.password],
                capture_output=True,
                check=False,
            )
            if result.returncode != 0:
                raise BrokerError(
                    f"mosquitto_passwd failed for user {user.name!r}: "
                    f"{result.stderr.decode().strip()}"
                )
    tmp.replace(path)


def as_users(users: Mapping[str, str] | Iterable[BrokerUser] | None) -> list[BrokerUser]:
    """``BrokerUser`` values from users or a name → password mapping (users without a role)."""
    if users is None:
        return []
    if isinstance(users, Mapping):
        return [BrokerUser(name, password) for name, password in users.items()]
    listed = list(users)
    names = [u.name for u in listed]
    if len(set(names)) != len(names):
        raise ConfigError(f"duplicate broker user names in {names}")
    return listed


def throwaway_tls(directory: Path) -> ServerTls:
    """A CA and a server certificate for this machine, made once per data folder."""
    ca_cert, cert, key = directory / "ca.crt", directory / "server.crt", directory / "server.key"
    if not (ca_cert.exists() and cert.exists() and key.exists()):
        ca = make_ca(directory, "ca")
        files = make_certificate(ca, directory, "server")
        return ServerTls(files.cert_file, files.key_file, files.ca_file)
    return ServerTls(cert, key, ca_cert)


def tls_values(tls: ServerTls, port: int, bind: str) -> dict[str, str]:
    """The ``${tls_*}`` placeholders of a profile with a TLS listener."""
    return {
        "tls_port": str(port),
        "tls_bind": bind,
        "tls_ca_file": str(tls.ca_file),
        "tls_cert_file": str(tls.cert_file),
        "tls_key_file": str(tls.key_file),
        "tls_require_certificate": "true" if tls.require_client_certificate else "false",
    }


def ws_listener(port: int, bind: str) -> str:
    """Mosquitto's own MQTT-over-WebSockets listener, to append to a rendered config.

    Appended last, so that no listener option later in the profile lands on it.
    """
    return (
        "\n# MQTT over WebSockets for browsers (shoal view)\n"
        f"listener {port} {bind}\nprotocol websockets\n"
    )
