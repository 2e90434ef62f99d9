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
        live = current if current is not None and current.deployed else None
        if live is not None and live.spec_hash == canonical.spec_hash:
            return self._accept(request, live, "unchanged"), None
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
        version = 1 if current is None else current.version + 1
        document = PipelineDocument(
            name, version, "deployed", canonical.spec_hash, canonical.mapping, now_ms
        )
        return self._accept(request, document, "created" if live is None else "updated"), document

    def _delete(self, request: Request, now_ms: int) -> tuple[Result, PipelineDocument | None]:
        name = request.name or ""
        current = self._documents.get(name)
        if current is None or not current.deployed:
            return self._refuse(
                request,
                "unknown_pipeline",
                f"pipeline {name!r} is not deployed",
                field="name",
                name=name,
            ), None
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
        return Result(
            id=request.id,
            ok=True,
            message=f"pipeline {document.name!r} {words} v{document.version}",
            op=request.op,
            name=document.name,
            version=document.version,
            spec_hash=document.spec_hash,
            change=change,
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
