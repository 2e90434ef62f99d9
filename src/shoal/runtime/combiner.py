"""The combiner: one partition of a pipeline's second phase, with checkpoints and confirmations.

Composition root around ``shoal.processors.combine.Combiner``. It subscribes to its partition's
partials and to gateway status, closes windows as the watermark moves, publishes results, late
rows and, after each durable checkpoint, confirmations.

Checkpoint order (``_checkpoint``), the heart of "nothing lost, nothing counted twice":

1. in one synchronous step, take the snapshot and note every result and late-row publish
   started so far (they describe exactly the windows the snapshot no longer holds);
2. wait for those publishes' PUBACKs;
3. write the snapshot atomically (temp file, fsync, rename);
4. publish confirmations for the seqs the snapshot covers; gateways may now forget them.

After a kill -9 the combiner restarts from the last snapshot; every batch applied after it is
unconfirmed, so its gateway sends it again and the result is the same. A window closed after
the snapshot may be published a second time, with the same identity and values.

What makes "the same" hold when a close depended on timing (a gateway idle or released when
it ran) is the close log (``shoal.processors.close_log``), a file beside the checkpoint: every
close is appended to it before its results are published (and flushed to disk first when it
publishes anything), and a restored core re-takes the logged closes, each once the batches
applied before it are back. The writes run on the process's close-log thread (one for every
partition it hosts, flushing them together); what they decide waits in the outputs, not the
event loop (``_write_log``). No checkpoint is taken while it does; once a checkpoint is
durable the log keeps only what came after it. A partition holding a chain of spec versions
(``shoal.processors.versions``) keeps one log per stage, ``combiner.closes.v<version>``
(a pipeline from a file: ``combiner.closes``); a stage's file goes once a durable checkpoint
no longer holds the stage.

The MQTT session is persistent (stable client id per partition, session expiry), so partials
published while the combiner restarts wait in the broker; a second combiner started for the
same partition takes the session over and the first is disconnected.

Hosted by a combiner pool (``CombinerConfig.hosted``, ``shoal.runtime.hosting``), a run is
one ownership term: take the session (deposing any previous owner), then the checkpoint
folder's lock (``_fence``), restore, serve; a lost connection ends the term (``deposed``)
instead of reconnecting, and the pool decides whether to start another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import compress, repeat
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import orjson
import polars as pl

from shoal._futures import ignore_outcome
from shoal.broker import default_intake_session_factory, default_output_session_factory
from shoal.broker.held import HeldSession
from shoal.broker.pooled import PooledOutputs
from shoal.broker.session import Message, Session, SessionFactory
from shoal.broker.settings import BrokerSettings
from shoal.clock import Clock, SystemClock
from shoal.control.canonical import canonical_mapping, canonicalize
from shoal.errors import (
    BrokerError,
    ConfigError,
    PayloadTooLargeError,
    ResultTooLargeError,
    SchemaError,
    StateCapError,
    UsageError,
)
from shoal.processors.close_log import LogWrite
from shoal.processors.combine import Combiner, LateRows, Step
from shoal.processors.partials import Partial
from shoal.processors.result_parts import (
    Oversized,
    body_budget,
    json_body_size,
    msgpack_body_size,
    split_result,
)
from shoal.processors.results import (
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    Emission,
    WindowResult,
    json_rows,
    key_columns,
    key_payloads,
    late_message,
    ndjson_rows,
    session_keys,
    session_lines,
    split_windows,
    window_json,
    window_msgpack,
)
from shoal.processors.spec import PipelineSpec
from shoal.processors.state import ClosedWindows
from shoal.processors.versions import Chain, Stage
from shoal.rules import alert_payload
from shoal.runtime._fence import CheckpointLock
from shoal.runtime._heap import release_free_memory
from shoal.runtime._heartbeat import heartbeat_payload
from shoal.runtime._log_writer import LogWriter, shared_writer, write_atomically, write_now
from shoal.runtime._memory import usable_memory_bytes
from shoal.runtime._spill import partial_spill
from shoal.runtime._tasks import pause, supervised
from shoal.runtime.latency import LatencyHistogram
from shoal.schemas.control import MAX_MISSING, Confirm, GatewayStatus
from shoal.schemas.deadletter import DEADLETTER_HEADROOM, deadletter_message
from shoal.schemas.results import RETRACTED
from shoal.schemas.topics import Topics, topic_matches

log = logging.getLogger(__name__)

_Rendered = tuple[bytes, bytes | None]
"""A window's rows encoded ahead of its close: NDJSON lines, and the JSON array of them (None
when the pipeline publishes no JSON window message)."""

CHECKPOINT_FILE: Final = "combiner.ckpt"
CLOSE_LOG_FILE: Final = "combiner.closes"
"""The close log beside the checkpoint (``shoal.processors.close_log``); a versioned stage's
is ``combiner.closes.v<version>`` (``close_log_name``)."""
STATE_ROOT: Final = Path("var") / "combiner"
"""Where partitions keep their checkpoint folders unless told otherwise."""
KEY_SLICE: Final = 1_000
"""Per-key results published per slice (one ``publish_many``, about a millisecond), with the
event loop free in between."""
KEY_TOPICS: Final = 1_000_000
"""Per-key topics remembered at most (``_key_topic``; then forgotten and built again)."""
KEY_ENCODE_SLICE: Final = 20_000
"""Per-key results encoded per block (``key_messages``: one encoding per block, not per slice:
a sliding window's step gives every key a message)."""
LOCK_TIMEOUT_S: Final = 10.0
"""How long a hosted combiner waits for a deposed owner to finish its last checkpoint write."""
FUNCTION_REPORT_S: Final = 1.0
"""How often at most a partition dead-letters its failed UDAF calls (counts add up between)."""
INTAKE_BYTES: Final = 8 * 2**20
"""Received partials (wire bytes) that may wait to be applied; past it the combiner reads no
more from the broker until half is applied (``CombinerConfig.intake_bytes``)."""


@dataclass(frozen=True, slots=True)
class CombinerConfig:
    """How one combiner partition runs.

    Attributes:
        spec: the pipeline.
        partition: which partition (0-based).
        broker: where the broker is.
        topics: topic namespace.
        state_dir: where checkpoints live (None: no checkpoints, state is lost on exit;
            only for tests and throwaway demos).
        tick_ms: how often idle gateways and timers are looked at.
        heartbeat_ms: how often metrics are published.
        session_expiry_s: how long the broker keeps partials for a vanished combiner.
        per_key_results: publish the retained per-key result topics.
        hosted: run one ownership term for a combiner pool (see the module docstring);
            needs ``state_dir``.
        owner: the pool member hosting it (its heartbeat says so; None: pinned).
        version: the spec version (a pipeline deployed at run time; results name it).
        version_at_ms: when that version was made (the control plane's clock): an update
            switches at the first window boundary after it, or after what the partition
            has already applied (``shoal.processors.versions``).
        intake_bytes: received messages (wire bytes) that may wait to be applied. A
            combiner slower than its input (a backlog after a restart, overload) would
            otherwise queue every partial the broker sends it in memory; past this it stops
            reading until half is applied and the rest waits in the broker (its persistent
            session), bounded upstream by the gateways' end-to-end windows.
        receive_maximum: messages in flight to this partition (MQTT 5 Receive Maximum),
            each acknowledged once applied, and at most that many waiting to be applied
            (the session's ``max_buffered_messages``: Mosquitto 2.0.11 sends past a receive
            maximum once a client acknowledges). A pool combiner hosting many partitions
            keeps it small: a received message costs ~6 KB in the process (paho's
            ``Properties`` alone), times the partitions. None: the broker's default,
            acknowledged on receipt, bounded by ``intake_bytes`` only.
        host_ticks: the pool member ticks this partition (``CombinerRuntime.tick``, every
            ``tick_ms``), one timer for all the partitions it hosts instead of one each.
        memory_bytes: what the process may use (the machine's RAM, or its container's limit
            if lower): it sizes the state cap of a spec that sets no ``max_state_cells``
            (``PipelineSpec.state_cap``); None: not known, the fixed default.
    """

    spec: PipelineSpec
    partition: int
    broker: BrokerSettings
    topics: Topics = field(default_factory=Topics)
    state_dir: Path | None = None
    tick_ms: int = 100
    heartbeat_ms: int = 1_000
    session_expiry_s: int = 600
    per_key_results: bool = True
    hosted: bool = False
    owner: str | None = None
    version: int | None = None
    version_at_ms: int = 0
    intake_bytes: int = INTAKE_BYTES
    receive_maximum: int | None = None
    host_ticks: bool = False
    memory_bytes: int | None = field(default_factory=usable_memory_bytes)

    @property
    def client_id(self) -> str:
        """Stable per partition: a second instance takes the session over."""
        return rooted_client_id(self.topics, f"shoal-combiner-{self.spec.name}-{self.partition}")


def close_log_name(version: int | None) -> str:
    """The file name of a stage's close log beside the checkpoint (by its spec version)."""
    return CLOSE_LOG_FILE if version is None else f"{CLOSE_LOG_FILE}.v{version}"


def partition_state_dir(root: Path, pipeline: str, partition: int) -> Path:
    """A partition's checkpoint folder under ``root``, the same for a pinned and a hosted one.

    So a partition run by ``shoal combiner --pipeline`` can move to the pool and back.
    """
    return root / f"{pipeline}-{partition}"


def rooted_client_id(topics: Topics, name: str) -> str:
    """``name`` as a client id under the topic root, so deployments sharing a broker differ."""
    root = topics.root.replace("/", "-")
    return f"{root}-{name}" if root else name


@dataclass(slots=True, eq=False)  # identity: held in a set while it runs
class _KeyRun:
    """One per-key publication under way: its place in the order results were queued in."""

    seq: int


@dataclass(slots=True)
class _KeyPublications:
    """The per-key publications under way, and the results they were spared.

    The per-key topics are a latest-value cache: of two queued results of one key only the
    newer one's can stay retained, so publishing the older first is wasted work. When
    closes come faster than the per-key results go out (a sliding window's step under
    load), the publications under way drop the rows of keys a newer result has: they
    finish, at most about one window's results wait however long the overload lasts, and
    every key ends with the same retained value.

    Which result queued a key last is one dictionary (``latest``: key -> seq), filled only
    while runs are under way (a result queued when none is cannot supersede anything): a run
    keeps the rows whose key no later result queued. (It kept the keys of every result
    queued after it and concatenated them at each look-up: with session windows closing at
    every tick at 100,000 keys, each row its own session, many runs each re-joined the keys
    of all those after them, which took 70 % of the combiner and 2 GB; a polars frame of the
    latest seqs still spent half the combiner in per-result filters and joins.)
    """

    running: set[_KeyRun] = field(default_factory=set)
    superseded: int = 0
    """Per-key results not published because a newer one of the key was queued."""
    queued: int = 0
    """Results queued so far: the seq of the newest run."""
    latest: dict[str | None, int] = field(default_factory=dict)
    """Per key, the seq of the newest result queued with it while another run was under way."""

    def start(self, result: WindowResult) -> _KeyRun:
        """A publication of ``result``'s keys; they supersede the rows of those under way."""
        self.queued += 1
        if not self.running:
            self.latest.clear()
        else:
            frame = result.frame
            if RETRACTED in frame.columns:  # a retraction publishes nothing per key
                frame = frame.filter(pl.col(RETRACTED).is_null())
            self.latest.update(dict.fromkeys(frame["key"].to_list(), self.queued))
        run = _KeyRun(self.queued)
        self.running.add(run)
        return run

    def kept(self, run: _KeyRun, frame: pl.DataFrame) -> npt.NDArray[np.bool_] | None:
        """``run``'s rows of ``frame`` whose key no result queued after it has (None: all)."""
        if run.seq == self.queued:
            return None  # nothing queued after it
        keys = frame["key"].to_list()
        seqs = np.fromiter(map(self.latest.get, keys, repeat(0)), dtype=np.int64, count=len(keys))
        return seqs <= run.seq

    def finished(self, run: _KeyRun) -> None:
        """``run`` is done; with none under way the latest seqs are no longer needed."""
        self.running.discard(run)
        if not self.running:
            self.latest.clear()


def _whole_key_columns(
    result: WindowResult, pipeline: str, at_ms: int, lines: bytes | None
) -> tuple[bytes, list[str | None], list[bytes]] | None:
    """``key_columns`` of the whole window at once, from its rows as encoded (``lines``).

    None when they cannot serve: not encoded, or not one message per row of the frame in
    order (a session's retractions publish none; a session's rows have their own ends).
    """
    if lines is None or RETRACTED in result.frame.columns or "end" in result.frame.columns:
        return None
    return key_columns(result, pipeline, at_ms, lines)


def _block_columns(
    whole: tuple[bytes, list[str | None], list[bytes]],
    span: tuple[int, int],
    keep: npt.NDArray[np.bool_] | None,
) -> tuple[bytes, list[str | None], list[bytes]]:
    """Rows ``span`` of ``whole`` (``_whole_key_columns``), those ``keep`` keeps."""
    a, b = span
    head, keys, rests = whole[0], whole[1][a:b], whole[2][a:b]
    if keep is not None:
        kept = keep.tolist()
        keys, rests = list(compress(keys, kept)), list(compress(rests, kept))
    return head, keys, rests


class CombinerRuntime:
    """Runs one combiner partition until ``stop`` (see the module docstring).

    ``session_factory`` opens its intake session (default: ``default_intake_session_factory()``,
    whose read bound holds while the SUBSCRIBE of a resumed session waits beside the message
    loop: see ``_open_session``),
    ``output_session_factory`` the one it publishes on (default: ``session_factory`` when
    given, else ``default_output_session_factory()``). ``shared_outputs``: a hosted
    partition publishes on its pool member's one connection instead, through a lease that
    ends with the term (``shoal.broker.pooled``).
    """

    _beat_at: float = 0.0
    """With ``host_ticks``: when the next heartbeat is due (event-loop time)."""
    _checkpoint_at: float = math.inf
    """With ``host_ticks``: when the next periodic checkpoint is due (set when serving starts)."""

    def __init__(
        self,
        config: CombinerConfig,
        clock: Clock | None = None,
        *,
        session_factory: SessionFactory | None = None,
        log_writer: LogWriter | None = None,
        output_session_factory: SessionFactory | None = None,
        shared_outputs: PooledOutputs | None = None,
    ) -> None:
        self.config = config
        self._shared_outputs = shared_outputs
        self.clock = clock or SystemClock()
        self._connect = session_factory or default_intake_session_factory()
        self._log_writer = log_writer or shared_writer()
        self._log_written: asyncio.Future[None] | None = None
        """The last close-log write submitted (they complete in order)."""
        self._outputs: HeldSession | None = None
        """The outputs of the connection being served, held behind close-log writes."""
        self._log_failure: BaseException | None = None
        self._ticks_failed: asyncio.Future[None] | None = None
        """While serving with ``host_ticks``: fails with the error of a tick."""
        self._periodic: asyncio.Task[None] | None = None
        """With ``host_ticks``: the periodic checkpoint running now."""
        self._connect_outputs = output_session_factory or (
            session_factory or default_output_session_factory()
        )
        self.chain = self._new_chain()
        self._stop = asyncio.Event()
        self._unacked: list[asyncio.Future[None]] = []
        self._key_tasks: set[asyncio.Task[None]] = set()
        self.key_publications = _KeyPublications()
        self._confirmed: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._gaps: dict[str, set[int]] = {}
        self.gaps_reported = 0  # missing seqs named in confirmations (re-send hints)
        self.partials_unreadable = 0  # partials that did not decode (dropped, see _on_message)
        self.results_refused = 0  # result rows or messages no packet can carry (dead-lettered)
        self._over_cap_since: int | None = None  # partials refused in this over-cap episode
        # Rows of the windows the core finalised ahead of their close, by (window, start)
        self._rendered: tuple[pl.DataFrame, dict[tuple[str, int], _Rendered]] | None = None
        self._key_topics: dict[str | None, str] = {}
        """Per-key result topic of each key (``_publish_keys``): the same keys every step."""
        self.apply_latency = LatencyHistogram()
        self.result_latency = LatencyHistogram()
        self.checkpoints = 0
        self.checkpoints_skipped = 0
        self.last_checkpoint_ms: float | None = None
        self._activity = 0
        """Messages taken and ticks that changed something (``_idle_since_checkpoint``)."""
        self._checkpointed_activity = -1
        self.started_at = self.clock.monotonic()
        self._inputs = self._stage_inputs()
        self._writing: asyncio.Future[None] | None = None
        self._ended: list[Stage] = []  # retired stages whose logs the next checkpoint ends
        self.serving = False
        """Hosted: the session is ours, the checkpoint restored and the partials subscribed."""
        self.result_names: tuple[str, ...] = (config.spec.name,)
        """The names whose result topics get the window messages: the pipeline's own (unless
        its name was deleted while aliases share it) and its aliases' (set by the pool)."""
        self.deposed = False
        """Hosted: the term ended with the connection (taken over, or the broker went away)."""
        self._function_report_at = -FUNCTION_REPORT_S  # when failed UDAF calls were reported
        if config.state_dir is not None and not config.hosted:
            self._restore(config.state_dir / CHECKPOINT_FILE)

    @property
    def core(self) -> Combiner:
        """The current version's core (older versions finishing their windows: ``chain``)."""
        return self.chain.current.core

    def _new_chain(self) -> Chain:
        config = self.config
        doc = canonical_mapping(config.spec) if config.hosted else None
        core = Combiner(
            config.spec,
            config.partition,
            self.clock,
            logged=self._logged,
            spill=partial_spill,
            memory_bytes=config.memory_bytes,
        )
        return Chain(Stage(config.version, core, spec_doc=doc))

    @property
    def _logged(self) -> bool:
        """Whether closes go to the close log: a partition with a state folder.

        Pinned or hosted; a hosted partition keeps one log per stage of its chain.
        """
        return self.config.state_dir is not None

    def update(self, version: int, spec: PipelineSpec, at_ms: int) -> None:
        """Open a new spec version: it takes the windows from the next boundary on.

        The windows before the cut finish under the versions open now (``Chain.update``).
        """
        if spec.partitions != self.config.spec.partitions:
            raise UsageError("a new partition count cannot switch in place")
        if spec == self.config.spec:  # a new document version, not a new spec
            self.config = replace(self.config, version=version, version_at_ms=at_ms)
            return
        stage = self.chain.update(
            version,
            spec,
            self.clock,
            not_before_ms=at_ms,
            spec_doc=canonical_mapping(spec) if self.config.hosted else None,
        )
        self.config = replace(self.config, spec=spec, version=version, version_at_ms=at_ms)
        self._inputs = self._stage_inputs()
        self._rendered = None
        log.info(
            "combiner %s: v%d from window start %d on; earlier windows finish under v%s",
            self.config.client_id,
            version,
            stage.from_ms,
            ", v".join(str(v) for v in self.chain.versions[:-1]),
        )

    def _stage_inputs(self) -> list[str]:
        topics = self.config.topics
        return sorted({topics.under_root(f) for s in self.chain.stages for f in s.core.spec.inputs})

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Finish: take a last checkpoint and disconnect."""
        self._stop.set()

    def _subscriptions(self) -> list[str]:
        topics, spec = self.config.topics, self.config.spec
        return [
            topics.partials(spec.name, self.config.partition),
            topics.gateway_status_all(),
            topics.combiner_control(spec.name),
        ]

    async def run(self) -> None:
        """Connect, subscribe, combine until ``stop``; reconnect after broker failures."""
        if self.config.hosted:
            await self._run_term()
            return
        first = True
        try:
            while not self._stop.is_set():
                if not first:
                    # Outputs in flight on the lost connection may never have arrived, and
                    # partials applied since the last checkpoint are unconfirmed anyway: resume
                    # from the checkpoint (and the logs as written) and let the gateways re-send.
                    await self._logs_written()
                    self._reload()
                first = False
                session, outputs = self._open_session(), self._open_outputs()
                try:
                    async with session, outputs:
                        await self._serve_held(session, outputs)
                except BrokerError as exc:
                    if self._stop.is_set():
                        _stopped_without_checkpoint(self.config.client_id, exc)
                        break
                    log.warning("combiner %s: %s; reconnecting", self.config.client_id, exc)
                    await pause(0.5, self._stop)
                finally:
                    self._unacked.clear()
                    self._outputs = None
        finally:
            await self._logs_written()

    def _open_session(self) -> Session:
        """The partition's persistent intake session (its client id fences the partition).

        Partials, gateway statuses and control messages arrive here, at most
        ``intake_bytes`` of them waiting in memory (beyond, the session stops reading and
        TCP holds the broker back; with ``receive_maximum``, also at most that many
        messages, each acknowledged once applied). Everything the combiner publishes goes
        out on ``_open_outputs``: PUBACKs on this connection would wait behind the partials the
        broker has already written to it, so a checkpoint would wait for its results'
        PUBACKs as long as the backlog takes to apply (Mosquitto 2.0.11 writes a
        subscriber's whole queue at once, see docs/guarantees.md "Overload").

        The bound holds while the SUBSCRIBE of a resumed session waits for its SUBACK, which
        the broker writes after the backlog: the loop takes messages beside it
        (``_subscribe``; ``tests/integration/test_intake_bound.py``). The default intake is
        a ``BatchedSession``, as a hosted partition's is. (Until session 12 it was an
        ``AsyncSession``, whose gate then read on while any request waited, and a partition
        restarted during an overload took its whole backlog into memory.)
        """
        return self._connect(
            self.config.broker,
            self.config.client_id,
            clean_start=False,
            session_expiry_s=self.config.session_expiry_s,
            max_buffered_bytes=self.config.intake_bytes,
            receive_maximum=self.config.receive_maximum,
            manual_ack=self.config.receive_maximum is not None,
            max_buffered_messages=self.config.receive_maximum,
        )

    def _open_outputs(self) -> Session:
        """The session results, late rows, confirmations and heartbeats go out on.

        Its client id follows the intake's, so a second combiner for the partition takes
        this one over too. Clean: nothing is ever delivered to it. A hosted partition given
        its member's ``shared_outputs`` takes a lease on that connection instead: the lease
        ends with the term, and nothing published through it reaches the broker after that
        (``shoal.broker.pooled``), so the checkpoint lock, released after it, still orders a
        deposed owner's last publishes before the next owner's first.
        """
        if self._shared_outputs is not None:
            return self._shared_outputs.lease()
        return self._connect_outputs(self.config.broker, f"{self.config.client_id}-out")

    async def _run_term(self) -> None:
        """One ownership term: session, then lock, restore, serve; never reconnects."""
        state_dir = self.config.state_dir
        if state_dir is None:
            raise ConfigError(f"combiner {self.config.client_id}: hosting needs a state folder")
        lock = CheckpointLock(state_dir)
        session, outputs = self._open_session(), self._open_outputs()
        try:
            async with session, outputs:
                await lock.acquire(LOCK_TIMEOUT_S)
                self._reload_hosted(state_dir)
                await self._serve_held(session, outputs)
        except BrokerError as exc:
            if self._stop.is_set():
                _stopped_without_checkpoint(self.config.client_id, exc)
            else:
                self.deposed = True
                log.warning("combiner %s: term ended: %s", self.config.client_id, exc)
        finally:
            self.serving = False
            self._unacked.clear()
            self._outputs = None
            if self._writing is not None:
                # A checkpoint write in a thread outlives a cancelled task: the lock is only
                # given up once no write of this term can land after the next owner's.
                await asyncio.wait({self._writing})
            await self._logs_written()  # so do the close-log writes (the writer's thread)
            lock.release()

    async def _serve_held(self, session: Session, outputs: Session) -> None:
        """Serve, then a last checkpoint; every publish held until the log writes before it.

        What a close decides is published only once its log entry is written (and on disk,
        when it publishes anything): see ``_write_log``.
        """
        held = HeldSession(outputs)
        if self._log_written is not None:
            held.hold_until(self._log_written)
        self._outputs = held
        await self._serve(session, held)
        await self._checkpoint(held)

    def _reload_hosted(self, state_dir: Path) -> None:
        """Restore the newest checkpoint; one of another spec (a new version) is set aside."""
        path = state_dir / CHECKPOINT_FILE
        try:
            self._reload()
        except SchemaError as exc:
            if exc.reason != "checkpoint_mismatch":
                raise
            aside = path.with_name(f"{CHECKPOINT_FILE}.superseded")
            path.replace(aside)
            for closes in _log_files(state_dir):
                closes.replace(closes.with_name(f"{closes.name}.superseded"))
            log.warning(
                "combiner %s: checkpoint of another spec version set aside as %s; starting "
                "from empty state (gateways' unconfirmed batches are re-sent)",
                self.config.client_id,
                aside,
            )
            self._reload()

    async def _serve(self, session: Session, outputs: Session) -> None:
        """Take messages from ``session`` until stopped; publish on ``outputs``.

        Subscribing runs beside the loop: a persistent session's queued partials arrive
        before the SUBACK, and the loop must take them for the SUBACK to be read.
        """
        timers = (
            ()  # the pool member's timer drives them (``tick``)
            if self.config.host_ticks
            else (self._checkpointer(outputs), self._heartbeat(outputs))
        )
        try:
            async with supervised(
                self._stop, self._subscribe(session), self._ticker(outputs), *timers
            ) as ending:
                async for message in session.messages_until(ending):
                    self._on_message(outputs, message)
                    # With ``receive_maximum``: acknowledged once applied, in arrival order
                    # (flow control, not a confirmation: the checkpoint confirms a batch).
                    session.ack(message)
        finally:
            periodic, self._periodic = self._periodic, None
            if periodic is not None:
                periodic.cancel()
                await asyncio.wait({periodic})

    async def _subscribe(self, session: Session) -> None:
        """Subscribe (again: idempotent) until the broker confirms it.

        A resumed session's backlog is written to the connection before the SUBACK, which
        can then take longer than the client waits for it; the subscription stands in the
        session meanwhile, so try again. A lost connection ends the message loop, and this
        with it.
        """
        attempts = 1
        while True:
            try:
                await session.subscribe(self._subscriptions(), qos=1)
            except BrokerError as exc:
                log.warning(
                    "combiner %s: %s; subscribing again (attempt %d)",
                    self.config.client_id,
                    exc,
                    attempts + 1,
                )
                attempts += 1
                await asyncio.sleep(1.0)
                continue
            self.serving = True  # hosted: the pool may count this partition as served
            return

    # -- input -------------------------------------------------------------------------------

    def _on_message(self, session: Session, message: Message) -> None:
        self._activity += 1
        if message.topic.startswith(self.config.topics.gateway_status_all()[:-1]):
            self._on_status(session, message)
            return
        if message.topic == self.config.topics.combiner_control(self.config.spec.name):
            self._on_control(session, message)
            return
        received_ms = self.clock.now_ms()
        try:
            partial = Partial.decode(message.payload)
        except SchemaError as exc:
            # Counted (``partials_refused``) and dropped: the batch stays unconfirmed, so its
            # gateway sends it again.
            self.partials_unreadable += 1
            log.warning("combiner %s: unreadable partial dropped: %s", self.config.client_id, exc)
            return
        steps = self.chain.receive(partial)
        now = self.clock.now_ms()
        if log.isEnabledFor(logging.DEBUG):
            b = partial.batch
            log.debug(
                "partial %s/%d: sealed->worker %d ms, worker->combiner %d ms, apply %d ms",
                b.gateway_id,
                b.seq,
                partial.produced_at_ms - b.sent_at_ms,
                received_ms - partial.produced_at_ms,
                now - received_ms,
            )
        self._note_applied(steps, now)
        closing_since = self.clock.monotonic()
        closes = self.chain.close_ready(now)
        self._write_log()  # the closes decided, before anything they decide is published
        for stage, step in steps:
            self._publish_step(session, stage, step)
        for stage, closed in closes:
            self._emit(session, stage, closed, closing_since)
        self._report_function_failures(session)

    def _note_applied(self, steps: list[tuple[Stage, Step]], now: int) -> None:
        """Apply latency of each batch applied, whichever message unblocked it.

        Every open version applies every batch (its own or a stand-in): one stage's list counts
        each batch once.
        """
        sealed = max((step.sealed_at_ms for _, step in steps), key=len, default=[])
        for at in sealed:
            if at:
                self.apply_latency.add(now - at)

    def _on_status(self, session: Session, message: Message) -> None:
        if not message.payload:
            return  # a cleared retained status
        try:
            status = GatewayStatus.from_json(message.payload)
        except SchemaError as exc:
            log.warning("combiner: ignoring bad gateway status on %s: %s", message.topic, exc)
            return
        ingest = self.config.topics.ingest(status.stream, status.gateway_id)
        if not any(topic_matches(f, ingest) for f in self._inputs):
            return  # a gateway of a stream this pipeline does not read
        steps = self.chain.receive_status(status)
        self._note_applied(steps, self.clock.now_ms())
        self._write_log()
        for stage, step in steps:
            self._publish_step(session, stage, step)

    def _on_control(self, session: Session, message: Message) -> None:
        try:
            body = orjson.loads(message.payload)
            command = body.get("cmd")
        except (orjson.JSONDecodeError, AttributeError):
            body, command = {}, None
        if command == "flush":
            log.info("combiner %s: flushing every open window", self.config.client_id)
            flushed = [(stage, stage.core.flush_step()) for stage in self.chain.stages]
            self._write_log()
            started = len(self._unacked)
            for stage, step in flushed:
                self._publish_step(session, stage, step)
            reply = flush_reply_to(body)
            if reply is not None:
                windows = sum(_windows_in(step.closed) for _, step in flushed)
                task = asyncio.create_task(
                    self._confirm_flush(session, *reply, self._unacked[started:], windows)
                )
                self._key_tasks.add(task)
                task.add_done_callback(self._key_tasks.discard)
        elif command == "reset_stats":
            # Benchmarks measure steady state: forget the warm-up's latencies.
            self.apply_latency = LatencyHistogram()
            self.result_latency = LatencyHistogram()
        else:
            log.warning(
                "combiner %s: unknown control message %r",
                self.config.client_id,
                message.payload[:100],
            )

    async def _confirm_flush(
        self,
        session: Session,
        request_id: str,
        reply_to: str,
        outputs: list[asyncio.Future[None]],
        windows: int,
    ) -> None:
        """Tell ``shoal pipeline flush`` that this partition flushed (CONTRACT.md §21).

        Once what the flush published (its windows, late rows, alerts) is acknowledged by
        the broker, after its close-log entry is on disk: the reply says the results are
        there to be read.
        """
        try:
            await session.wait_published(outputs)
            reply = self.flush_confirmation(request_id, windows)
            await session.publish(self.config.topics.control(reply_to), reply)
        except (BrokerError, OSError) as exc:  # OSError: its close-log write failed
            log.warning(
                "combiner %s: flush %s not confirmed: %s", self.config.client_id, request_id, exc
            )

    def flush_confirmation(self, request_id: str, windows: int) -> bytes:
        """The ``flushed`` reply of this partition to flush ``request_id`` (CONTRACT.md §21)."""
        spec = self.config.spec
        return orjson.dumps(
            {
                "cmd": "flushed",
                "id": request_id,
                "pipeline": spec.name,
                "partition": self.config.partition,
                "partitions": spec.partitions,
                "combiner": self.config.client_id,
                "owner": self.config.owner,
                "version": self.config.version,
                "windows": windows,
                "at": self.clock.now_ms(),
            }
        )

    # -- output ------------------------------------------------------------------------------

    def _publish_step(
        self, session: Session, stage: Stage, step: Step, since: float | None = None
    ) -> None:
        self._refuse_over_cap(session, stage, step)
        for late in step.late:
            self._publish_late(session, late)
        for closed in step.replayed:
            self._emit(session, stage, closed, since)
        if step.closed is not None:
            self._emit(session, stage, step.closed, since)

    def _refuse_over_cap(self, session: Session, stage: Stage, step: Step) -> None:
        """Dead-letter the partials the core refused at the state cap; log once per episode.

        An episode begins with the first refusal and ends when a partial is applied again
        with none refused; its end is logged with how many it refused.
        """
        for partial, error in step.over_cap:
            if self._over_cap_since is None:
                self._over_cap_since = stage.core.counters.partials_over_cap - 1
                log.error("combiner %s: %s", self.config.client_id, error)
            else:
                log.debug("combiner %s: %s", self.config.client_id, error)
            self._deadletter(
                session,
                self.config.topics.partials(self.config.spec.name, self.config.partition),
                None,
                partial.encode(),
                error.as_record(),
                reason=StateCapError.reason,
            )
        if step.applied and not step.over_cap and self._over_cap_since is not None:
            refused = stage.core.counters.partials_over_cap - self._over_cap_since
            self._over_cap_since = None
            log.warning(
                "combiner %s: applying partials again (%d state cells held, max_state_cells "
                "%d) after refusing %d at the cap",
                self.config.client_id,
                stage.core.state_cells,
                stage.core.state_cap,
                refused,
            )

    def _report_function_failures(self, session: Session) -> None:
        """Dead-letter the UDAF calls that failed here since the last report (one per reason).

        At most every ``FUNCTION_REPORT_S``: a function stuck for an hour fails every call
        at once, and one record a second says as much as ten.

        The failure's state is NaN already (``processors.user_aggregates``): the windows it
        merged into publish that aggregate as null. The record has no payload (no input
        message failed: a merge or a finalize did); its error says which function, why and
        how many calls.
        """
        now = self.clock.monotonic()
        if now - self._function_report_at < FUNCTION_REPORT_S:
            return
        self._function_report_at = now
        for stage in self.chain.stages:
            guard = stage.core.functions
            if guard is None:
                continue
            for error, count in guard.take_failures():
                record = error.as_record()
                record["calls"] = count
                record["message"] = (
                    f"{count} call(s) of the pipeline's aggregate functions failed in combiner "
                    f"partition {self.config.partition} ({error}); the windows whose state "
                    "they merged or finalised publish those aggregates as null"
                )
                log.warning("combiner %s: %s", self.config.client_id, record["message"])
                self._deadletter(
                    session,
                    self.config.topics.partials(self.config.spec.name, self.config.partition),
                    None,
                    b"",
                    record,
                    reason=error.reason,
                )

    def _publish_late(self, session: Session, late: LateRows) -> None:
        payload = late_message(
            late, self.config.spec.name, self.config.partition, self.clock.now_ms()
        )
        self._unacked.append(
            session.publish_started(
                self.config.topics.late(self.config.spec.name),
                payload,
                content_type="application/json",
            )
        )

    def _emit(
        self,
        session: Session,
        stage: Stage,
        closed: ClosedWindows | None,
        since: float | None = None,
    ) -> None:
        """Publish one version's closed windows; ``since``: when closing began (monotonic s)."""
        if closed is None or closed.empty:
            self._publish_alerts(session, stage)
            return
        spec = stage.core.spec
        started = self.clock.now_ms()
        since = self.clock.monotonic() if since is None else since
        log.info(
            "combiner %s: closed %d rows in %.1f ms",
            self.config.client_id,
            closed.frame.height,
            (self.clock.monotonic() - since) * 1000.0,
        )
        ctx = Emission(
            spec.name,
            self.config.partition,
            spec.partitions,
            stage.core.closed_through,
            started,
            stage.version,
        )
        rendered = self._rendered_for(closed)
        # The per-key results of the sessions closed, published together once every window
        # message of the close is acknowledged (a task and an encoding per message cost the
        # combiner more than the close); not with corrections, nor for a message whose keys
        # were refused.
        together = (
            self.config.per_key_results
            and not closed.revisions
            and len(closed.sessions) == 1
            and RETRACTED not in closed.frame.columns
        )
        together_futures: list[asyncio.Future[None]] = []
        apart: set[tuple[str, int]] = set()
        for whole in split_windows(closed.frame, closed.revisions, closed.sessions):
            result = whole
            # the rows encoded once, for the window message and the per-key messages
            ahead = rendered.get((result.window, result.start))
            lines, array = (None, None) if ahead is None else ahead
            refused: set[str | None] = set()
            window_futures, lines = self._publish_window(
                session,
                result,
                ctx,
                encodings=spec.output_encodings,
                ahead=(lines, array),
                refused=refused,
                since=since,
            )
            if refused:  # the per-key messages would not fit either
                result = replace(result, frame=_without_keys(result.frame, refused))
                lines = None
            self._unacked.extend(window_futures)
            self._track_result_latency(window_futures, since)
            if together and result.window in closed.sessions:
                together_futures.extend(window_futures)
                if not refused:
                    continue
                apart.add((result.window, result.start))
            if self.config.per_key_results and spec.key_results_due(result.window, result.end):
                # A latest-value cache for dashboards, published in the background so the
                # window message's PUBACK (and the next partials) are not held up by
                # thousands of small publishes.
                run = self.key_publications.start(result)
                self._key_tasks.add(
                    asyncio.create_task(
                        self._publish_keys(
                            session, result, started, window_futures, run=run, lines=lines
                        )
                    )
                )
        if together:
            self._publish_session_keys(session, closed, started, together_futures, apart)
        self._publish_alerts(session, stage)

    def _rendered_for(self, closed: ClosedWindows) -> dict[tuple[str, int], _Rendered]:
        """The rows of ``closed``'s messages already encoded, by (window, start) (maybe none)."""
        rendered: dict[tuple[str, int], _Rendered] = {}
        if self._rendered is not None and self._rendered[0] is closed.frame:
            rendered = self._rendered[1]  # ahead of the close
        elif closed.sessions:
            # Session windows close many messages at once (each start is one): encoded at once.
            rendered = {
                k: (v, None) for k, v in session_lines(closed.frame, closed.sessions).items()
            }
        self._rendered = None
        return rendered

    def _publish_window(
        self,
        session: Session,
        result: WindowResult,
        ctx: Emission,
        *,
        encodings: Sequence[str],
        ahead: tuple[bytes | None, bytes | None],
        refused: set[str | None],
        since: float,
    ) -> tuple[list[asyncio.Future[None]], bytes | None]:
        """Start publishing one window's message(s) in each of ``encodings``, on every name.

        ``ahead``: its rows already encoded (NDJSON lines, JSON array), if they are. Keys no
        message can carry go to ``refused``. Returns the publications started and the rows as
        NDJSON (if JSON encoded them).
        """
        lines, array = ahead
        topics = self.config.topics
        futures: list[asyncio.Future[None]] = []
        for index, encoding in enumerate(encodings):
            # The same message on every name of the computation (aliases share it).
            here = [
                topics.results(n) if index == 0 else topics.results_encoded(n, encoding)
                for n in self.result_names
            ]
            encoding_since = self.clock.monotonic()
            rows = None
            if encoding == "json":
                if lines is None:
                    lines = ndjson_rows(result)
                rows = json_rows(result, lines) if array is None else array
            for payload, content_type in self._window_payloads(
                session, result, ctx, encoding, rows=rows, refused=refused, lines=lines
            ):
                if log.isEnabledFor(logging.DEBUG):
                    log.debug(
                        "combiner %s: window %s/%d: %s, %d bytes in %.1f ms, %.1f ms into close",
                        self.config.client_id,
                        result.window,
                        result.start,
                        encoding,
                        len(payload),
                        (self.clock.monotonic() - encoding_since) * 1000.0,
                        (self.clock.monotonic() - since) * 1000.0,
                    )
                for topic in here:
                    future = self._publish_result(session, topic, payload, content_type, result)
                    if future is not None:
                        futures.append(future)
        return futures, lines

    def _publish_session_keys(
        self,
        session: Session,
        closed: ClosedWindows,
        at_ms: int,
        after: list[asyncio.Future[None]],
        apart: set[tuple[str, int]],
    ) -> None:
        """The per-key results of a close's sessions in one publication (see ``_emit``).

        ``apart``: messages whose keys were published on their own (refused keys).
        """
        frame = closed.frame
        if apart:
            message = pl.concat_str(
                pl.col("window"), pl.col("start").cast(pl.String), separator="\0"
            )
            frame = frame.filter(~message.is_in([f"{w}\0{s}" for w, s in apart]))
        result = session_keys(frame, closed.sessions)
        if result is None:
            return
        run = self.key_publications.start(result)
        self._key_tasks.add(
            asyncio.create_task(self._publish_keys(session, result, at_ms, after, run=run))
        )

    def _publish_alerts(self, session: Session, stage: Stage) -> None:
        """Publish the alert transitions of the windows just closed (retained, QoS 1).

        Started in the same synchronous step as the window results, so the checkpoint that
        forgets those windows waits for their PUBACKs too (see the module docstring).
        """
        transitions = stage.core.take_transitions()
        if not transitions:
            return
        spec = stage.core.spec
        by_name = {a.name: a for a in spec.alerts}
        now = self.clock.now_ms()
        for transition in transitions:
            payload = alert_payload(
                transition,
                by_name[transition.alert],
                pipeline=spec.name,
                partition=self.config.partition,
                spec=stage.core.fingerprint,
                at_ms=now,
            )
            self._unacked.append(
                session.publish_started(
                    self.config.topics.alert(spec.name, transition.alert, transition.key),
                    payload,
                    content_type="application/json",
                    retain=True,
                )
            )

    def _window_payloads(
        self,
        session: Session,
        result: WindowResult,
        ctx: Emission,
        encoding: str,
        *,
        rows: bytes | None,
        refused: set[str | None],
        lines: bytes | None = None,
    ) -> list[tuple[bytes, str]]:
        """The window's message(s) in one encoding: one, or parts if it exceeds the limit.

        Rows no message can carry are dead-lettered once (over every encoding) and their
        keys added to ``refused``. ``lines``: the rows as NDJSON (``ndjson_rows``), which
        parts are cut and joined from without encoding them again.
        """
        budget = body_budget(session.max_packet_size)
        if encoding == "json":
            if rows is None:
                rows = json_rows(result)
            whole = len(rows)
            if budget is not None and whole > budget and lines is not None:
                split = split_result(result, budget, lines=lines.splitlines())
            else:
                split = split_result(result, budget, json_body_size, whole)
            if len(split.parts) == 1 and split.parts[0] is result:
                return [(window_json(result, ctx, rows), JSON_CONTENT_TYPE)]
        else:
            split = split_result(result, budget, msgpack_body_size)
        for row in split.oversized:
            if row.key not in refused:
                refused.add(row.key)
                self._refuse_row(session, result, row, budget or 0)
        if encoding == "json":
            bodies: list[bytes | None] = [None] * len(split.parts)
            if split.bodies is not None:
                bodies = [*split.bodies]
            return [
                (window_json(part, ctx, body), JSON_CONTENT_TYPE)
                for part, body in zip(split.parts, bodies, strict=True)
            ]
        return [(window_msgpack(part, ctx), MSGPACK_CONTENT_TYPE) for part in split.parts]

    def _publish_result(
        self, session: Session, topic: str, payload: bytes, content_type: str, result: WindowResult
    ) -> asyncio.Future[None] | None:
        """Start publishing one window message; one the broker can never take is dead-lettered.

        The split keeps every message under the limit; this is the guard that a refusal can
        never stop the combiner (retrying a message that cannot fit would freeze it).
        """
        try:
            return session.publish_started(topic, payload, content_type=content_type)
        except PayloadTooLargeError as exc:
            self.results_refused += 1
            log.error(  # noqa: TRY400 - expected and handled, the traceback says nothing
                "combiner %s: window %s/%d: %s",
                self.config.client_id,
                result.window,
                result.start,
                exc,
            )
            self._deadletter(
                session,
                topic,
                content_type,
                payload,
                {
                    "error": type(exc).__name__,
                    "reason": "result_too_large",
                    "code": "result_too_large",
                    "message": str(exc),
                },
            )
            return None

    def _refuse_row(
        self, session: Session, result: WindowResult, row: Oversized, budget: int
    ) -> None:
        """Dead-letter and count one key's row that no window message can carry."""
        error = ResultTooLargeError(
            window=result.window, start=result.start, key=row.key, size=row.size, limit=budget
        )
        self.results_refused += 1
        log.error("combiner %s: %s", self.config.client_id, error)
        self._deadletter(
            session,
            self.config.topics.results(self.config.spec.name),
            JSON_CONTENT_TYPE,
            json_rows(replace(result, frame=row.row)),
            error.as_record(),
        )

    def _deadletter(
        self,
        session: Session,
        topic: str,
        content_type: str | None,
        payload: bytes,
        error: dict[str, Any],
        *,
        reason: str = ResultTooLargeError.reason,
    ) -> None:
        limit = session.max_packet_size
        record = deadletter_message(
            pipeline=self.config.spec.name,
            topic=topic,
            content_type=content_type,
            payload=payload,
            error=error,
            worker=self.config.client_id,
            at_ms=self.clock.now_ms(),
            max_bytes=None if limit is None else limit - DEADLETTER_HEADROOM,
        )
        self._unacked.append(
            session.publish_started(
                self.config.topics.deadletter(self.config.spec.name),
                record,
                user_properties=[("reason", reason), ("code", reason)],
            )
        )

    async def _publish_keys(
        self,
        session: Session,
        result: WindowResult,
        at_ms: int,
        after: list[asyncio.Future[None]],
        *,
        run: _KeyRun,
        lines: bytes | None = None,
    ) -> None:
        # QoS 0 and no properties: a window can hold many thousands of keys, and the
        # authoritative copy is the window message (QoS 1, awaited before the checkpoint).
        # Only after that message is acknowledged, and in slices with the event loop free in
        # between, so neither the window result nor the next partials wait for them.
        # ``lines``: the rows as the window message encoded them (``ndjson_rows``).
        name = self.config.spec.name
        try:
            await asyncio.gather(*after, return_exceptions=True)
            whole = _whole_key_columns(result, name, at_ms, lines)
            for block in range(0, result.frame.height, KEY_ENCODE_SLICE):
                await asyncio.sleep(0)
                frame = result.frame.slice(block, KEY_ENCODE_SLICE)
                keep = self.key_publications.kept(run, frame)
                if keep is not None:  # keys a newer queued result has: not published
                    self.key_publications.superseded += len(keep) - int(keep.sum())
                    frame = frame.filter(pl.Series(keep))
                    if frame.height == 0:
                        continue
                if whole is not None:
                    head, keys, payloads = _block_columns(
                        whole, (block, block + KEY_ENCODE_SLICE), keep
                    )
                else:  # encoded a block at a time
                    head, messages = key_payloads(replace(result, frame=frame), name, at_ms)
                    keys = [k for k, _ in messages]
                    payloads = [p for _, p in messages]
                topics = self._key_topics_of(name, keys)
                for offset in range(0, len(keys), KEY_SLICE):
                    await asyncio.sleep(0)
                    if self._outputs is not session and self.config.hosted:
                        return  # the term ended: its outputs are closed
                    end = offset + KEY_SLICE
                    session.publish_columns(
                        topics[offset:end], payloads[offset:end], retain=True, head=head
                    )
        except BrokerError as exc:
            log.warning("combiner %s: per-key results interrupted: %s", self.config.client_id, exc)
        finally:
            self.key_publications.finished(run)
            task = asyncio.current_task()
            if task is not None:
                self._key_tasks.discard(task)

    def _key_topics_of(self, pipeline: str, keys: Sequence[str | None]) -> list[str]:
        """``_key_topic`` of each key: looked up in one pass in C (the same keys every step)."""
        topics = list(map(self._key_topics.get, keys))
        if None in topics:
            return [t or self._key_topic(pipeline, k) for k, t in zip(keys, topics, strict=True)]
        return topics  # type: ignore[return-value]

    def _key_topic(self, pipeline: str, key: str | None) -> str:
        """The retained per-key result topic of ``key`` (remembered: the same keys each step)."""
        topic = self._key_topics.get(key)
        if topic is None:
            if len(self._key_topics) >= KEY_TOPICS:
                self._key_topics.clear()
            topic = self._key_topics[key] = self.config.topics.result_key(pipeline, key)
        return topic

    def _track_result_latency(self, futures: list[asyncio.Future[None]], since: float) -> None:
        if not futures:
            return

        def done(fut: asyncio.Future[None]) -> None:
            if not fut.cancelled() and fut.exception() is None:
                elapsed_ms = (self.clock.monotonic() - since) * 1000.0
                self.result_latency.add(elapsed_ms)
                # DEBUG: a session close at 100,000 keys acknowledges hundreds of messages
                # (the figures are in the heartbeat's result_latency_ms).
                log.debug(
                    "combiner %s: window result acknowledged %.1f ms after closing began",
                    self.config.client_id,
                    elapsed_ms,
                )

        futures[0].add_done_callback(done)

    # -- timers ------------------------------------------------------------------------------

    async def _ticker(self, session: Session) -> None:
        """Tick every ``tick_ms``: a partition of its own (pinned).

        A pool member's partitions are ticked by the member, one timer for all of them
        (``tick``, ``CombinerConfig.host_ticks``); this then only waits for a failure of
        those ticks, to end the term with it.
        """
        if self.config.host_ticks:
            loop = asyncio.get_running_loop()
            self._beat_at = 0.0  # at once
            self._checkpoint_at = loop.time() + self.config.spec.checkpoint_interval_ms / 1000
            self._ticks_failed = loop.create_future()
            try:
                await self._ticks_failed
            finally:
                self._ticks_failed = None
            return
        while True:
            await asyncio.sleep(self.config.tick_ms / 1000)
            self._tick(session)

    def tick(self) -> None:
        """One tick of a pool member's partition (``CombinerConfig.host_ticks``).

        Does nothing unless the partition is serving a connection; a failure ends the term
        (as it would in a ticker of its own). The partition's heartbeat and periodic
        checkpoint are due from here too (``_host_timers``): no timer task of its own.
        """
        failed, session = self._ticks_failed, self._outputs
        if failed is None or failed.done() or session is None:
            return
        try:
            self._tick(session)
            self._host_timers(session)
        except Exception as exc:  # noqa: BLE001 - handed to the term, which ends with it
            failed.set_exception(exc)

    def _host_timers(self, session: Session) -> None:
        """A hosted partition's heartbeat and periodic checkpoint, when due (event-loop time).

        What the ``_heartbeat`` and ``_checkpointer`` tasks of a pinned partition do, without
        a task and a timer each (1,000 partitions: 2,000 fewer tasks and wake-ups a second).
        A checkpoint runs as a task while it runs (it waits for PUBACKs and the disk); the
        next is due an interval after the previous one was due, and not while one runs; a
        failure ends the term. The heartbeat is QoS 0: handed to the connection at once.

        Raises:
            BrokerError: the heartbeat could not be handed over (the connection is lost).
        """
        now = asyncio.get_running_loop().time()
        if now >= self._beat_at:
            self._beat_at = now + self.config.heartbeat_ms / 1000
            beat = session.publish_started(
                self._heartbeat_topic(), heartbeat_payload(self.metrics()), qos=0
            )
            if beat.done() and (exc := beat.exception()) is not None:
                raise exc
            beat.add_done_callback(ignore_outcome)  # held behind a close-log write, maybe
        if now >= self._checkpoint_at and self._periodic is None:
            self._checkpoint_at = now + self.config.spec.checkpoint_interval_ms / 1000
            if self._idle_since_checkpoint():
                self.checkpoints_skipped += 1
                return
            self._periodic = asyncio.create_task(self._periodic_checkpoint(session))

    async def _periodic_checkpoint(self, session: Session) -> None:
        """One periodic checkpoint of a hosted partition; a failure ends the term."""
        try:
            await self._checkpoint(session)
            release_free_memory()
        except Exception as exc:  # noqa: BLE001 - handed to the term, which ends with it
            failed = self._ticks_failed
            if failed is not None and not failed.done():
                failed.set_exception(exc)
        finally:
            if self._periodic is asyncio.current_task():
                self._periodic = None

    def _tick(self, session: Session) -> None:
        """Look at timers (idle gateways, holds, replays), close, retire, compact."""
        since = self.clock.monotonic()
        abandoned = self._replays_abandoned()
        steps = self.chain.tick()
        if any(st.applied or st.closed or st.replayed or st.late for _, st in steps):
            self._activity += 1
        self._note_applied(steps, self.clock.now_ms())
        self._write_log()
        if self._replays_abandoned() > abandoned:
            log.warning(
                "combiner %s: gave up re-taking logged closes: the gateways they wait "
                "for sent nothing for %d ms; running freely",
                self.config.client_id,
                self.config.spec.hold_bound_ms,
            )
        for stage, step in steps:
            self._publish_step(session, stage, step, since)
            if step.closed is None:
                self._emit(session, stage, None, since)  # alert transitions, if any
        retired = self.chain.retire()
        self._activity += len(retired)
        self._ended += [stage for stage, _ in retired]
        self._write_log()  # their last flush, before it is published
        for stage, closed in retired:
            self._emit(session, stage, closed, since)
            log.info(
                "combiner %s: v%s closed its last window (before %s)",
                self.config.client_id,
                stage.version,
                stage.until_ms,
            )
        self._report_function_failures(session)
        if self._unacked:
            self._unacked = [f for f in self._unacked if not f.done() or f.exception() is not None]
        # Merge pending state between messages once enough is pending (``tidy``: each
        # merge sorts the whole state); closing finds its windows finalised ahead.
        for stage in self.chain.stages:
            stage.core.state.tidy()
        self._render_ahead()

    def _render_ahead(self) -> None:
        """Encode the windows the core finalised ahead of their close, between messages.

        Both forms: the NDJSON lines (per-key messages) and the window message's JSON array
        (joining 10,000 rows' lines, ~1.5 ms at scenario B, was left to the close). At the
        close their message then only needs its header; a row that arrives for them
        meanwhile discards the finalised results, and the close encodes afresh.
        """
        frame = self.core.state.prepared_frame
        if frame is None or "json" not in self.config.spec.output_encodings:
            return
        if self._rendered is not None and self._rendered[0] is frame:
            return
        rendered: dict[tuple[str, int], _Rendered] = {}
        json = "json" in self.config.spec.output_encodings
        for result in split_windows(frame):
            lines = ndjson_rows(result)  # the per-key messages' rows
            array = json_rows(result, lines) if json else None
            rendered[result.window, result.start] = (lines, array)
        self._rendered = (frame, rendered)

    async def _checkpointer(self, session: Session) -> None:
        interval = self.config.spec.checkpoint_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            if self._idle_since_checkpoint():
                self.checkpoints_skipped += 1
                continue
            await self._checkpoint(session)
            # Once per checkpoint: what the partials and merges since the last one freed
            # goes back to the system instead of holding the process at its high-water mark.
            release_free_memory()

    def _idle_since_checkpoint(self) -> bool:
        """Whether a periodic checkpoint has nothing to add to the last one.

        Nothing taken (partial, status, control) and no tick that applied, closed or
        retired anything since the last checkpoint, no gap to report and no replay under
        way: the state is what the last checkpoint holds, up to what the passing of time
        changes (hold timers, idle gateways), which a restore re-derives as after any crash,
        and the decisions of the close log, which a restore re-takes. Skipping it spares
        the snapshot and its file's two flushes to disk: a pool combiner hosting 1,000 idle
        partitions wrote 1,000 checkpoints a second (about 12 ms each on a virtual disk).
        The checkpoint when the partition stops is never skipped.
        """
        return (
            self._activity == self._checkpointed_activity
            and not self._gaps
            and not self.chain.replaying
        )

    async def _checkpoint(self, session: Session) -> None:
        """Snapshot, wait for the outputs it relies on, persist, then confirm.

        While logged closes are re-taken no snapshot is taken (the checkpoint on disk and the
        close log still describe everything, and held batches must not be confirmed): only
        the restored checkpoint's seqs are confirmed, with the gaps that hold the replay up,
        so that their gateways re-send them at once.
        """
        if self.chain.replaying:
            await self._confirm(session, self.chain.confirmable(), self._lasting_gaps())
            return
        activity = self._activity
        snapshot: bytes | list[bytes | memoryview] | None = None
        if self.config.state_dir is not None:
            # Hosted: the chain, with each version's spec (it can outlive its document).
            # Pinned: the core's snapshot in pieces, its packed panes not copied into one.
            snapshot = self.chain.snapshot() if self.config.hosted else self.core.snapshot_parts()
        held = self.chain.stages if self.config.hosted else [self.chain.current]
        generations = [(stage, stage.core.close_log.generation) for stage in held]
        ended = list(self._ended)
        self._write_log()  # the snapshot's marks
        confirmable = self.chain.confirmable()
        missing = self._lasting_gaps()
        # The outputs stay listed until acknowledged: a checkpoint cancelled while waiting
        # (the periodic one, when the runtime stops) leaves them to the next, which must not
        # write a snapshot that no longer holds windows whose results never reached the broker.
        outputs = list(self._unacked)
        await session.wait_published(outputs)
        awaited = {id(f) for f in outputs}
        self._unacked = [f for f in self._unacked if id(f) not in awaited]
        # The snapshot's marks are in its logs before the snapshot exists.
        await self._logs_written()
        self._raise_log_failure()
        if snapshot is not None and self.config.state_dir is not None:
            if self._writing is not None and not self._writing.done():
                # One write at a time: a periodic checkpoint cancelled at stop leaves its thread
                # writing the same temporary file, and two writers would interleave into it
                # (and the second rename fail). Ours is the newer snapshot: it goes last.
                with contextlib.suppress(OSError):
                    await asyncio.shield(self._writing)
            self._writing = asyncio.ensure_future(
                asyncio.to_thread(
                    write_atomically, self.config.state_dir / CHECKPOINT_FILE, snapshot
                )
            )
            await asyncio.shield(self._writing)
            self.checkpoints += 1
            self.last_checkpoint_ms = self.clock.now_ms()
            self._checkpointed_activity = activity
            for stage, generation in generations:
                stage.core.close_log.settle(generation)
            self._write_log()
            self._forget_logs(ended, keep=held)
        await self._confirm(session, confirmable, missing)

    def _lasting_gaps(self) -> dict[str, tuple[int, ...]]:
        """Seqs missing now that were missing at the previous checkpoint too.

        A gap right after a reordering closes within moments; one that lasts a whole
        confirmation interval while later batches keep arriving is almost surely a loss
        (a broker queue overflowed, a worker died with the batch), and naming it lets the
        gateway re-send at once instead of after its stall timer.
        """
        now = self.chain.gaps(MAX_MISSING)
        before, self._gaps = self._gaps, {g: set(seqs) for g, seqs in now.items()}
        lasting = {}
        for gateway_id, seqs in now.items():
            seen = before.get(gateway_id, set())
            kept = tuple(s for s in seqs if s in seen)
            if kept:
                lasting[gateway_id] = kept
        self.gaps_reported += sum(len(s) for s in lasting.values())
        return lasting

    async def _confirm(
        self,
        session: Session,
        confirmable: dict[str, int],
        missing: dict[str, tuple[int, ...]],
    ) -> None:
        spec = self.config.spec
        now = self.clock.now_ms()
        futures = []
        # A gateway whose very first batch is the one missing has nothing confirmable yet,
        # and must still hear of the gap (seq -1): else it learns of it only from its stall
        # timer, whose backoff grows, and a share member that drops what it is dealt can
        # keep the gap open for minutes.
        for gateway_id in [*confirmable, *(g for g in missing if g not in confirmable)]:
            seq = confirmable.get(gateway_id, -1)
            gap = missing.get(gateway_id, ())
            if self._confirmed.get(gateway_id) == (seq, gap):
                continue
            confirm = Confirm(
                gateway_id, spec.name, self.config.partition, spec.partitions, seq, now, gap
            )
            topic = self.config.topics.confirm(gateway_id, spec.name, self.config.partition)
            futures.append(session.publish_started(topic, confirm.to_json(), retain=True))
            self._confirmed[gateway_id] = (seq, gap)
        await session.wait_published(futures)

    @property
    def partials_refused(self) -> int:
        """Partials refused: unreadable, or of another spec, partition or layout.

        Unreadable ones are counted since this process started; the core counts the others
        (``foreign_partials``, kept in checkpoints).
        """
        return self.partials_unreadable + self.core.counters.foreign_partials

    def _heartbeat_topic(self) -> str:
        return self.config.topics.metrics(
            "combiner", f"{self.config.spec.name}-{self.config.partition}"
        )

    async def _heartbeat(self, session: Session) -> None:
        while True:
            await session.publish(self._heartbeat_topic(), heartbeat_payload(self.metrics()), qos=0)
            await asyncio.sleep(self.config.heartbeat_ms / 1000)

    def metrics(self) -> dict[str, object]:
        """The heartbeat payload."""
        gateways = self.core.tracker.gateways
        return {
            "component": "combiner",
            "id": self.config.client_id,
            "pipeline": self.config.spec.name,
            "partition": self.config.partition,
            "owner": self.config.owner,
            "version": self.config.version,
            # every version still open: the windows it owns (older ones finishing theirs)
            "versions": [s.describe() for s in self.chain.stages],
            "at": self.clock.now_ms(),
            "uptime_s": round(self.clock.monotonic() - self.started_at, 3),
            "watermark": self.core.watermark(),
            "closed_through": self.core.closed_through,
            "gateways": len(gateways),
            "applied_through": {g: p.applied_through for g, p in gateways.items()},
            # per gateway: watermark, whether it holds, for how long it has kept others'
            # windows open, released, refused batches, clock offset (docs/guarantees.md)
            "gateway_progress": self.core.tracker.describe(self.clock.now_ms()),
            "max_hold_ms": self.config.spec.hold_bound_ms,
            "pending_batches": sum(len(p.pending) for p in gateways.values()),
            "pending_bytes": self.core.tracker.pending_weight,
            "spilled_batches": self.core.tracker.spilled,
            "spilled_total": self.core.tracker.spilled_total,
            "state_rows": self.core.state_cells,
            "max_state_cells": self.core.state_cap,
            # closed windows held for corrections (each for at most allowed_lateness_ms)
            "kept_windows": self.core.kept_windows(),
            "replaying": self.chain.replaying,
            "allowed_lateness_ms": self.config.spec.allowed_lateness_ms,
            "checkpoints": self.checkpoints,
            "gaps_reported": self.gaps_reported,
            "partials_refused": self.partials_refused,
            "results_refused": self.results_refused,
            "key_results_superseded": self.key_publications.superseded,
            "apply_latency_ms": self.apply_latency.summary(),
            "result_latency_ms": self.result_latency.summary(),
            **asdict(self.core.counters),
            **({"functions": functions} if (functions := self.functions_health()) else {}),
        }

    def functions_health(self) -> dict[str, dict[str, object]]:
        """The heartbeat's ``functions``: the pipeline's UDAF calls here (as a worker's).

        The current version's guard (an older version finishing its windows has its own).
        """
        guard = self.core.functions
        if guard is None:
            return {}
        return {self.config.spec.name: guard.health.as_dict(guard.degrade_after)}

    # -- checkpoints ---------------------------------------------------------------------------

    def _restore(self, path: Path) -> None:
        snapshot = path.read_bytes() if path.exists() else None
        try:
            self._restore_with(snapshot, self._read_log if self._logged else None)
        except SchemaError as exc:
            if exc.reason != "bad_log":
                raise
            log.warning(
                "combiner %s: a close log beside %s is unreadable (%s); restoring the "
                "checkpoint alone",
                self.config.client_id,
                path,
                exc,
            )
            self._restore_with(snapshot, (lambda _: None) if self._logged else None)
        self._inputs = self._stage_inputs()
        self._confirmed = {}
        self._write_log()  # the logs rewritten for the restored checkpoint
        log.info(
            "combiner %s: restored from %s, %d logged closes to re-take",
            self.config.client_id,
            path,
            self.chain.pending_closes,
        )

    def _restore_with(
        self, snapshot: bytes | None, logs: Callable[[int | None], bytes | None] | None
    ) -> None:
        """Restore the snapshot (a chain, or a pinned core's) and the closes logged after it.

        A pinned core's snapshot goes with ``combiner.closes`` (only a pinned partition
        writes one), a chain's stages with their own logs; with no snapshot yet, the current
        stage's log alone (closes decided before the first checkpoint).
        """
        self.chain = self._new_chain()
        chain = None
        if snapshot is not None:
            chain = Chain.restore(
                snapshot,
                self.config.partition,
                self.clock,
                _parse_canonical,
                logs=logs,
                spill=partial_spill,
                memory_bytes=self.config.memory_bytes,
            )
        if chain is not None:
            self.chain = chain
            self._catch_up(logs)
            return
        version = self.chain.current.version if snapshot is None else None
        logged = None if logs is None else logs(version)
        if snapshot is not None or logged is not None:
            self.core.restore(snapshot, logged)

    def _read_log(self, version: int | None) -> bytes | None:
        """A stage's close log file, if there is one."""
        assert self.config.state_dir is not None
        path = self.config.state_dir / close_log_name(version)
        return path.read_bytes() if path.exists() else None

    def _write_log(self) -> None:
        """Start writing every stage's new close-log entries; publishes started later wait.

        The order "a close's log entry written (on disk, when it publishes anything) before
        anything it decides is published" holds without waiting here: the writes go to the
        process's writer thread (``shoal.runtime._log_writer``, a group commit shared by
        every partition it hosts), and the outputs hold every publish started after a write
        until it is done (``HeldSession``); the checkpoint waits for them before its
        snapshot is written, and a term ends (the checkpoint lock released, or the logs read
        again after a reconnect) only once they are done. A write that failed ends the
        partition here (as the write done in line did): nothing it decided is published.

        Raises:
            OSError: an earlier close-log write failed.
        """
        if self.config.state_dir is None:
            return
        self._raise_log_failure()
        for stage in [*self.chain.stages, *self._ended]:
            write = stage.core.take_log()
            if write is not None:
                self._submit_log(self.config.state_dir / close_log_name(stage.version), write)

    def _submit_log(self, path: Path, write: LogWrite | None) -> None:
        """Hand ``write`` (None: delete the file) to the writer, after those before it."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a pinned partition restoring before its event loop runs
            if write is None:
                path.unlink(missing_ok=True)
            else:
                write_now(path, write)
            return
        writer = self._log_writer
        done = writer.unlink(path) if write is None else writer.submit(path, write)
        done.add_done_callback(self._log_done)
        self._log_written = done
        if self._outputs is not None:
            self._outputs.hold_until(done)

    def _log_done(self, done: asyncio.Future[None]) -> None:
        if self._log_failure is None and not done.cancelled():
            self._log_failure = done.exception()

    def _raise_log_failure(self) -> None:
        if self._log_failure is not None:
            raise self._log_failure

    async def _logs_written(self) -> None:
        """Wait until every close-log write submitted so far is done (failed or not)."""
        last = self._log_written
        if last is not None and not last.done():
            await asyncio.wait({last})

    def _forget_logs(self, ended: list[Stage], *, keep: list[Stage]) -> None:
        """Delete the logs of ended stages: the durable checkpoint no longer holds them."""
        assert self.config.state_dir is not None
        kept = {close_log_name(s.version) for s in keep}
        for stage in ended:
            self._ended.remove(stage)
            name = close_log_name(stage.version)
            if name not in kept:
                self._submit_log(self.config.state_dir / name, None)

    def _replays_abandoned(self) -> int:
        return sum(s.core.counters.replays_abandoned for s in self.chain.stages)

    def _catch_up(self, logs: Callable[[int | None], bytes | None] | None) -> None:
        """A restored chain older than the deployed version switches to it (``update``).

        One whose partition count differs cannot: it is refused like a checkpoint of another
        spec (``checkpoint_mismatch``), and the partition starts afresh. The new stage
        re-takes the closes its log holds (a version opened after the checkpoint).
        """
        current, config = self.chain.current, self.config
        if config.version is None or current.version is None or current.version >= config.version:
            return
        if current.core.spec.partitions != config.spec.partitions:
            raise SchemaError(
                "checkpoint was written for another partition count",
                reason="checkpoint_mismatch",
                expected=str(config.spec.partitions),
                found=str(current.core.spec.partitions),
            )
        stage = self.chain.update(
            config.version,
            config.spec,
            self.clock,
            not_before_ms=config.version_at_ms,
            spec_doc=canonical_mapping(config.spec),
        )
        logged = None if logs is None else logs(stage.version)
        if logged is not None:
            stage.core.restore(None, logged)

    def _reload(self) -> None:
        if self.config.state_dir is None:
            log.warning(
                "combiner %s runs without checkpoints: results in flight when the connection "
                "dropped may be lost",
                self.config.client_id,
            )
            return
        self._rendered = None
        self._ended = []
        self._restore(self.config.state_dir / CHECKPOINT_FILE)


def _stopped_without_checkpoint(client_id: str, exc: BrokerError) -> None:
    log.warning(
        "combiner %s: stopped before a last checkpoint was written and confirmed (%s): it "
        "resumes from the last one on disk, and the gateways re-send what that one does "
        "not confirm",
        client_id,
        exc,
    )


def _log_files(state_dir: Path) -> list[Path]:
    """The close logs in a partition's folder (every stage's; not those set aside)."""
    return [
        p
        for p in state_dir.glob(f"{CLOSE_LOG_FILE}*")
        if p.name == CLOSE_LOG_FILE or p.name.removeprefix(f"{CLOSE_LOG_FILE}.v").isdigit()
    ]


def flush_reply_to(body: dict[str, Any]) -> tuple[str, str] | None:
    """(request id, the client to answer on ``shoal/control/<client>``) of a flush command.

    None for a flush that asks for no answer (``shoal up``, the benchmarks), or whose
    ``reply`` is not one topic level (it could not name the asker's own topic).
    """
    request_id, reply_to = body.get("id"), body.get("reply")
    if not isinstance(request_id, str) or not isinstance(reply_to, str):
        return None
    if not reply_to or any(c in reply_to for c in "/+#"):
        log.warning("combiner: flush %s: reply %r is not one topic level", request_id, reply_to)
        return None
    return request_id, reply_to


def _windows_in(closed: ClosedWindows | None) -> int:
    """How many windows (window, start) a step closed."""
    if closed is None or closed.empty:
        return 0
    return closed.frame.select("window", "start").n_unique()


def _parse_canonical(mapping: dict[str, Any]) -> PipelineSpec:
    return canonicalize(mapping).spec


def _without_keys(frame: pl.DataFrame, keys: set[str | None]) -> pl.DataFrame:
    """``frame`` without the rows of ``keys`` (None: the null key)."""
    named = [k for k in keys if k is not None]
    drop = pl.col("key").is_in(named)
    if None in keys:
        drop = drop | pl.col("key").is_null()
    return frame.filter(~drop.fill_null(value=False))
