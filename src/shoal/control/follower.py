"""Following the retained pipeline documents: what is deployed now, change by change. Pure.

A reader of ``shoal/pipelines/+`` (the control plane restoring its registry, a pool worker
picking pipelines up) feeds every message to ``DocumentFollower.take`` and gets back what
changed: ``Served`` (a pipeline deployed, or a new version of it, with its validated spec)
or ``Dropped`` (deleted, become an alias of another pipeline's computation, or its document
became unreadable); a released pipeline (deleted while aliases share it) is still ``Served``.
Documents are validated by ``Registry.restore``, the same code the control plane restores
with, so a worker serves exactly the specs the control plane accepted. An unreadable
document is counted and logged, never silently skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shoal.broker.session import Message
from shoal.control.messages import PipelineDocument
from shoal.control.registry import Registry
from shoal.errors import ControlError
from shoal.processors.spec import PipelineSpec
from shoal.schemas.topics import Topics, topic_matches

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Served:
    """A pipeline is deployed at ``version`` (new, or a newer version of it)."""

    name: str
    version: int
    spec: PipelineSpec


@dataclass(frozen=True, slots=True)
class Dropped:
    """A pipeline is no longer deployed (deleted at ``version``, or its document is invalid)."""

    name: str
    version: int


class DocumentFollower:
    """Turns retained pipeline documents into changes (see the module docstring).

    Args:
        topics: the deployment's topic root.
        registry: where the documents are kept (default: a registry of its own).
    """

    def __init__(self, topics: Topics, registry: Registry | None = None) -> None:
        self.topics = topics
        self.registry = registry if registry is not None else Registry()
        self.invalid = 0
        """Documents refused: not a document, on the wrong topic, or an invalid spec."""

    def is_document(self, topic: str) -> bool:
        """Whether ``topic`` is a pipeline document's (requests and replies are not)."""
        return topic_matches(self.topics.pipeline_documents(), topic)

    def take(self, message: Message) -> Served | Dropped | None:
        """The change a message on a document topic makes (None: nothing changed)."""
        if not message.payload:
            return None  # a cleared retained message: the control plane never sends one
        try:
            document = self._read(message)
            before = self.registry.get(document.name)
            canonical = self.registry.restore(document)
        except ControlError as exc:
            self.invalid += 1
            log.error("cannot take pipeline document %s: %s", message.topic, exc)  # noqa: TRY400 - a refusal, not a crash
            return self._invalidated(message.topic)
        after = self.registry.get(document.name)
        if after is before or after is None:
            return None
        if canonical is not None and after.alias_of is None:
            return Served(after.name, after.version, canonical.spec)
        # An alias computes nothing of its own (it shares another pipeline's computation).
        return Dropped(after.name, after.version)

    def _read(self, message: Message) -> PipelineDocument:
        document = PipelineDocument.from_json(message.payload)
        if self.topics.pipeline_document(document.name) != message.topic:
            raise ControlError(
                f"the document of {document.name!r} is on the wrong topic",
                reason="invalid_document",
            )
        return document

    def _invalidated(self, topic: str) -> Dropped | None:
        """A deployed pipeline whose newer document is invalid stops being served."""
        name = topic.rsplit("/", 1)[-1]
        current = self.registry.get(name)
        if current is None or current.deployed:
            return None
        return Dropped(current.name, current.version)
