"""Every MQTT topic name shoal uses, in one place.

A ``Topics`` value carries an optional root prefix so that several deployments (or every
test) can share one broker without seeing each other's traffic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from shoal.errors import TopicError

_SEGMENT: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
_UNSAFE: Final = re.compile(r"[/+#\x00]")


def check_segment(text: str, what: str) -> str:
    """Return ``text`` if it is a safe single topic segment (stream, pipeline, gateway id)."""
    if _SEGMENT.fullmatch(text) is None:
        raise TopicError(
            f"{what} {text!r} is not a valid name: use 1-128 characters of [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    return text


def key_segment(key: str | None) -> str:
    """Make a result key safe as one topic segment.

    ``/``, ``+``, ``#`` and NUL become ``_``; a leading ``_`` is doubled, because segments
    starting with a single ``_`` are reserved (``results/<pipeline>/_msgpack``); an empty or
    missing key becomes ``_``.
    """
    if not key:
        return "_"
    safe = _UNSAFE.sub("_", key)
    return f"_{safe}" if safe.startswith("_") else safe


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether an MQTT topic filter (with ``+`` and ``#``) matches a topic name.

    As in MQTT, a filter starting with a wildcard does not match a topic starting with ``$``
    (``$SYS``): those match only filters that name the ``$`` level.
    """
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    filter_levels = topic_filter.split("/")
    topic_levels = topic.split("/")
    for i, level in enumerate(filter_levels):
        if level == "#":
            return True
        if i >= len(topic_levels):
            return False
        if level not in ("+", topic_levels[i]):
            return False
    return len(filter_levels) == len(topic_levels)


@dataclass(frozen=True, slots=True)
class Topics:
    """Topic names, optionally below a root prefix such as ``site-7`` or ``test-42``."""

    root: str = ""

    def __post_init__(self) -> None:
        """Refuse roots that would break topic filters."""
        if self.root.startswith(("/", "$")) or any(c in self.root for c in "+#\x00"):
            raise TopicError(
                f"topic root {self.root!r} must not start with / or $ nor contain + or #"
            )

    def _t(self, *parts: str) -> str:
        path = "/".join(parts)
        return f"{self.root.rstrip('/')}/{path}" if self.root else path

    def under_root(self, topic_or_filter: str) -> str:
        """A topic or filter given relative to the root (e.g. a pipeline's inputs)."""
        return self._t(topic_or_filter)

    # Ingest: gateways publish batches here; workers subscribe with a shared subscription.
    def ingest(self, stream: str, gateway_id: str) -> str:
        """Where a gateway publishes its batches."""
        return self._t("ingest", stream, gateway_id)

    def ingest_filter(self, stream: str) -> str:
        """All gateways of a stream."""
        return self._t("ingest", stream, "+")

    def ingest_gateway(self, topic: str) -> tuple[str, str] | None:
        """(stream, gateway id) of an ingest topic, or None if ``topic`` is not one."""
        prefix = self._t("ingest", "")
        if not topic.startswith(prefix):
            return None
        parts = topic[len(prefix) :].split("/")
        if len(parts) != 2 or not all(parts):
            return None
        return parts[0], parts[1]

    @staticmethod
    def shared(group: str, topic_filter: str) -> str:
        """An MQTT 5 shared subscription of ``group`` on ``topic_filter``."""
        return f"$share/{group}/{topic_filter}"

    # Pipeline internals.
    def partials(self, pipeline: str, partition: int) -> str:
        """Worker → combiner partition ``partition``."""
        return self._t("shoal", "partials", pipeline, str(partition))

    def confirm(self, gateway_id: str, pipeline: str, partition: int) -> str:
        """Combiner partition → gateway (retained): highest contiguous seq fully applied."""
        return self._t("shoal", "confirm", gateway_id, pipeline, str(partition))

    def confirm_filter(self, gateway_id: str) -> str:
        """Every confirmation addressed to one gateway (what a gateway subscribes to)."""
        return self._t("shoal", "confirm", gateway_id, "#")

    def confirm_all(self) -> str:
        """Every gateway's confirmations (the lag monitor)."""
        return self._t("shoal", "confirm", "#")

    def gateway_status(self, gateway_id: str) -> str:
        """Gateway → everyone (retained): latest seq published, spool depth."""
        return self._t("shoal", "gateway", gateway_id)

    def gateway_status_all(self) -> str:
        """Every gateway's status."""
        return self._t("shoal", "gateway", "+")

    def deadletter(self, pipeline: str) -> str:
        """Rejected input: raw payload and the reason."""
        return self._t("shoal", "deadletter", pipeline)

    def late(self, pipeline: str) -> str:
        """Rows that arrived after their window closed."""
        return self._t("shoal", "late", pipeline)

    def alert(self, pipeline: str, alert: str, key: str | None) -> str:
        """An alert's latest state change for one key (retained JSON, CONTRACT §24)."""
        return self._t("shoal", "alerts", pipeline, alert, key_segment(key))

    def alerts(self, pipeline: str) -> str:
        """Every alert of one pipeline, every key."""
        return self._t("shoal", "alerts", pipeline, "#")

    def metrics(self, component: str, instance: str) -> str:
        """Heartbeats and counters of one component instance."""
        return self._t("shoal", "metrics", component, instance)

    def metrics_all(self) -> str:
        """Every component's heartbeats."""
        return self._t("shoal", "metrics", "#")

    def control(self, instance: str) -> str:
        """Commands to one component instance (drain markers, stop)."""
        return self._t("shoal", "control", instance)

    def combiner_control(self, pipeline: str) -> str:
        """Commands to every combiner partition of a pipeline (``{"cmd": "flush"}``)."""
        return self._t("shoal", "control", "combiners", pipeline)

    def pool_combiner(self, combiner_id: str) -> str:
        """A pool combiner's retained presence and the partitions it owns (cleared by its Will)."""
        return self._t("shoal", "combiners", combiner_id)

    def pool_combiners(self) -> str:
        """Every pool combiner's presence (what pool combiners and ``shoal pipeline`` read)."""
        return self._t("shoal", "combiners", "+")

    # The control plane: pipelines deployed at run time (``shoal.control``).
    def pipeline_document(self, pipeline: str) -> str:
        """A deployed pipeline's spec and version (retained; written by the control plane)."""
        return self._t("shoal", "pipelines", pipeline)

    def pipeline_documents(self) -> str:
        """Every deployed pipeline's document (names never start with ``_``)."""
        return self._t("shoal", "pipelines", "+")

    def pipeline_request(self, client: str) -> str:
        """Where the client ``client`` sends deploy/update/delete requests."""
        return self._t("shoal", "pipelines", "_request", client)

    def pipeline_requests(self) -> str:
        """Every client's requests (what the control plane subscribes to)."""
        return self._t("shoal", "pipelines", "_request", "+")

    def pipeline_reply(self, client: str) -> str:
        """Where the control plane answers the requests of ``client``."""
        return self._t("shoal", "pipelines", "_reply", client)

    def alerts_filter(self, pipeline: str) -> str:
        """Every alert transition of a pipeline: ``shoal/alerts/<pipeline>/#``.

        The alert messages themselves are issue 16's; ``shoal sink webhook --alerts`` follows
        this filter.
        """
        return self._t("shoal", "alerts", pipeline, "#")

    # Results, for dashboards and notebooks.
    def results(self, pipeline: str) -> str:
        """One message per closed window with all keys."""
        return self._t("results", pipeline)

    def results_encoded(self, pipeline: str, encoding: str) -> str:
        """Window results in an additional encoding (``results/<pipeline>/_msgpack``)."""
        return self._t("results", pipeline, f"_{encoding}")

    def result_key(self, pipeline: str, key: str | None) -> str:
        """Latest result of one key, retained JSON."""
        return self._t("results", pipeline, key_segment(key))

    def result_keys(self, pipeline: str) -> str:
        """Every key's latest result."""
        return self._t("results", pipeline, "+")
