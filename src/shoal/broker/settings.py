"""How to reach a broker: address, credentials, TLS. Pure data; parsed from a URL or the CLI."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import unquote, urlsplit

from shoal.errors import ConfigError

DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """TLS for the broker connection.

    Attributes:
        ca_file: CA bundle that signed the broker's certificate (None: system trust store).
        cert_file: client certificate, for brokers that require one.
        key_file: the client certificate's key.
        verify_hostname: check that the certificate names the host we dialled.
    """

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    verify_hostname: bool = True


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    """Where the broker is and how to log in. ``BrokerSettings.from_url`` parses URLs.

    Attributes:
        host: broker host name or address.
        port: broker TCP port.
        username: MQTT user name (None: anonymous).
        password: MQTT password.
        tls: TLS settings, or None for plain TCP.
        keepalive_s: MQTT keepalive; the broker drops us after 1.5x this without traffic.
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    username: str | None = None
    password: str | None = None
    tls: TlsSettings | None = None
    keepalive_s: int = 30

    @classmethod
    def from_url(cls, url: str) -> BrokerSettings:
        """Parse ``mqtt://[user[:password]@]host[:port]`` or ``mqtts://...`` (TLS)."""
        parts = urlsplit(url if "://" in url else f"mqtt://{url}")
        if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ConfigError(f"broker URL {url!r}: scheme must be mqtt:// or mqtts://")
        if not parts.hostname:
            raise ConfigError(f"broker URL {url!r} names no host")
        tls = TlsSettings() if parts.scheme in ("mqtts", "ssl") else None
        try:
            port = parts.port or (DEFAULT_TLS_PORT if tls else DEFAULT_PORT)
        except ValueError as exc:
            raise ConfigError(f"broker URL {url!r}: {exc}") from exc
        return cls(
            host=parts.hostname,
            port=port,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            tls=tls,
        )

    def with_credentials(self, username: str | None, password: str | None) -> BrokerSettings:
        """A copy with other credentials (None keeps the current value)."""
        return replace(
            self,
            username=username if username is not None else self.username,
            password=password if password is not None else self.password,
        )

    def child_env(self) -> dict[str, str]:
        """Environment variables that give a child ``shoal`` process these credentials.

        The CLI's ``broker_settings`` reads them back (with the TLS files): secrets travel by
        environment, never on a command line that ``ps`` shows.
        """
        env: dict[str, str] = {}
        if self.username is not None:
            env["SHOAL_USERNAME"] = self.username
        if self.password is not None:
            env["SHOAL_PASSWORD"] = self.password
        if self.tls is not None:
            for name, path in (
                ("SHOAL_TLS_CA", self.tls.ca_file),
                ("SHOAL_TLS_CERT", self.tls.cert_file),
                ("SHOAL_TLS_KEY", self.tls.key_file),
            ):
                if path is not None:
                    env[name] = str(path)
        return env

    @property
    def url(self) -> str:
        """The broker URL, without the password."""
        scheme = "mqtts" if self.tls else "mqtt"
        user = f"{self.username}@" if self.username else ""
        return f"{scheme}://{user}{self.host}:{self.port}"
