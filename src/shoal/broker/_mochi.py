"""The second broker: Mochi MQTT (``broker/mochi``, built into ``var/bin/shoal-mochi``).

``EmbeddedBroker(broker="mochi")`` renders the same ``broker/<profile>.conf`` as for
Mosquitto, then translates the options shoal relies on into the JSON ``shoal-mochi`` reads
(``broker/mochi/main.go``): listeners (TLS too), anonymous access, users and their ACL
rules, maximum packet size, persistence and ``$SYS`` interval. Options Mochi has no
equivalent for are listed in ``UNMAPPED`` and in docs/brokers.md; queues are bounded by
message count there (``maximum_inflight``), not by bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from shoal._resources import resource_dir
from shoal.broker._mosquitto import MosquittoProcess
from shoal.broker.access import BrokerUser
from shoal.errors import BrokerNotFoundError, ConfigError
from shoal.schemas.topics import Topics

BINARY_ENV: Final = "SHOAL_MOCHI_BINARY"
BINARY_NAME: Final = "shoal-mochi"
INSTALL_HINT: Final = (
    "the Mochi MQTT broker (shoal-mochi) is not built: run `make mochi` in a shoal checkout "
    "(needs Go 1.21 or newer), put shoal-mochi on PATH, or set SHOAL_MOCHI_BINARY"
)

# Per-client store of QoS 1 messages (in flight + waiting); Mochi's ceiling is 65,535 (the
# packet-id space). Beyond it Mochi drops the message for that client, so it is set high.
MAXIMUM_INFLIGHT: Final = 65535
# Outbound write queue per client. Mochi drops QoS 1 messages for a client that sets no
# Receive Maximum once this is full; shoal's subscribers all set one, this is a safety margin.
CLIENT_WRITES_PENDING: Final = 65535

UNMAPPED: Final = frozenset(
    {
        "user",
        "per_listener_settings",
        "max_queued_messages",
        "max_queued_bytes",
        "memory_limit",
        "max_inflight_messages",
        "persistence_location",
        "persistence_file",
        "autosave_interval",
        "persistent_client_expiration",
        "set_tcp_nodelay",
        "max_keepalive",
        "log_dest",
        "log_type",
        "connection_messages",
        "log_timestamp_format",
        "password_file",
        "acl_file",
    }
)
"""Mosquitto options with no Mochi counterpart (or one set otherwise); see docs/brokers.md."""


def mochi_binary() -> str:
    """The ``shoal-mochi`` executable: ``$SHOAL_MOCHI_BINARY``, ``var/bin`` of a checkout, PATH.

    Raises:
        BrokerNotFoundError: there is none.
    """
    given = os.environ.get(BINARY_ENV)
    if given:
        if not os.access(given, os.X_OK):
            raise BrokerNotFoundError(f"{BINARY_ENV}={given} is not an executable file")
        return given
    built = resource_dir("broker").parent / "var" / "bin" / BINARY_NAME
    if os.access(built, os.X_OK):
        return str(built)
    found = shutil.which(BINARY_NAME)
    if found is None:
        raise BrokerNotFoundError(INSTALL_HINT)
    return found


def options(config: str) -> list[tuple[str, str]]:
    """The ``option value`` lines of a Mosquitto configuration, in order."""
    pairs = []
    for raw in config.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            option, _, value = line.partition(" ")
            pairs.append((option, value.strip()))
    return pairs


def mochi_config(
    config: str,
    users: Iterable[BrokerUser],
    topics: Topics,
    data_dir: Path,
    log_path: Path,
) -> dict[str, object]:
    """The ``shoal-mochi`` configuration equivalent to a rendered Mosquitto ``config``.

    Raises:
        ConfigError: an option shoal's profiles do not use and this translation does not know.
    """
    listen: list[str] = []
    tls: list[dict[str, object]] = []
    result: dict[str, object] = {
        "listen": listen,
        "tls": tls,
        "allow_anonymous": False,
        "authenticate": False,
        "acl": False,
        "users": [],
        "store_file": "",
        "log_file": str(log_path),
        "log_level": os.environ.get("SHOAL_MOCHI_LOG_LEVEL", "WARN"),  # DEBUG: every packet
        "sys_interval": 10,
        "maximum_packet_size": 0,
        "maximum_inflight": MAXIMUM_INFLIGHT,
        "receive_maximum": 65535,
        "maximum_client_writes_pending": CLIENT_WRITES_PENDING,
        # 0: a message without an expiry never expires (Mochi's default caps it at 24 h).
        "maximum_message_expiry_interval": 0,
    }
    current_tls: dict[str, object] | None = None
    for option, value in options(config):
        if option == "listener":
            port, _, bind = value.partition(" ")
            address = f"{bind or '0.0.0.0'}:{port}"  # noqa: S104 - Mosquitto's default too
            current_tls = {"address": address}
            listen.append(address)
        elif option in {"cafile", "certfile", "keyfile", "require_certificate"}:
            if current_tls is None:
                raise ConfigError(f"{option} before any listener")
            if current_tls["address"] in listen:
                listen.remove(str(current_tls["address"]))
                tls.append(current_tls)
            key = {
                "cafile": "ca_file",
                "certfile": "cert_file",
                "keyfile": "key_file",
                "require_certificate": "require_client_certificate",
            }[option]
            current_tls[key] = value == "true" if option == "require_certificate" else value
        elif option == "allow_anonymous":
            result["allow_anonymous"] = value == "true"
        elif option == "password_file":
            result["authenticate"] = True
        elif option == "acl_file":
            result["acl"] = True
        elif option == "max_packet_size":
            result["maximum_packet_size"] = int(value)
        elif option == "persistence":
            result["store_file"] = str(data_dir / "mochi.db") if value == "true" else ""
        elif option == "sys_interval":
            result["sys_interval"] = int(value)
        elif option not in UNMAPPED:
            raise ConfigError(f"the Mochi broker has no equivalent for Mosquitto's {option!r}")
    result["users"] = [_user(user, topics) for user in users]
    return result


def _user(user: BrokerUser, topics: Topics) -> dict[str, object]:
    salt = secrets.token_hex(8)
    rules = user.role.rules(user.name, topics) if user.role is not None else []
    return {
        "name": user.name,
        "salt": salt,
        "password_sha256": hashlib.sha256((salt + user.password).encode()).hexdigest(),
        "rules": [{"access": rule.access, "topic": rule.topic} for rule in rules],
    }


def write_mochi_config(path: Path, config: dict[str, object]) -> None:
    """Write the configuration (it holds password hashes: owner-only), atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config, indent=1))
    tmp.chmod(0o600)
    tmp.replace(path)


class MochiProcess(MosquittoProcess):
    """``shoal-mochi -config FILE``: the same life cycle as a Mosquitto process.

    Mochi logs to the file its configuration names; SIGHUP re-reads the users.
    """

    def _argv(self, binary: str, config_path: Path) -> list[str]:
        return [binary, "-config", str(config_path)]


def mochi_version(binary: str) -> str:
    """The Mochi MQTT version ``binary`` was built with."""
    return subprocess.run(
        [binary, "-version"], capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()
