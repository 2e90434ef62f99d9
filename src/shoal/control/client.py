"""What ``shoal pipeline`` does on the wire: send a request and wait for its result; read documents.

``request`` subscribes to its own reply topic, publishes the request (QoS 1: a user the
broker's ACL does not allow gets PUBACK "not authorized", reported as ``not_authorized``; so
is a refused reply subscription, which some brokers answer where Mosquitto grants and filters),
and waits for the result with the request's id, or raises ``ControlError`` (``timeout``)
when no control plane answers. ``documents`` reads the retained pipeline documents, with a
marker to its own control topic to know when all of them have arrived. ``served`` waits
until a pool worker's heartbeat (``shoal/metrics/worker/<id>``, CONTRACT.md §19.1) lists a
pipeline at a version, which it only does once it holds that version's handler and its
SUBSCRIBE was granted. ``owned`` waits until the pool combiners' retained announcements
(``shoal/combiners/<id>``, ``shoal.control.assignment``) list every partition of a pipeline
at a version, which they do only once each partition's session is taken and its checkpoint
restored.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from shoal.broker.session import SessionFactory, unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.control.assignment import Announcement
from shoal.control.messages import Marker, PipelineDocument, Request, Result
from shoal.errors import BrokerError, ControlError
from shoal.schemas.topics import Topics, topic_matches

DEFAULT_TIMEOUT_S: Final = 10.0


class ControlClient:
    """Requests to the control plane and reads of the registry, each over a short session."""

    def __init__(
        self,
        settings: BrokerSettings,
        topics: Topics,
        *,
        session_factory: SessionFactory | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Configure; every call opens and closes its own session."""
        if session_factory is None:
            from shoal.broker import default_session_factory  # noqa: PLC0415 - lazy seam

            session_factory = default_session_factory()
        self.settings = settings
        self.topics = topics
        self.session_factory = session_factory
        self.timeout_s = timeout_s

    async def request(self, request: Request) -> Result:
        """Send ``request`` and return the control plane's result (accepted or refused).

        Raises:
            ControlError: ``not_authorized`` (the broker refused the request) or ``timeout``.
            BrokerError: the broker cannot be reached.
        """
        client = unique_client_id("shoal-pipeline")
        user = self.settings.username or "(anonymous)"
        async with self.session_factory(self.settings, client) as session:
            # A broker may refuse the reply subscription of a user who may not read it (Mochi
            # does; Mosquitto grants it and delivers nothing): the publish still tells whether
            # the user may write requests, which is what an operator needs to hear first.
            unread: BrokerError | None = None
            try:
                await session.subscribe([self.topics.pipeline_reply(client)], qos=1)
            except BrokerError as exc:
                if not _not_authorized(exc):
                    raise
                unread = exc
            try:
                await session.publish(
                    self.topics.pipeline_request(client), request.to_json(), qos=1
                )
            except BrokerError as exc:
                if _not_authorized(exc):
                    raise ControlError(
                        f"the broker refused the request: user {user} may not write the "
                        "control topics (admin role only)",
                        reason="not_authorized",
                    ) from exc
                raise
            if unread is not None:
                raise ControlError(
                    f"the broker refused the reply subscription: user {user} may not read "
                    "the control topics (admin role only); the request was sent",
                    reason="not_authorized",
                ) from unread
            with _deadline(self.timeout_s) as stop:
                async for message in session.messages_until(stop):
                    result = Result.from_json(message.payload)
                    if result.id == request.id:
                        return result
        raise ControlError(
            f"no control plane answered within {self.timeout_s:g} s on {self.settings.url} "
            f"(topic root {self.topics.root or '(none)'!r}); is `shoal control` running?",
            reason="timeout",
        )

    async def documents(self) -> list[PipelineDocument]:
        """Every retained pipeline document (tombstones too), by name.

        Raises:
            ControlError: the marker did not come back in time (``timeout``).
        """
        client = unique_client_id("shoal-pipeline")
        marker = Marker.on(self.topics.control(client), os.urandom(8).hex())
        found: dict[str, PipelineDocument] = {}
        async with self.session_factory(self.settings, client) as session:
            await session.subscribe([self.topics.pipeline_documents(), marker.topic], qos=1)
            await session.publish(marker.topic, marker.payload, qos=1)
            with _deadline(self.timeout_s) as stop:
                async for message in session.messages_until(stop):
                    if marker.is_back(message.topic, message.payload):
                        return sorted(found.values(), key=lambda d: d.name)
                    if message.payload and topic_matches(
                        self.topics.pipeline_documents(), message.topic
                    ):
                        document = PipelineDocument.from_json(message.payload)
                        found[document.name] = document
        raise ControlError(
            f"could not read the pipeline documents within {self.timeout_s:g} s "
            f"on {self.settings.url}",
            reason="timeout",
        )

    async def served(self, name: str, version: int, *, timeout_s: float | None = None) -> list[str]:
        """The pool workers serving ``name`` at ``version`` or later, once one reports it.

        Waits for heartbeats (a pool worker sends one as soon as what it serves changes);
        returns the first worker that reports the version, with any others seen so far.

        Raises:
            ControlError: no pool worker reported it within ``timeout_s`` (``not_served``).
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        client = unique_client_id("shoal-pipeline")
        workers: dict[str, bool] = {}
        async with self.session_factory(self.settings, client) as session:
            # workers report guarded batches, combiners their UDAF merge/finalize calls
            await session.subscribe(
                [self.topics.metrics("worker", "+"), self.topics.metrics("combiner", "+")], qos=0
            )
            with _deadline(timeout_s) as stop:
                async for message in session.messages_until(stop):
                    worker, serves = _serves(message.payload, name, version)
                    if worker is not None:
                        workers[worker] = serves
                    if serves:
                        break
        found = sorted(w for w, serves in workers.items() if serves)
        if found:
            return found
        seen = f"{len(workers)} pool worker(s) seen" if workers else "no pool worker seen"
        raise ControlError(
            f"pipeline {name!r} v{version} is stored, but no pool worker reported serving it "
            f"within {timeout_s:g} s ({seen}); is `shoal worker` (without --pipeline) running?",
            reason="not_served",
        )

    async def function_health(self, listen_s: float) -> dict[str, dict[str, Any]]:
        """Per pipeline with user functions: each worker's and combiner's report, and degraded.

        From the ``functions`` of the worker and combiner heartbeats heard over ``listen_s``
        (CONTRACT.md §19.1, §19.2).
        """
        client = unique_client_id("shoal-pipeline")
        latest: dict[str, dict[str, Any]] = {}
        async with self.session_factory(self.settings, client) as session:
            # workers report guarded batches, combiners their UDAF merge/finalize calls
            await session.subscribe(
                [self.topics.metrics("worker", "+"), self.topics.metrics("combiner", "+")], qos=0
            )
            with _deadline(listen_s) as stop:
                async for message in session.messages_until(stop):
                    with contextlib.suppress(orjson.JSONDecodeError):
                        body = orjson.loads(message.payload)
                        if isinstance(body, dict) and isinstance(body.get("functions"), dict):
                            latest[str(body.get("id"))] = body["functions"]
        out: dict[str, dict[str, Any]] = {}
        for worker, functions in sorted(latest.items()):
            for pipeline, health in functions.items():
                entry = out.setdefault(pipeline, {"degraded": False, "workers": {}})
                entry["workers"][worker] = health
                entry["degraded"] = entry["degraded"] or bool(health.get("degraded"))
        return out

    async def owned(
        self, name: str, version: int, *, timeout_s: float | None = None
    ) -> dict[int, str]:
        """Partition -> pool combiner, once every partition of ``name`` is owned.

        Owned at ``version`` or later.

        Raises:
            ControlError: not every partition was owned within ``timeout_s`` (``not_owned``).
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        client = unique_client_id("shoal-pipeline")
        members: dict[str, Announcement] = {}
        owners: dict[int, str] = {}
        partitions: int | None = None
        async with self.session_factory(self.settings, client) as session:
            await session.subscribe([self.topics.pool_combiners()], qos=1)
            with _deadline(timeout_s) as stop:
                async for message in session.messages_until(stop):
                    member = message.topic.rsplit("/", 1)[-1]
                    try:
                        members[member] = Announcement.from_json(message.payload)
                    except ControlError:
                        members.pop(member, None)  # gone (cleared), or not an announcement
                    owners, partitions = _owners(members, name, version)
                    if partitions is not None and len(owners) == partitions:
                        return owners
        seen = f"{len(members)} pool combiner(s) seen" if members else "no pool combiner seen"
        have = f"{len(owners)} of {partitions}" if partitions is not None else "no"
        raise ControlError(
            f"pipeline {name!r} v{version} is stored, but {have} partitions were owned within "
            f"{timeout_s:g} s ({seen}); is `shoal combiner` (without --pipeline) running?",
            reason="not_owned",
        )

    async def flush(self, name: str, *, wait: bool = True) -> Flushed:
        """Ask every combiner partition of ``name`` to close its open windows now.

        An alias flushes the computation it shares. The command is the combiners' own
        (``shoal/control/combiners/<pipeline>``, ``{"cmd": "flush"}``, CONTRACT.md §21),
        published with QoS 1, with an ``id`` and this client as ``reply``: each partition
        answers on ``shoal/control/<client>`` (``flushed``) once what the flush published is
        acknowledged by the broker. ``wait`` (default): return once every partition answered,
        or after the timeout with those that did (``Flushed.missing`` names the others: a
        partition without an owner, or whose combiner is behind).

        Raises:
            ControlError: ``name`` is not deployed (``unknown_pipeline``), or ``timeout``.
        """
        documents = {d.name: d for d in await self.documents() if d.deployed}
        document = documents.get(name)
        if document is None or not document.named:
            raise ControlError(f"pipeline {name!r} is not deployed", reason="unknown_pipeline")
        computation = document.alias_of or name
        spec = (documents.get(computation) or document).spec or {}
        partitions = int(spec.get("partitions", 1))
        client = unique_client_id("shoal-pipeline")
        request_id = os.urandom(8).hex()
        flushed = Flushed(document, computation, partitions, request_id)
        async with self.session_factory(self.settings, client) as session:
            reply_topic = self.topics.control(client)
            if wait:
                await session.subscribe([reply_topic], qos=1)
            command = {"cmd": "flush"}
            if wait:
                command |= {"id": request_id, "reply": client}
            await session.publish(
                self.topics.combiner_control(computation), orjson.dumps(command), qos=1
            )
            if not wait:
                return flushed
            with _deadline(self.timeout_s) as stop:
                async for message in session.messages_until(stop):
                    reply = _flushed(message.payload, request_id)
                    if reply is not None and 0 <= reply["partition"] < partitions:
                        flushed.replies[reply["partition"]] = reply
                    if len(flushed.replies) == partitions:
                        return flushed
        return flushed  # not every partition answered in time: ``Flushed.missing``

    async def drain(
        self, workers: list[str] | None = None, *, quiet_s: float = 2.0
    ) -> dict[str, str]:
        """Drain pool workers (all those seen, or ``workers``): each leaves without losing a batch.

        Sends each the ``drain`` command (its own control topic, CONTRACT.md §21): it leaves
        every group, handles what the broker had queued for it, acknowledges and disconnects.
        Done for a worker once it has not beaten for ``quiet_s`` since the command (a worker
        beats every ``heartbeat_ms``, 1 s by default, until it leaves; a draining one says
        ``draining``), or its Will said ``gone``. Returns worker -> ``drained``.

        Raises:
            ControlError: no pool worker seen (``no_workers``), or not every one finished
                within the timeout (``not_drained``).
        """
        client = unique_client_id("shoal-pipeline")
        loop = asyncio.get_running_loop()
        last: dict[str, tuple[str, float]] = {}  # worker -> (state, when)
        async with self.session_factory(self.settings, client) as session:
            # workers report guarded batches, combiners their UDAF merge/finalize calls
            await session.subscribe(
                [self.topics.metrics("worker", "+"), self.topics.metrics("combiner", "+")], qos=0
            )
            with _deadline(min(self.timeout_s, 2.5)) as stop:  # a beat of every worker
                async for message in session.messages_until(stop):
                    beat = _beat(message.payload)
                    if beat is not None:
                        last[beat[0]] = (beat[1], loop.time())
            pool = sorted(w for w, (state, _) in last.items() if state != "gone")
            targets = pool if workers is None else workers
            if not targets:
                raise ControlError("no pool worker seen", reason="no_workers")
            for worker in targets:
                command = orjson.dumps({"cmd": "drain"})
                await session.publish(self.topics.control(worker), command, qos=1)
            drained: dict[str, str] = {}
            asked = loop.time()
            while loop.time() - asked < self.timeout_s:
                with _deadline(0.2) as tick:  # a drained worker is known by its silence
                    async for message in session.messages_until(tick):
                        if (beat := _beat(message.payload)) is not None:
                            last[beat[0]] = (beat[1], loop.time())
                now = loop.time()
                for worker in targets:
                    state, at = last.get(worker, ("", asked))
                    if state == "gone" or now - max(at, asked) >= quiet_s:
                        drained[worker] = "drained"
                if len(drained) == len(targets):
                    return drained
        left = sorted(set(targets) - set(drained))
        raise ControlError(
            f"pool worker(s) {left} did not finish draining within {self.timeout_s:g} s "
            f"(last heartbeat states: { {w: last.get(w, ('none', 0.0))[0] for w in left} })",
            reason="not_drained",
        )


@dataclass
class Flushed:
    """What ``flush`` asked and heard: the partitions' ``flushed`` replies, by partition."""

    document: PipelineDocument
    computation: str
    partitions: int
    request_id: str
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def missing(self) -> list[int]:
        """The partitions that did not answer (yet)."""
        return sorted(set(range(self.partitions)) - self.replies.keys())

    @property
    def windows(self) -> int:
        """Windows the flush published, over the partitions that answered."""
        return sum(int(r.get("windows", 0)) for r in self.replies.values())

    def as_dict(self) -> dict[str, Any]:
        """What ``shoal pipeline flush --json`` prints (with ``ok``)."""
        return {
            "name": self.document.name,
            "computation": self.computation,
            "id": self.request_id,
            "partitions": self.partitions,
            "windows": self.windows,
            "confirmed": {
                str(p): {k: r.get(k) for k in ("combiner", "owner", "version", "windows", "at")}
                for p, r in sorted(self.replies.items())
            },
        }


def _flushed(payload: bytes, request_id: str) -> dict[str, Any] | None:
    """A partition's ``flushed`` reply to ``request_id``; None for anything else."""
    try:
        body: Any = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if (
        not isinstance(body, dict)
        or body.get("cmd") != "flushed"
        or body.get("id") != request_id
        or not isinstance(body.get("partition"), int)
    ):
        return None
    return body


def _beat(payload: bytes) -> tuple[str, str] | None:
    """(worker id, state) of a pool worker's heartbeat or Will; None for anything else."""
    try:
        body: Any = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or body.get("component") != "worker":
        return None
    if body.get("state") != "gone" and not isinstance(body.get("serving"), dict):
        return None  # a pinned worker
    return str(body.get("id")), str(body.get("state"))


def _not_authorized(exc: BrokerError) -> bool:
    """Whether the broker refused a publish or subscribe as not authorized (0x87)."""
    return "authori" in str(exc).lower()


@contextlib.contextmanager
def _deadline(timeout_s: float) -> Iterator[asyncio.Event]:
    """An event set after ``timeout_s``: the end of a ``messages_until`` loop."""
    stop = asyncio.Event()
    timer = asyncio.get_running_loop().call_later(timeout_s, stop.set)
    try:
        yield stop
    finally:
        timer.cancel()


def _owners(
    members: dict[str, Announcement], name: str, version: int
) -> tuple[dict[int, str], int | None]:
    """(partition -> owner at ``version`` or later, the partition count those owners name)."""
    owners: dict[int, str] = {}
    partitions: int | None = None
    for member, announcement in sorted(members.items()):
        for owned in announcement.owns:
            if owned.pipeline == name and owned.version >= version:
                owners[owned.partition] = member
                partitions = owned.partitions
    return owners, partitions


def _serves(payload: bytes, name: str, version: int) -> tuple[str | None, bool]:
    """(pool worker id or None, whether it serves ``name`` at ``version`` or later)."""
    try:
        body: Any = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None, False
    if not isinstance(body, dict) or not isinstance(body.get("serving"), dict):
        return None, False  # a pinned worker, a will, or not a heartbeat
    current = body["serving"].get(name)
    return str(body.get("id")), type(current) is int and current >= version
