"""A throwaway PostgreSQL server for the sink benchmark and tests, started like Mosquitto.

``initdb`` into a temporary folder, ``postgres`` on a free loopback port with its Unix
socket in the same folder, trust authentication for one user (``shoal``), stopped by PID.
PostgreSQL refuses to run as root, so when we are root (CI, containers) the server runs as
the ``postgres`` system user that Debian's package creates (else ``nobody``), and the folder
is handed to it. ``kill`` (SIGKILL) and ``start`` again on the same folder and port is a
crash and restart: committed data survives, as it would on a real server.

The binaries come from ``pg_config --bindir``, ``/usr/lib/postgresql/<newest>/bin`` or
PATH; ``make bootstrap`` installs Debian's ``postgresql`` when none is found.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Final

import polars as pl
import psycopg
from psycopg import sql

from shoal._processes import connection_args, shoal_argv
from shoal._spawn import spawn_tied
from shoal.broker.probe import free_port
from shoal.broker.settings import BrokerSettings
from shoal.errors import ConfigError
from shoal.schemas.topics import Topics

USER: Final = "shoal"
DATABASE: Final = "postgres"


def postgres_bindir() -> Path:
    """The folder holding ``initdb`` and ``postgres``; ``ConfigError`` if there is none."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        candidates.append(Path(out.stdout.strip()))
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    candidates += versions
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).parent)
    for folder in candidates:
        if (folder / "initdb").exists() and (folder / "postgres").exists():
            return folder
    raise ConfigError(
        "PostgreSQL is not installed: run 'make bootstrap' (as root it installs Debian's "
        "postgresql) or 'sudo apt-get install -y postgresql'"
    )


def read_table(dsn: str, table: str) -> pl.DataFrame:
    """A whole table as a frame (what a sink wrote, for checking it)."""
    with psycopg.connect(dsn) as conn:
        cursor = conn.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(table)))
        names = [d.name for d in cursor.description or ()]
        rows = cursor.fetchall()
    return pl.DataFrame(rows, schema=names, orient="row", infer_schema_length=None)


def sink_argv(
    dsn: str, pipeline: str, table: str, broker: BrokerSettings, topics: Topics, *extra: str
) -> list[str]:
    """The command line of ``shoal sink postgres`` for a pipeline into a table."""
    return shoal_argv(
        "sink",
        "postgres",
        "--dsn",
        dsn,
        "--pipeline",
        pipeline,
        "--table",
        table,
        *extra,
        *connection_args(broker, topics),
    )


def _run_as() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise ConfigError("running as root and there is no 'postgres' or 'nobody' user to run as")


class EmbeddedPostgres:
    """One PostgreSQL server in a temporary folder (see the module docstring).

    Args:
        root: the folder to use (default: a new temporary one, removed by ``cleanup``);
            when we are root, the server's user must be able to reach it (its parents
            world-searchable).
    """

    def __init__(self, root: Path | None = None) -> None:
        self._own_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix="shoal-pg-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.port = free_port()
        self.bindir = postgres_bindir()
        self.user = _run_as()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def dsn(self) -> str:
        """Where to connect (TCP on loopback, user ``shoal``, trust authentication)."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{DATABASE}"

    def _chown(self, path: Path) -> None:
        if self.user is not None:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)

    def init(self) -> None:
        """Create the cluster (once)."""
        if self.data.exists():
            return
        self._chown(self.root)
        self.root.chmod(0o755)
        argv = [
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            USER,
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        ]
        done = subprocess.run(
            argv, capture_output=True, text=True, check=False, user=self._uid, group=self._gid
        )
        if done.returncode != 0:
            raise ConfigError(f"initdb failed ({done.returncode}): {done.stderr.strip()[-500:]}")

    @property
    def _uid(self) -> int | None:
        return None if self.user is None else self.user.pw_uid

    @property
    def _gid(self) -> int | None:
        return None if self.user is None else self.user.pw_gid

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the server (``init`` first if needed) and wait until it takes connections."""
        self.init()
        with self.log.open("ab") as log:
            self.process = spawn_tied(
                [
                    str(self.bindir / "postgres"),
                    "-D",
                    str(self.data),
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.root),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    "fsync=on",
                    "-c",
                    "shared_buffers=32MB",
                    "-c",
                    "max_connections=20",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                user=self._uid,
                group=self._gid,
                death_signal=signal.SIGINT,  # its fast shutdown, should we die first
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ConfigError(f"postgres exited at start: {self.log_tail()}")
            if self._ready():
                return
            time.sleep(0.1)
        raise ConfigError(
            f"postgres did not accept connections in {timeout_s} s: {self.log_tail()}"
        )

    def _ready(self) -> bool:
        done = subprocess.run(
            [str(self.bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"],
            check=False,
        )
        return done.returncode == 0

    def kill(self) -> None:
        """SIGKILL the server (a crash); its children exit when they notice."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self._wait_children_gone()

    def stop(self) -> None:
        """Stop the server quickly (SIGINT: fast shutdown), SIGKILL if it hangs."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def restart(self, down_s: float = 1.0, attempts: int = 30) -> None:
        """Kill -9 the server, wait ``down_s``, start it again on the same data and port.

        Backends of the killed server may hold its shared memory a little longer (the new
        one then refuses to start): retried, like a service manager would.
        """
        self.kill()
        time.sleep(down_s)
        for attempt in range(attempts):
            try:
                self.start()
            except ConfigError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5)
            else:
                return

    def _wait_children_gone(self, timeout_s: float = 20.0) -> None:
        # After a SIGKILL of the postmaster its backends linger until they notice; a new
        # postmaster refuses to start while they hold the shared memory.
        pid_file = self.data / "postmaster.pid"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not pid_file.exists():
                return
            try:
                pid = int(pid_file.read_text().split("\n", 1)[0])
            except (OSError, ValueError):
                return
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)

    def log_tail(self, lines: int = 15) -> str:
        """The end of the server's log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def cleanup(self) -> None:
        """Stop and remove the folder (if we made it)."""
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
