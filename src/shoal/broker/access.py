"""Who may do what on a shoal broker: roles, users, and the users file.

Pure, except that a users file may name a password file; ``shoal.broker.profiles`` writes the
password and ACL files. What each role may read and write, and how Mosquitto applies it, is
``shoal.broker.acl``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, get_args

from shoal.broker.acl import (
    Rule,
    admin_rules,
    combiner_rules,
    control_rules,
    dashboard_rules,
    gateway_rules,
    worker_rules,
)
from shoal.errors import ConfigError
from shoal.schemas.topics import Topics, check_segment

RoleKind = Literal["gateway", "worker", "combiner", "dashboard", "admin", "control"]
ROLE_KINDS: Final[tuple[str, ...]] = get_args(RoleKind)
DEFAULT_INPUTS: Final = ("ingest/+/+",)

_USER_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@\-]{0,127}")


@dataclass(frozen=True, slots=True)
class Role:
    """What a user is for. Build one with the class methods (``Role.gateway()``, ...).

    Attributes:
        kind: gateway, worker, combiner, dashboard, admin or control (the control plane).
        pipeline: the pipeline of a worker or combiner; optional for a worker or combiner
            (None: the pool, serving every deployed pipeline) and a dashboard (None: what ``shoal
            view`` shows of every pipeline).
        gateways: the gateway ids a gateway user publishes for (empty: its own user name).
        inputs: a worker's input filters below the topic root (the pipeline's ``inputs``).
    """

    kind: RoleKind
    pipeline: str | None = None
    gateways: tuple[str, ...] = ()
    inputs: tuple[str, ...] = DEFAULT_INPUTS

    def __post_init__(self) -> None:
        """Refuse roles that cannot be written as ACL lines."""
        if self.kind not in ROLE_KINDS:
            raise ConfigError(f"unknown role {self.kind!r}; known: {', '.join(ROLE_KINDS)}")
        if self.pipeline is not None:
            check_segment(self.pipeline, "pipeline")  # a TopicError is a ConfigError
        for gateway_id in self.gateways:
            check_segment(gateway_id, "gateway id")
        for topic_filter in self.inputs:
            if not topic_filter or topic_filter.startswith(("/", "$")) or " " in topic_filter:
                raise ConfigError(f"worker input filter {topic_filter!r} is not a topic filter")

    @classmethod
    def gateway(cls, *gateway_ids: str) -> Role:
        """A gateway (or a concentrator publishing for several gateway ids)."""
        return cls("gateway", gateways=gateway_ids)

    @classmethod
    def worker(cls, pipeline: str | None, inputs: Iterable[str] = DEFAULT_INPUTS) -> Role:
        """A worker of ``pipeline`` reading ``inputs`` (the pipeline spec's input filters).

        ``pipeline`` None: a pool worker, for every deployed pipeline reading ``inputs``.
        """
        return cls("worker", pipeline=pipeline, inputs=tuple(inputs))

    @classmethod
    def combiner(cls, pipeline: str | None) -> Role:
        """A combiner (any partition) of ``pipeline``; None: a pool combiner."""
        return cls("combiner", pipeline=pipeline)

    @classmethod
    def dashboard(cls, pipeline: str | None = None) -> Role:
        """A reader of results, alerts and health (of one pipeline, or all): ``shoal view``."""
        return cls("dashboard", pipeline=pipeline)

    @classmethod
    def admin(cls) -> Role:
        """Operations: lag, metrics, commands, dead letters, ``$SYS``, ``shoal pipeline``."""
        return cls("admin")

    @classmethod
    def control(cls) -> Role:
        """The control plane (``shoal control``): answers pipeline requests, keeps documents."""
        return cls("control")

    @classmethod
    def parse(cls, text: str) -> Role:
        """A role written as text.

        ``gateway``, ``gateway:gw-1,gw-2``, ``worker`` (the pool), ``worker:P``,
        ``combiner`` (the pool), ``combiner:P``, ``dashboard``, ``dashboard:P``, ``admin``
        or ``control``.
        """
        kind, _, scope = text.partition(":")
        if kind == "gateway":
            return cls.gateway(*(g for g in scope.split(",") if g))
        if kind == "worker":
            return cls.worker(scope or None)
        if kind == "combiner":
            return cls.combiner(scope or None)
        if kind == "dashboard":
            return cls.dashboard(scope or None)
        if kind == "admin" and not scope:
            return cls.admin()
        if kind == "control" and not scope:
            return cls.control()
        raise ConfigError(
            f"unknown role {text!r}: use gateway[:ID,...], worker[:PIPELINE], "
            "combiner[:PIPELINE], dashboard[:PIPELINE], admin or control"
        )

    def rules(self, user: str, topics: Topics) -> list[Rule]:
        """The ACL rules of a user with this role, below ``topics``' root."""
        if self.kind == "gateway":
            return gateway_rules(self.gateways or (user,), topics)
        if self.kind == "worker":
            return worker_rules(self.pipeline, self.inputs, topics)
        if self.kind == "combiner":
            return combiner_rules(self.pipeline, topics)
        if self.kind == "dashboard":
            return dashboard_rules(self.pipeline, topics)
        if self.kind == "control":
            return control_rules(topics)
        return admin_rules(topics)


@dataclass(frozen=True, slots=True)
class BrokerUser:
    """A user of the broker: name, password (stored hashed by ``mosquitto_passwd``), role.

    A user without a role may connect, but with an ACL in force may do nothing.
    """

    name: str
    password: str = field(repr=False)
    role: Role | None = None

    def __post_init__(self) -> None:
        """Refuse names Mosquitto's password and ACL files cannot hold."""
        if _USER_NAME.fullmatch(self.name) is None:
            raise ConfigError(
                f"user name {self.name!r}: use 1-128 characters of [A-Za-z0-9_.@-], starting "
                "with a letter or digit"
            )
        if not self.password:
            raise ConfigError(f"user {self.name!r} needs a password")
        if self.role is not None and self.role.kind == "gateway" and not self.role.gateways:
            check_segment(self.name, "gateway user name (it is the gateway id)")


def render_acl(users: Iterable[BrokerUser], topics: Topics) -> str:
    """The ``user`` blocks of an ACL file, one per user that has a role."""
    blocks = []
    for user in users:
        if user.role is None:
            continue
        scope = f":{user.role.pipeline}" if user.role.pipeline else ""
        lines = [f"# {user.role.kind}{scope}", f"user {user.name}"]
        lines.extend(rule.line() for rule in user.role.rules(user.name, topics))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n" if blocks else ""


def users_from_config(
    entries: object, env: Mapping[str, str], base_dir: Path | None = None
) -> list[BrokerUser]:
    """Users from a parsed users file (``[[users]]`` tables, see the README).

    Each entry has ``name``, ``role`` (as ``Role.parse`` reads it) and one of ``password``,
    ``password_env`` (a variable in ``env``) or ``password_file`` (first line; relative to
    ``base_dir``).
    """
    if not isinstance(entries, list):
        raise ConfigError("a users file holds [[users]] tables")
    users = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"users entry {index} is not a table")
        unknown = set(entry) - {"name", "role", "password", "password_env", "password_file"}
        if unknown:
            raise ConfigError(f"users entry {index}: unknown keys {sorted(unknown)}")
        name = entry.get("name")
        if not isinstance(name, str):
            raise ConfigError(f"users entry {index} needs a name")
        role = entry.get("role")
        users.append(
            BrokerUser(
                name,
                _entry_password(entry, name, env, base_dir),
                Role.parse(role) if isinstance(role, str) else None,
            )
        )
    return users


def _entry_password(
    entry: dict[str, object], name: str, env: Mapping[str, str], base_dir: Path | None
) -> str:
    given = [k for k in ("password", "password_env", "password_file") if k in entry]
    if len(given) != 1:
        raise ConfigError(
            f"user {name!r}: give exactly one of password, password_env, password_file"
        )
    value = entry[given[0]]
    if not isinstance(value, str) or not value:
        raise ConfigError(f"user {name!r}: {given[0]} must be a non-empty string")
    if given[0] == "password":
        return value
    if given[0] == "password_env":
        if not env.get(value):
            raise ConfigError(f"user {name!r}: the environment variable {value} is not set")
        return env[value]
    path = Path(value) if base_dir is None else base_dir / value
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"user {name!r}: cannot read {path}: {exc}") from exc
    if not lines or not lines[0]:
        raise ConfigError(f"user {name!r}: {path} is empty")
    return lines[0]
