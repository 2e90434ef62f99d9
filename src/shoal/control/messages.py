"""The control plane's three messages: request, result, pipeline document (CONTRACT.md §22).

Pure. Each message is JSON with ``"v": 1``; decoding is strict and names what is wrong
(``ControlError`` with a reason code and a field path) so a refusal can be answered.
Schemas: ``pipeline-request``, ``pipeline-result`` and ``pipeline-document.schema.json``.
``Marker`` is how a client knows everything queued ahead of it has arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from shoal.errors import ControlError

VERSION: Final = 1
MAX_ID_CHARS: Final = 64
MAX_SPEC_BYTES: Final = 256 * 1024
"""A spec larger than this is refused before it is parsed."""

Op = Literal["deploy", "update", "delete"]
OPS: Final[tuple[Op, ...]] = ("deploy", "update", "delete")
Change = Literal["created", "updated", "unchanged", "deleted"]
State = Literal["deployed", "deleted"]


def _object(payload: bytes, what: str) -> dict[str, Any]:
    try:
        value = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise ControlError(f"{what} is not valid JSON: {exc}", reason="invalid_json") from exc
    if not isinstance(value, dict):
        raise ControlError(f"{what} must be a JSON object", reason="invalid_request")
    if value.get("v") != VERSION:
        raise ControlError(f"{what}: v must be {VERSION}", reason="invalid_request", field="v")
    return value


def _text(value: Any, key: str, what: str, *, limit: int) -> str:
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ControlError(
            f"{what}: {key} must be a non-empty string of at most {limit} characters",
            reason="invalid_request",
            field=key,
        )
    return value


@dataclass(frozen=True, slots=True)
class Request:
    """A client's request, on ``shoal/pipelines/_request/<client>``.

    Attributes:
        op: ``deploy`` (new name, or the same spec again), ``update`` (a deployed name, a new
            spec) or ``delete``.
        id: chosen by the client; the result carries it back.
        spec_toml: the spec as TOML text (deploy, update).
        name: the pipeline to delete (delete).
    """

    op: Op
    id: str
    spec_toml: str | None = None
    name: str | None = None

    def to_json(self) -> bytes:
        """The request's payload."""
        body: dict[str, Any] = {"v": VERSION, "op": self.op, "id": self.id}
        if self.spec_toml is not None:
            body["spec_toml"] = self.spec_toml
        if self.name is not None:
            body["name"] = self.name
        return orjson.dumps(body)

    @classmethod
    def from_json(cls, payload: bytes) -> Request:
        """Decode a request strictly.

        Raises:
            ControlError: ``invalid_json`` or ``invalid_request``, with the field at fault.
        """
        body = _object(payload, "request")
        unknown = sorted(set(body) - {"v", "op", "id", "spec_toml", "name"})
        if unknown:
            raise ControlError(
                f"request: unknown key(s) {unknown}", reason="invalid_request", field=unknown[0]
            )
        request_id = _text(body.get("id"), "id", "request", limit=MAX_ID_CHARS)
        op = body.get("op")
        if op not in OPS:
            raise ControlError(
                f"request: op must be one of {list(OPS)}, not {op!r}",
                reason="invalid_request",
                field="op",
            )
        if op == "delete":
            if "spec_toml" in body:
                raise ControlError(
                    "request: delete takes a name, not a spec",
                    reason="invalid_request",
                    field="spec_toml",
                )
            name = _text(body.get("name"), "name", "request", limit=128)
            return cls("delete", request_id, name=name)
        if "name" in body:
            raise ControlError(
                f"request: {op} takes the name from the spec, not a name key",
                reason="invalid_request",
                field="name",
            )
        spec = _text(body.get("spec_toml"), "spec_toml", "request", limit=MAX_SPEC_BYTES)
        return cls(op, request_id, spec_toml=spec)


@dataclass(frozen=True, slots=True)
class Result:
    """The control plane's answer, on ``shoal/pipelines/_reply/<client>``.

    Attributes:
        id: the request's id (None: the request was unreadable).
        ok: accepted (True) or refused.
        op: the request's op, if it could be read.
        name: the pipeline concerned, if known.
        version: the version now current (accepted), or the one in the way (``name_clash``).
        spec_hash: the content hash of the spec now current.
        change: what acceptance changed: ``created``, ``updated``, ``unchanged``, ``deleted``.
        reason: why it was refused (a stable code; None when accepted).
        field: the path of the spec or request field at fault (``""``: the whole spec).
        message: one line for people.
        alias_of: accepted as an alias: the pipeline whose computation it shares (the key
            is absent otherwise).
    """

    id: str | None
    ok: bool
    message: str
    op: str | None = None
    name: str | None = None
    version: int | None = None
    spec_hash: str | None = None
    change: Change | None = None
    reason: str | None = None
    field: str | None = None
    alias_of: str | None = None

    def to_json(self) -> bytes:
        """The result's payload (every key present but ``alias_of``; absent values are null)."""
        return orjson.dumps(self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        """The result as the JSON object it is sent as."""
        return {
            "v": VERSION,
            "id": self.id,
            "ok": self.ok,
            "op": self.op,
            "name": self.name,
            "version": self.version,
            "hash": self.spec_hash,
            "change": self.change,
            "reason": self.reason,
            "field": self.field,
            "message": self.message,
            **({} if self.alias_of is None else {"alias_of": self.alias_of}),
        }

    @classmethod
    def from_json(cls, payload: bytes) -> Result:
        """Decode a result (what the CLI waits for).

        Raises:
            ControlError: not a result (``invalid_result``).
        """
        try:
            body = _object(payload, "result")
            return cls(
                id=body["id"],
                ok=bool(body["ok"]),
                message=str(body["message"]),
                op=body["op"],
                name=body["name"],
                version=body["version"],
                spec_hash=body["hash"],
                change=body["change"],
                reason=body["reason"],
                field=body["field"],
                alias_of=body.get("alias_of"),
            )
        except (KeyError, ControlError) as exc:
            raise ControlError(f"not a control result: {exc}", reason="invalid_result") from exc


@dataclass(frozen=True, slots=True)
class PipelineDocument:
    """A pipeline as the registry keeps it, retained on ``shoal/pipelines/<name>``.

    A deleted pipeline keeps a retained tombstone (``state`` ``deleted``, no spec), so its
    version number keeps increasing if the name is deployed again, across restarts.

    Attributes:
        name: the pipeline.
        version: 1 for the first deploy; +1 on every update, delete and re-deploy.
        state: ``deployed`` or ``deleted``.
        spec_hash: the content hash of the canonical spec (``canonical.spec_hash``).
        spec: the canonical spec mapping (None once deleted).
        changed_at_ms: when this version was made (the control plane's clock).
        alias_of: this name shares the computation of that pipeline (the same spec, name
            aside): no workers, partitions or state of its own; its results are the
            computation's, published on its topics too (docs/architecture.md, "Sharing").
        released: the name was deleted while aliases still share its computation: it goes on
            computing for them, under this name's topics, without results on this name.
    """

    name: str
    version: int
    state: State
    spec_hash: str | None
    spec: dict[str, Any] | None
    changed_at_ms: int
    alias_of: str | None = None
    released: bool = False

    @property
    def computes(self) -> bool:
        """Whether workers and combiners run this document's pipeline (not an alias)."""
        return self.deployed and self.alias_of is None

    @property
    def named(self) -> bool:
        """Whether the name is deployed for its users (not deleted, not released)."""
        return self.deployed and not self.released

    @property
    def deployed(self) -> bool:
        """Whether the pipeline is deployed (not a tombstone)."""
        return self.state == "deployed"

    def as_dict(self) -> dict[str, Any]:
        """The document as the JSON object it is retained as."""
        return {
            "v": VERSION,
            "name": self.name,
            "version": self.version,
            "state": self.state,
            "hash": self.spec_hash,
            "spec": self.spec,
            "changed_at_ms": self.changed_at_ms,
            **({} if self.alias_of is None else {"alias_of": self.alias_of}),
            **({"released": True} if self.released else {}),
        }

    def to_json(self) -> bytes:
        """The retained payload."""
        return orjson.dumps(self.as_dict())

    @classmethod
    def from_json(cls, payload: bytes) -> PipelineDocument:
        """Decode a retained document.

        Raises:
            ControlError: not a pipeline document (``invalid_document``).
        """
        try:
            body = _object(payload, "pipeline document")
            name, version, state, spec, changed = (
                body["name"],
                body["version"],
                body["state"],
                body["spec"],
                body["changed_at_ms"],
            )
        except (KeyError, ControlError) as exc:
            raise ControlError(
                f"not a pipeline document: {exc}", reason="invalid_document"
            ) from exc
        alias_of, released = body.get("alias_of"), body.get("released", False)
        ok = (
            (alias_of is None or (isinstance(alias_of, str) and alias_of != name))
            and type(released) is bool
            and isinstance(name, str)
            and state in ("deployed", "deleted")
            and type(version) is int
            and version >= 1
            and type(changed) is int
            and (spec is None) == (state == "deleted")
            and (spec is None or isinstance(spec, dict))
        )
        if not ok:
            raise ControlError(
                "not a pipeline document: bad name, state, version, spec or time",
                reason="invalid_document",
            )
        return cls(name, version, state, body.get("hash"), spec, changed, alias_of, released)


@dataclass(frozen=True, slots=True)
class Marker:
    """A marker a client publishes to its own control topic, to learn what came before it.

    The broker sends the retained messages of a SUBSCRIBE ahead of anything published later
    on the same connection, so once the marker comes back every retained document has
    arrived (the service's restore, ``shoal pipeline list``, a pool combiner joining); and
    it is queued behind the deliveries already queued for the client, so a worker knows when
    nothing more can arrive under a subscription it left (draining, retiring a pipeline
    version). Its payload is a ``control`` message (``{"cmd": "marker", "token": ...}``,
    CONTRACT.md §21).

    Attributes:
        topic: the client's own control topic (``Topics.control``).
        payload: the marker's bytes, with a token of its own.
    """

    topic: str
    payload: bytes

    @classmethod
    def on(cls, topic: str, token: str) -> Marker:
        """The marker with ``token`` (random, so an old one is never taken for it)."""
        return cls(topic, orjson.dumps({"cmd": "marker", "token": token}))

    def is_back(self, topic: str, payload: bytes) -> bool:
        """Whether a message on ``topic`` with ``payload`` is this marker come back."""
        return topic == self.topic and payload == self.payload
