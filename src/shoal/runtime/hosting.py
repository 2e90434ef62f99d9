"""The combiner pool: one process hosting the partitions of every deployed pipeline.

``shoal combiner`` without ``--pipeline`` runs a ``CombinerHost``. Over one connection of its
own it follows the retained pipeline documents (``shoal.control.follower``) and the pool's
membership (``shoal/combiners/+``, ``shoal.control.assignment.Announcement``), announces
itself there (retained, on its outputs connection, whose Will clears it when the process
dies), and computes which partitions it owns (rendezvous hashing over the live members).
Each owned partition runs as a ``CombinerRuntime`` term (``CombinerConfig.hosted``) over that
partition's own persistent intake session (a ``BatchedSession``), whose client id is derived
from (root, pipeline, partition), and publishes on the member's one outputs connection
(``PooledOutputs``) through a lease that ends with the term. The member's one timer ticks
every partition and makes its heartbeat and periodic checkpoint due (``CombinerRuntime.tick``).

Exactly one owner at a time (docs/architecture.md, "The combiner pool"):

* the **broker fences** the partition: a second CONNECT with its client id takes the session
  over (queued partials move with it) and closes the previous owner's intake connection,
  which ends its term;
* the **checkpoint lock** (``_fence``) makes the new owner restore only after the deposed one
  finished its last write, and no deposed writer overwrite the new owner's checkpoint; the
  deposed term releases it only after its outputs lease ended (nothing it published can
  reach the broker after that, ``shoal.broker.pooled``), and the new owner publishes nothing
  before it holds the lock: a deposed owner's last publishes come before the next owner's
  first;
* the **assignment** decides who should own: a deposed term is started again only if the
  host still owns the partition after ``retry_ms`` (no ping-pong once views agree), and a
  partition another live member still lists is taken only after it let go or after
  ``handover_ms`` (a member that joins lets the previous owner finish with a checkpoint).

Takeover after a death: the Will fires when the broker notices (at once for a killed process
on the same host, else within 1.5 x keepalive), the survivors recompute, and the new owner
connects, takes the lock (the kernel released it with the dead process) and restores.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from shoal._futures import ignore_outcome
from shoal.broker import (
    default_intake_session_factory,
    default_output_session_factory,
    default_session_factory,
)
from shoal.broker.pooled import PooledOutputs
from shoal.broker.session import Message, Session, SessionFactory, Will
from shoal.broker.settings import BrokerSettings
from shoal.clock import Clock, SystemClock
from shoal.control.assignment import Announcement, Owned, Slot, owned_by
from shoal.control.follower import DocumentFollower, Dropped, Served
from shoal.control.messages import Marker
from shoal.errors import BrokerError, ControlError
from shoal.processors.spec import PipelineSpec
from shoal.runtime._tasks import pause, supervised
from shoal.runtime.combiner import (
    STATE_ROOT,
    CombinerConfig,
    CombinerRuntime,
    partition_state_dir,
    rooted_client_id,
)
from shoal.schemas.topics import Topics

log = logging.getLogger(__name__)

TICKS_PER_TURN = 50
"""Partitions ticked before the member's timer lets the event loop run other work (``_ticks``)."""
ANNOUNCED_PER_TICK = 100
"""Partitions an announcement may list and still go out at every tick (``_announce``)."""
MARKS = ".members"
"""The folder in ``state_dir`` where each member leaves a mark (``_check_shared_state``)."""
ANNOUNCE_ACK_S = 120.0
"""How long an announcement may wait for its PUBACK before the membership reconnects."""
MEMBERSHIP_RECEIVE_MAXIMUM = 16
"""Documents and announcements that may wait for the membership loop (the session's
``max_buffered_messages``: 1,000 retained documents arrive at once on joining)."""


def _default_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class HostConfig:
    """How a pool combiner runs.

    Attributes:
        broker: where the broker is.
        topics: topic namespace.
        state_dir: the shared checkpoint root; partition ``k`` of pipeline ``p`` keeps its
            checkpoint in ``<state_dir>/<p>-<k>`` (as ``shoal combiner --pipeline`` does), so
            whichever member takes a partition over must see the same folder.
        combiner_id: this member's id (default: host name and pid); unique among live members.
        tick_ms: how often ownership is recomputed and the partitions look at timers (all of
            them from one timer, ``_ticks``).
        heartbeat_ms: how often the announcement is refreshed (and runtimes' heartbeats).
        retry_ms: after a term ended on its own (deposed, broker gone), wait this long
            before starting the partition again, if still owned.
        handover_ms: how long to wait for another live member to let go of a partition this
            one now owns (it stops that partition with a last checkpoint), before taking it.
        session_expiry_s: how long the broker keeps a partition's partials while it has no
            owner.
        per_key_results: publish the retained per-key result topics.
        receive_maximum: messages in flight to each hosted partition, acknowledged once
            applied: with many partitions in one process, what they have not applied yet
            waits in the broker, so the process's memory does not grow with a backlog. Kept
            small: a received message costs ~6 KB in the process (paho's ``Properties``
            alone), times the partitions hosted.
        shared_state_grace_ms: how long another live member's mark may be missing from
            ``state_dir`` before this member reports the folder as not shared with it
            (``_check_shared_state``).
    """

    broker: BrokerSettings
    topics: Topics = field(default_factory=Topics)
    state_dir: Path = STATE_ROOT
    combiner_id: str = field(default_factory=_default_id)
    tick_ms: int = 100
    heartbeat_ms: int = 1_000
    retry_ms: int = 1_000
    handover_ms: int = 3_000
    session_expiry_s: int = 600
    per_key_results: bool = True
    receive_maximum: int = 2
    shared_state_grace_ms: int = 10_000

    @property
    def client_id(self) -> str:
        """The membership connection's client id (not a partition's)."""
        return rooted_client_id(self.topics, f"shoal-combiner-pool-{self.combiner_id}")


@dataclass(slots=True)
class _Term:
    """A partition this member runs now: its runtime, task and spec version."""

    runtime: CombinerRuntime
    task: asyncio.Task[None]
    version: int
    stopping: bool = False


@dataclass(slots=True)
class HostCounters:
    """What a pool combiner counts (kept in process; neither announced nor published yet)."""

    terms_started: int = 0
    terms_deposed: int = 0
    terms_failed: int = 0
    announcements_refused: int = 0
    unshared_state: int = 0
    """Live members whose mark never appeared in our ``state_dir`` (``_check_shared_state``)."""


class CombinerHost:
    """Hosts the partitions this member owns (see the module docstring)."""

    def __init__(
        self,
        config: HostConfig,
        clock: Clock | None = None,
        *,
        session_factory: SessionFactory | None = None,
    ) -> None:
        """Configure; ``run`` joins the pool."""
        self.config = config
        self.clock = clock or SystemClock()
        self._connect = session_factory or default_session_factory()
        self._connect_intake = session_factory or default_intake_session_factory()
        self.outputs = PooledOutputs(
            session_factory or default_output_session_factory(),
            config.broker,
            f"{config.client_id}-out",
            will=Will(config.topics.pool_combiner(self.me), b"", qos=1, retain=True),
        )
        """The one connection every hosted partition publishes on (``shoal.broker.pooled``);
        the member's announcements go out on it too, and its Will clears them."""
        self.follower = DocumentFollower(config.topics)
        self.deployed: dict[str, tuple[int, PipelineSpec]] = {}
        self._made_at: dict[str, int] = {}  # name -> when its current version was made
        self.names: dict[str, tuple[str, ...]] = {}
        """Computation -> the names its results are published under (its own, aliases)."""
        self.members: dict[str, Announcement] = {}
        self.terms: dict[Slot, _Term] = {}
        self.counters = HostCounters()
        self.ready = asyncio.Event()
        """Set once the retained documents and announcements have arrived (marker back)."""
        self._stop = asyncio.Event()
        self._retry_at: dict[Slot, float] = {}
        self._wanted_since: dict[Slot, float] = {}
        self._announced: tuple[Owned, ...] | None = None
        self._announced_at = 0.0
        self._announcing: tuple[float, asyncio.Future[None]] | None = None
        self._own: tuple[bytes, Announcement] | None = None
        """Our last announcement, as sent: when it comes back it is not parsed again (1,000
        partitions: 100 kB of JSON every second)."""
        self._marker: Marker | None = None
        self._state_seen: dict[str, float | None] = {}
        """Other members: when first seen without their mark in our state folder (None:
        checked, found or reported)."""

    @property
    def me(self) -> str:
        """This member's id."""
        return self.config.combiner_id

    def stop(self) -> None:
        """Leave: stop every partition with a last checkpoint, clear the announcement."""
        self._stop.set()

    def owns(self) -> tuple[Owned, ...]:
        """The partitions this member serves now (session taken, checkpoint restored).

        A partition being let go of stays listed until its last checkpoint is written and
        confirmed and its connection closed: a joining member waits for that (up to
        ``handover_ms``) instead of taking the session in the middle of it.
        """
        return tuple(
            Owned(
                name,
                partition,
                term.runtime.config.spec.partitions,
                term.version,
                term.runtime.chain.versions,
            )
            for (name, partition), term in sorted(self.terms.items())
            if term.runtime.serving
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Join the pool and host partitions until ``stop``; reconnect after broker failures.

        Partition terms run over their own sessions and outlive a lost membership connection.
        """
        topics = self.config.topics
        presence = topics.pool_combiner(self.me)
        ticking = asyncio.create_task(self._ticks())
        publishing = asyncio.create_task(self.outputs.run())
        try:
            while not self._stop.is_set():
                session = self._connect(
                    self.config.broker,
                    self.config.client_id,
                    receive_maximum=MEMBERSHIP_RECEIVE_MAXIMUM,
                    max_buffered_messages=MEMBERSHIP_RECEIVE_MAXIMUM,
                )
                try:
                    async with session:
                        await self._join(session)
                        async with supervised(self._stop, self._reconciler()) as ending:
                            async for message in session.messages_until(ending):
                                self._on_message(message)
                        if self._stop.is_set():
                            await self._end_terms()
                            outputs = self.outputs.current  # after its announcements
                            if outputs is not None:
                                await outputs.publish(presence, b"", qos=1, retain=True)
                except BrokerError as exc:
                    if self._stop.is_set():
                        break
                    log.warning("combiner pool %s: %s; reconnecting", self.me, exc)
                    await pause(0.5, self._stop)
        finally:
            await self._end_terms()
            ticking.cancel()
            publishing.cancel()  # after the terms: their leases have ended
            await asyncio.gather(ticking, publishing, return_exceptions=True)

    async def _ticks(self) -> None:
        """Tick every partition this member runs, every ``tick_ms``: one timer for all.

        A ticker task per partition cost 1,000 timers and task switches every ``tick_ms``
        at 1,000 partitions. Independent of the membership connection (the partitions
        outlive it); the loop is given back every ``TICKS_PER_TURN`` partitions.
        """
        while True:
            await asyncio.sleep(self.config.tick_ms / 1000)
            for done, term in enumerate(list(self.terms.values()), 1):
                term.runtime.tick()
                if done % TICKS_PER_TURN == 0:
                    await asyncio.sleep(0)

    async def _join(self, session: Session) -> None:
        topics = self.config.topics
        self.ready.clear()
        # Members that left while we were away are no longer retained: start the view afresh
        # from what the SUBSCRIBE delivers (ownership waits for the marker).
        self.members.clear()
        self._marker = Marker.on(topics.control(self.config.client_id), os.urandom(8).hex())
        await session.subscribe(
            [topics.pool_combiners(), topics.pipeline_documents(), self._marker.topic], qos=1
        )
        await session.publish(self._marker.topic, self._marker.payload, qos=1)
        self._announced = None  # announce again on the new connection
        self._announcing = None
        log.info("combiner pool %s: joined (state in %s)", self.me, self.config.state_dir)
        marks = self.config.state_dir / MARKS
        marks.mkdir(parents=True, exist_ok=True)
        (marks / self.me).write_text(self.me)

    async def _end_terms(self) -> None:
        for term in self.terms.values():
            term.stopping = True
            term.runtime.stop()
        tasks = [term.task for term in self.terms.values()]
        await asyncio.gather(*tasks, return_exceptions=True)
        self.terms.clear()

    # -- input -------------------------------------------------------------------------------

    def _on_message(self, message: Message) -> None:
        topics = self.config.topics
        if self._marker is not None and self._marker.is_back(message.topic, message.payload):
            self.ready.set()
        elif self.follower.is_document(message.topic):
            change = self.follower.take(message)
            if isinstance(change, Served):
                self.deployed[change.name] = (change.version, change.spec)
                document = self.follower.registry.get(change.name)
                self._made_at[change.name] = 0 if document is None else document.changed_at_ms
            elif isinstance(change, Dropped):
                self.deployed.pop(change.name, None)
            if change is not None:
                self.names = self._result_names()
        elif message.topic.startswith(topics.pool_combiners()[:-1]):
            member = message.topic.rsplit("/", 1)[-1]
            if not message.payload:
                if self.members.pop(member, None) is not None:
                    log.info("combiner pool %s: member %s left", self.me, member)
                return
            own = self._own
            try:
                if own is not None and member == self.me and message.payload == own[0]:
                    announcement = own[1]
                else:
                    announcement = Announcement.from_json(message.payload)
            except ControlError as exc:
                self.counters.announcements_refused += 1
                log.warning("combiner pool %s: %s on %s", self.me, exc, message.topic)
                return
            if member not in self.members:
                log.info("combiner pool %s: member %s present", self.me, member)
            self.members[member] = announcement

    # -- ownership ---------------------------------------------------------------------------

    async def _reconciler(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_ms / 1000)
            if self.ready.is_set():
                self._check_shared_state()
                self.reconcile()
                self._announce()

    def _check_shared_state(self) -> None:
        """Report a live member whose ``state_dir`` is not ours (once, as an ERROR).

        A partition taken over restores the checkpoint its previous owner wrote, so every
        member must see the same folder (a network or shared mount across hosts). Each member
        leaves a mark there when it joins (``MARKS``/<id>); one whose mark does not appear in
        ours within ``shared_state_grace_ms`` writes elsewhere, and a takeover between us
        would start from nothing.
        """
        now = self.clock.monotonic()
        grace_s = self.config.shared_state_grace_ms / 1000
        for member in self.members:
            if member == self.me:
                continue
            since = self._state_seen.setdefault(member, now)
            if since is None:
                continue
            if (self.config.state_dir / MARKS / member).exists():
                self._state_seen[member] = None
            elif now - since >= grace_s:
                self._state_seen[member] = None
                self.counters.unshared_state += 1
                log.error(
                    "combiner pool %s: member %s does not share the state folder %s (its mark "
                    "is not there after %g s): a partition taken over between us would start "
                    "from an empty checkpoint; give every member the same --state-dir",
                    self.me,
                    member,
                    self.config.state_dir,
                    grace_s,
                )

    def reconcile(self) -> None:
        """End terms this member no longer owns (or of an old version); start owned ones."""
        now = self.clock.monotonic()
        partitions = {name: spec.partitions for name, (_, spec) in self.deployed.items()}
        wanted = owned_by(self.me, self.members, partitions)
        for slot, term in list(self.terms.items()):
            if term.task.done():
                self._ended(slot, term, now)
                continue
            current = self.deployed.get(slot[0])
            term.runtime.result_names = self.names.get(slot[0], (slot[0],))
            if not term.stopping and current is not None and current[0] > term.version:
                self._update(slot, term, *current)
            if not term.stopping and (
                slot not in wanted or current is None or current[0] != term.version
            ):
                log.info("combiner pool %s: letting go of %s/%d", self.me, *slot)
                term.stopping = True
                term.runtime.stop()
        self._wanted_since = {s: self._wanted_since.get(s, now) for s in wanted}
        for slot in sorted(wanted - self.terms.keys()):
            if self._retry_at.get(slot, 0.0) > now:
                continue
            held_by = [m for m, a in self.members.items() if m != self.me and _lists(a, slot)]
            if held_by and now - self._wanted_since[slot] < self.config.handover_ms / 1000:
                continue  # the previous owner is stopping it with a last checkpoint
            self._start(slot)

    def _result_names(self) -> dict[str, tuple[str, ...]]:
        registry = self.follower.registry
        aliases = registry.aliases()  # one pass: this runs on every document change
        out = {}
        for document in registry.deployed():
            if document.computes:
                own = () if document.released else (document.name,)
                out[document.name] = (*own, *aliases.get(document.name, ()))
        return out

    def _update(self, slot: Slot, term: _Term, version: int, spec: PipelineSpec) -> None:
        """Switch a running partition to a new version at its next window boundary.

        Its windows before the cut finish under the old version, in the same term. A new
        partition count cannot switch in place: the term is let go of, and the next one
        starts afresh (docs/architecture.md, "Updates").
        """
        if not term.runtime.serving or spec.partitions != term.runtime.config.spec.partitions:
            return
        term.runtime.update(version, spec, self._made_at.get(slot[0], 0))
        term.version = version

    def _ended(self, slot: Slot, term: _Term, now: float) -> None:
        del self.terms[slot]
        if term.task.cancelled():
            return
        failure = term.task.exception()
        if failure is not None:
            self.counters.terms_failed += 1
            log.error("combiner pool %s: %s/%d failed: %r", self.me, *slot, failure)
        elif term.runtime.deposed:
            self.counters.terms_deposed += 1
        if not term.stopping or failure is not None:
            self._retry_at[slot] = now + self.config.retry_ms / 1000

    def _start(self, slot: Slot) -> None:
        name, partition = slot
        version, spec = self.deployed[name]
        config = CombinerConfig(
            spec,
            partition,
            self.config.broker,
            self.config.topics,
            state_dir=partition_state_dir(self.config.state_dir, name, partition),
            tick_ms=self.config.tick_ms,
            heartbeat_ms=self.config.heartbeat_ms,
            session_expiry_s=self.config.session_expiry_s,
            per_key_results=self.config.per_key_results,
            hosted=True,
            owner=self.me,
            version=version,
            version_at_ms=self._made_at.get(name, 0),
            receive_maximum=self.config.receive_maximum,
            host_ticks=True,
        )
        runtime = CombinerRuntime(
            config, self.clock, session_factory=self._connect_intake, shared_outputs=self.outputs
        )
        self.terms[slot] = _Term(runtime, asyncio.create_task(runtime.run()), version)
        self.counters.terms_started += 1
        log.info("combiner pool %s: taking %s/%d v%d", self.me, name, partition, version)

    def _announce(self) -> None:
        """Publish the announcement when ``announcement_due`` says so, on the outputs connection.

        On the outputs connection, whose Will clears it: an announcement can then only be
        retained while the connection that will clear it is open, and a dead member's
        partitions are taken over only once the broker has read everything that connection
        carried (its results and confirmations come before the Will). None goes out while it
        is being reopened.

        Not awaited in line: on a loaded member (1,000 partitions on a shared machine) a
        PUBACK took longer than a publish's timeout. A new one goes out once the previous one
        is acknowledged; one that fails is sent again, and one that waits longer than
        ``ANNOUNCE_ACK_S`` resets the outputs connection (its Will fires, its partitions end
        and start again).
        """
        now = self.clock.monotonic()
        if self._announcing is not None:
            sent_at, previous = self._announcing
            if not previous.done():
                if now - sent_at > ANNOUNCE_ACK_S:
                    self.outputs.reset(f"no PUBACK for an announcement within {ANNOUNCE_ACK_S} s")
                    self._announcing, self._announced = None, None
                return
            self._announcing = None
            if previous.cancelled() or previous.exception() is not None:
                self._announced = None  # lost with its connection: announce again
        outputs = self.outputs.current
        if outputs is None:
            return
        owns = self.owns()
        if not announcement_due(
            changed=owns != self._announced,
            since_s=now - self._announced_at,
            listed=len(owns),
            tick_s=self.config.tick_ms / 1000,
            heartbeat_s=self.config.heartbeat_ms / 1000,
        ):
            return
        announcement = Announcement(self.me, self.clock.now_ms(), owns)
        payload = announcement.to_json()
        self._own = (payload, announcement)
        topic = self.config.topics.pool_combiner(self.me)
        started = outputs.publish_started(topic, payload, qos=1, retain=True)
        started.add_done_callback(ignore_outcome)  # a failure at stop is no error
        self._announcing = (now, started)
        self._announced, self._announced_at = owns, now


def announcement_due(
    *, changed: bool, since_s: float, listed: int, tick_s: float, heartbeat_s: float
) -> bool:
    """Whether a member announces now, ``since_s`` after its last announcement.

    When what it owns ``changed``, at the next tick; else every heartbeat. But a large
    announcement (every pool worker and member parses it) goes out at most once per tick per
    ``ANNOUNCED_PER_TICK`` partitions it lists: 1,000 partitions starting are announced
    once a second (100 kB each time), not ten times.
    """
    if not changed and since_s < heartbeat_s:
        return False
    return since_s >= tick_s * (listed // ANNOUNCED_PER_TICK)


def _lists(announcement: Announcement, slot: Slot) -> bool:
    return any((o.pipeline, o.partition) == slot for o in announcement.owns)
