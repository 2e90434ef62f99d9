"""Options shared by CLI commands, and the one place environment variables are read.

Precedence: command-line flag, then environment variable, then default.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from shoal.broker.settings import BrokerSettings, TlsSettings
from shoal.errors import ConfigError
from shoal.schemas.topics import Topics

if TYPE_CHECKING:
    from shoal.processors.spec import PipelineSpec

DEFAULT_BROKER_URL = "mqtt://127.0.0.1:1883"

T = TypeVar("T")


def add_broker_options(parser: argparse.ArgumentParser) -> None:
    """``--broker``, credentials, TLS and topic root."""
    group = parser.add_argument_group("broker")
    group.add_argument(
        "--broker",
        metavar="URL",
        help=f"broker URL, mqtt://host:port or mqtts://... (env SHOAL_BROKER; "
        f"default {DEFAULT_BROKER_URL})",
    )
    group.add_argument("--username", help="MQTT user name (env SHOAL_USERNAME)")
    group.add_argument(
        "--password",
        help="MQTT password (env SHOAL_PASSWORD; prefer the environment or --password-file: "
        "a command line is visible to every user of the machine)",
    )
    group.add_argument(
        "--password-file",
        metavar="FILE",
        type=Path,
        help="read the MQTT password from the first line of FILE (env SHOAL_PASSWORD_FILE)",
    )
    group.add_argument("--tls-ca", metavar="FILE", help="CA file for mqtts:// (env SHOAL_TLS_CA)")
    group.add_argument("--tls-cert", metavar="FILE", help="client certificate (env SHOAL_TLS_CERT)")
    group.add_argument("--tls-key", metavar="FILE", help="client key (env SHOAL_TLS_KEY)")
    group.add_argument(
        "--topic-root",
        metavar="PREFIX",
        help="prefix for every topic, to share a broker (env SHOAL_TOPIC_ROOT; default none)",
    )


def add_metrics_options(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-host``: Prometheus ``/metrics`` of this process."""
    group = parser.add_argument_group("metrics")
    group.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (env SHOAL_METRICS_PORT; "
        "0: any free port, printed at start; default: off)",
    )
    group.add_argument(
        "--metrics-host",
        metavar="HOST",
        help="address of the metrics endpoint (env SHOAL_METRICS_HOST; default 127.0.0.1; "
        "0.0.0.0 to be scraped from other hosts, e.g. in Kubernetes)",
    )


def metrics_address(
    args: argparse.Namespace, env: Mapping[str, str] = os.environ
) -> tuple[str, int] | None:
    """(host, port) of the metrics endpoint, or None when it is off (no port, or < 0)."""
    flag: int | None = args.metrics_port
    port = _flag_or_env(flag, env, "SHOAL_METRICS_PORT", int, "a port number")
    if port is None or port < 0:
        return None
    if port > 65535:
        raise ConfigError(f"--metrics-port {port} is not a TCP port (0-65535)")
    return (args.metrics_host or env.get("SHOAL_METRICS_HOST") or "127.0.0.1", port)


def _flag_or_env(
    flag: T | None, env: Mapping[str, str], name: str, parse: Callable[[str], T], what: str
) -> T | None:
    """The flag's value, else the environment variable ``name`` parsed, else None."""
    if flag is not None or not env.get(name):
        return flag
    try:
        return parse(env[name])
    except ValueError as exc:
        raise ConfigError(f"{name}={env[name]!r} is not {what}") from exc


def add_stop_option(parser: argparse.ArgumentParser) -> None:
    """``--stop-timeout``: how long a graceful stop may take (docs/guarantees.md, "Stopping")."""
    parser.add_argument(
        "--stop-timeout",
        type=float,
        metavar="S",
        help="after SIGTERM/SIGINT, give up what is still pending after S seconds (it is "
        "delivered again) and exit; a second signal exits at once (env SHOAL_STOP_TIMEOUT; "
        "default 8)",
    )


def stop_timeout(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> float:
    """Seconds a graceful stop may take: ``--stop-timeout``, SHOAL_STOP_TIMEOUT, or 8."""
    from shoal._stopping import STOP_GRACE_S  # noqa: PLC0415

    flag: float | None = args.stop_timeout
    value = _flag_or_env(flag, env, "SHOAL_STOP_TIMEOUT", float, "a number of seconds")
    if value is None:
        return STOP_GRACE_S
    if value <= 0:
        raise ConfigError(f"--stop-timeout {value:g}: must be positive")
    return value


def add_embedded_broker_option(parser: argparse.ArgumentParser) -> None:
    """``--embedded-broker mosquitto|mochi``: which broker this command starts."""
    parser.add_argument(
        "--embedded-broker",
        choices=("mosquitto", "mochi"),
        default=None,
        help="the broker shoal starts: mosquitto, or mochi (Mochi MQTT, `make mochi`; "
        "docs/brokers.md) (env SHOAL_EMBEDDED_BROKER; default mosquitto)",
    )


def broker_settings(
    args: argparse.Namespace, env: Mapping[str, str] = os.environ
) -> BrokerSettings:
    """Build ``BrokerSettings`` from flags with environment fallbacks."""
    url = args.broker or env.get("SHOAL_BROKER") or DEFAULT_BROKER_URL
    settings = BrokerSettings.from_url(url)
    settings = settings.with_credentials(
        args.username or env.get("SHOAL_USERNAME"), _password(args, env)
    )
    ca = args.tls_ca or env.get("SHOAL_TLS_CA")
    cert = args.tls_cert or env.get("SHOAL_TLS_CERT")
    key = args.tls_key or env.get("SHOAL_TLS_KEY")
    if ca or cert or key:
        tls = TlsSettings(
            ca_file=Path(ca) if ca else None,
            cert_file=Path(cert) if cert else None,
            key_file=Path(key) if key else None,
        )
        settings = dataclasses.replace(settings, tls=tls)
    return settings


def _password(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """``--password``, ``--password-file``, ``SHOAL_PASSWORD``, ``SHOAL_PASSWORD_FILE``."""
    if args.password:
        return str(args.password)
    path = getattr(args, "password_file", None) or env.get("SHOAL_PASSWORD_FILE")
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read the password file {path}: {exc}") from exc
        if not lines or not lines[0]:
            raise ConfigError(f"the password file {path} is empty")
        return lines[0]
    return env.get("SHOAL_PASSWORD")


def topics(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> Topics:
    """The topic namespace from ``--topic-root`` or ``SHOAL_TOPIC_ROOT``."""
    root = args.topic_root if args.topic_root is not None else env.get("SHOAL_TOPIC_ROOT", "")
    return Topics(root=root)  # a bad root raises TopicError, a ConfigError


def setup_logging(verbosity: int, env: Mapping[str, str] = os.environ) -> None:
    """Structured-enough logs on stderr: time, level, component, message.

    ``-v`` flags lower the level from WARNING; ``SHOAL_LOG_LEVEL`` (e.g. ``INFO``) sets it
    when no flag is given (``shoal up`` uses it for the log files of its children).
    """
    level = logging.WARNING - 10 * verbosity
    named = env.get("SHOAL_LOG_LEVEL", "").upper()
    if not verbosity and named in ("DEBUG", "INFO", "WARNING", "ERROR"):
        level = getattr(logging, named)
    logging.basicConfig(
        level=max(level, logging.DEBUG),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def add_pipeline_option(parser: argparse.ArgumentParser) -> None:
    """``--pipeline NAME|FILE``."""
    parser.add_argument(
        "--pipeline",
        default="default",
        metavar="NAME|FILE",
        help="pipeline spec: a TOML file, or the name of one in processors/ (default: default)",
    )


def spec_path(name_or_path: str) -> Path:
    """The file of a pipeline spec given as a path or by name from ``processors/``."""
    from shoal._resources import resource_dir  # noqa: PLC0415

    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.exists():
            raise ConfigError(f"pipeline spec {path} does not exist")
        return path
    candidate = resource_dir("processors") / f"{name_or_path}.toml"
    if not candidate.exists():
        known = sorted(p.stem for p in resource_dir("processors").glob("*.toml"))
        raise ConfigError(f"no pipeline named {name_or_path!r}; known: {', '.join(known)}")
    return candidate


def load_spec(name_or_path: str) -> PipelineSpec:
    """Load a pipeline spec from a file path or by name from ``processors/``."""
    from shoal.processors.spec import load_pipeline  # noqa: PLC0415

    return load_pipeline(spec_path(name_or_path))
