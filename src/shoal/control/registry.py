"""The registry of deployed pipelines: requests in, results and documents out. Pure.

``Registry.decide`` answers a request without changing anything: a refused ``Result``, or an
accepted one with the ``PipelineDocument`` to retain. The service publishes the document,
waits for the broker's PUBACK, and only then calls ``Registry.commit`` and sends the result,
so an accepted answer always means "stored on the broker".

Rules (issue 15, item 7: bad input changes nothing):

* ``deploy``: a new name gets version 1 (or the tombstone's version + 1); the same spec
  again is accepted ``unchanged``; a different spec under a deployed name is refused
  ``name_clash`` (use ``update``).
* ``update``: a deployed name gets the new spec as version + 1 (the same spec: ``unchanged``);
  an unknown name is refused ``unknown_pipeline``.
* ``delete``: a deployed name becomes a tombstone at version + 1; an unknown or already
  deleted name is refused ``unknown_pipeline``.
* An invalid spec is refused with ``invalid_toml``, ``invalid_spec`` or
  ``unknown_aggregate`` and the field path (``ConfigError.field``, as the validator names it).

Sharing (identical specs, name aside): a deploy (or an update) whose content hash equals a
running computation under another name becomes an **alias** of it (``alias_of``): no second
subscription group, no second state; its results are the computation's, published on the
alias's topics too. The reference count of a computation is its own name (unless released)
plus its aliases. Updating a shared computation is refused ``shared`` (its aliases asked for
the spec it runs: deploy the new spec under another name). Deleting an alias tombstones it;
deleting a shared computation's name *releases* it (``released``: it goes on computing for
its aliases, no results under its name); once the last alias of a released computation is
deleted, the computation is tombstoned too (``follow_ups``).
"""

from __future__ import annotations

from shoal.control.canonical import CanonicalSpec, SpecRefusal, canonicalize, canonicalize_toml
from shoal.control.messages import Change, PipelineDocument, Request, Result
from shoal.errors import ConfigError, ControlError


class Registry:
    """Every pipeline name the control plane knows, deployed or deleted (a tombstone)."""

    def __init__(self) -> None:
        """An empty registry (``restore`` fills it from retained documents)."""
        self._documents: dict[str, PipelineDocument] = {}

    def __len__(self) -> int:
        """How many pipelines are deployed."""
        return len(self.deployed())

    def get(self, name: str) -> PipelineDocument | None:
        """The document of ``name`` (a tombstone too), if any."""
        return self._documents.get(name)

    def deployed(self) -> list[PipelineDocument]:
        """The deployed pipelines, by name."""
        return sorted((d for d in self._documents.values() if d.deployed), key=lambda d: d.name)

    def aliases_of(self, name: str) -> list[str]:
        """The deployed aliases sharing the computation of ``name``, by name."""
        return sorted(d.name for d in self._documents.values() if d.deployed and d.alias_of == name)

    def aliases(self) -> dict[str, list[str]]:
        """``aliases_of`` for every computation that has aliases, in one pass."""
        out: dict[str, list[str]] = {}
        for document in self.deployed():  # by name, so each list is sorted
            if document.alias_of is not None:
                out.setdefault(document.alias_of, []).append(document.name)
        return out

    def _computation(self, spec_hash: str, name: str) -> PipelineDocument | None:
        """A running computation of ``spec_hash`` under another name, if any."""
        for document in self._documents.values():
            if document.computes and document.spec_hash == spec_hash and document.name != name:
                return document
        return None

    def follow_ups(self, previous: PipelineDocument | None, now_ms: int) -> list[PipelineDocument]:
        """Documents to retain after a change to the pipeline ``previous`` documented.

        A released computation whose last alias went away is tombstoned.
        """
        if previous is None or previous.alias_of is None:
            return []
        target = self._documents.get(previous.alias_of)
        if target is None or not target.released or self.aliases_of(target.name):
            return []
        return [PipelineDocument(target.name, target.version + 1, "deleted", None, None, now_ms)]

    def restore(self, document: PipelineDocument) -> CanonicalSpec | None:
        """Take a retained document (read back after a restart, or followed by a worker).

        Returns the validated spec when ``document`` is a deployed version newer than the
        one known (None: a tombstone, or not newer, which changes nothing).

        Raises:
            ControlError: its spec is no longer valid or does not match its hash
                (``invalid_document``); its version is still kept as a tombstone so that
                version numbers never go back.
        """
        current = self._documents.get(document.name)
        if current is not None and current.version >= document.version:
            return None
        canonical = None
        if document.spec is not None:
            try:
                canonical = canonicalize(document.spec)
            except ConfigError as exc:
                self._keep_version(document)
                raise ControlError(
                    f"pipeline {document.name!r} v{document.version}: stored spec is invalid: "
                    f"{exc}",
                    reason="invalid_document",
                ) from exc
            if canonical.spec_hash != document.spec_hash or canonical.spec.name != document.name:
                self._keep_version(document)
                raise ControlError(
                    f"pipeline {document.name!r} v{document.version}: stored spec does not "
                    "match its name or hash",
                    reason="invalid_document",
                )
        self._documents[document.name] = document
        return canonical

    def _keep_version(self, document: PipelineDocument) -> None:
        self._documents[document.name] = PipelineDocument(
            document.name, document.version, "deleted", None, None, document.changed_at_ms
        )

    def commit(self, document: PipelineDocument) -> None:
        """Record a document the broker has accepted (after ``decide``)."""
        self._documents[document.name] = document

    def decide(self, request: Request, now_ms: int) -> tuple[Result, PipelineDocument | None]:
        """The answer to ``request``, and the document to retain if it is accepted."""
        if request.op == "delete":
            return self._delete(request, now_ms)
        canonical = canonicalize_toml(request.spec_toml or "")
        if isinstance(canonical, SpecRefusal):
            return self._refuse(
                request, canonical.reason, canonical.message, field=canonical.field
            ), None
        name = canonical.spec.name
        current = self._documents.get(name)
        live = current if current is not None and current.named else None
        if live is not None and live.spec_hash == canonical.spec_hash:
            return self._accept(request, live, "unchanged"), None
        if current is not None and current.released and current.spec_hash != canonical.spec_hash:
            return self._refuse(
                request,
                "name_clash",
                f"pipeline {name!r} was deleted but still computes for its aliases "
                f"{self.aliases_of(name)}; deploy this spec under another name",
                field="name",
                name=name,
                version=current.version,
            ), None
        if request.op == "deploy" and live is not None:
            return self._refuse(
                request,
                "name_clash",
                f"pipeline {name!r} is deployed (v{live.version}) with a different spec; "
                "use `shoal pipeline update` to change it",
                field="name",
                name=name,
                version=live.version,
            ), None
        if request.op == "update" and live is None:
            return self._refuse(
                request,
                "unknown_pipeline",
                f"pipeline {name!r} is not deployed; use `shoal pipeline deploy`",
                field="name",
                name=name,
            ), None
        shared_by = self.aliases_of(name) if live is not None else []
        if request.op == "update" and shared_by:
            return self._refuse(
                request,
                "shared",
                f"pipeline {name!r} is shared by {shared_by} (the same spec): deploy the new "
                "spec under another name, or delete the aliases first",
                field="name",
                name=name,
                version=live.version if live is not None else None,
            ), None
        version = 1 if current is None else current.version + 1
        target = self._computation(canonical.spec_hash, name)
        if current is not None and current.released:
            target = None  # the name comes back to the computation it kept running
        document = PipelineDocument(
            name,
            version,
            "deployed",
            canonical.spec_hash,
            canonical.mapping,
            now_ms,
            alias_of=None if target is None else target.name,
        )
        change: Change = "created" if live is None else "updated"
        return self._accept(request, document, change), document

    def _delete(self, request: Request, now_ms: int) -> tuple[Result, PipelineDocument | None]:
        name = request.name or ""
        current = self._documents.get(name)
        if current is None or not current.named:
            return self._refuse(
                request,
                "unknown_pipeline",
                f"pipeline {name!r} is not deployed",
                field="name",
                name=name,
            ), None
        shared_by = self.aliases_of(name)
        if shared_by:  # its aliases keep the computation running
            document = PipelineDocument(
                name,
                current.version + 1,
                "deployed",
                current.spec_hash,
                current.spec,
                now_ms,
                released=True,
            )
            return self._accept(request, document, "deleted"), document
        document = PipelineDocument(name, current.version + 1, "deleted", None, None, now_ms)
        return self._accept(request, document, "deleted"), document

    @staticmethod
    def _accept(request: Request, document: PipelineDocument, change: Change) -> Result:
        words = {
            "created": "deployed",
            "updated": "updated to",
            "unchanged": "unchanged at",
            "deleted": "deleted at",
        }[change]
        shared = ""
        if document.alias_of is not None:
            shared = f", sharing the computation of {document.alias_of!r}"
        elif document.released:
            shared = " (its computation goes on for its aliases)"
        return Result(
            id=request.id,
            ok=True,
            message=f"pipeline {document.name!r} {words} v{document.version}{shared}",
            op=request.op,
            name=document.name,
            version=document.version,
            spec_hash=document.spec_hash,
            change=change,
            alias_of=document.alias_of,
        )

    @staticmethod
    def _refuse(
        request: Request,
        reason: str,
        message: str,
        *,
        field: str | None = None,
        name: str | None = None,
        version: int | None = None,
    ) -> Result:
        return Result(
            id=request.id,
            ok=False,
            message=message,
            op=request.op,
            name=name,
            version=version,
            reason=reason,
            field=field,
        )


def refuse_unreadable(error: ControlError) -> Result:
    """The answer to a request that could not be read (not JSON, a bad key)."""
    return Result(
        id=None,
        ok=False,
        message=str(error),
        reason=error.reason,
        field=error.field,
    )
