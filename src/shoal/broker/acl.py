"""The Mosquitto ACL rules of each role, derived from ``shoal.schemas.topics.Topics``.

Pure. The ACL follows the topic names and the topic root; ``shoal.broker.access`` gives the
roles to users.

Roles (``R`` is the topic root, ``P`` the role's pipeline, ``G`` a gateway id)::

    gateway G    write R/ingest/+/G, R/shoal/gateway/G        read R/shoal/confirm/G/#
    worker P     read  the pipeline's inputs (R/ingest/+/+)   write R/shoal/partials/P/+,
                 R/shoal/deadletter/P, R/shoal/metrics/worker/+; readwrite R/shoal/control/+
    worker       (the pool: no P) as above for every pipeline (P a wildcard), and read
                 R/shoal/pipelines/+ (the deployed pipelines' documents), R/shoal/combiners/+
    combiner P   read  R/shoal/partials/P/+, R/shoal/gateway/+, R/shoal/control/combiners/P
                 write R/results/P, R/results/P/#, R/shoal/late/P, R/shoal/confirm/+/P/+,
                       R/shoal/metrics/combiner/+, R/shoal/alerts/P/#, R/shoal/deadletter/P,
                       R/shoal/control/+ (answers to a flush)
    combiner     (the pool: no P) as above for every pipeline (P a wildcard), and read
                 R/shoal/pipelines/+; readwrite R/shoal/combiners/+ (membership),
                 R/shoal/control/+ (its join marker, answers to a flush)
    dashboard    read  R/results/# (or R/results/P and R/results/P/# for one pipeline), and
                 likewise the alerts (R/shoal/alerts/#), late rows (R/shoal/late/#), dead
                 letters (R/shoal/deadletter/#) and pipeline documents (R/shoal/pipelines/+);
                 R/shoal/metrics/# and R/shoal/gateway/+ (what ``shoal view`` shows)
    admin        read  R/shoal/gateway/+, R/shoal/confirm/#, R/results/#, R/shoal/late/#,
                       R/shoal/alerts/#,
                       R/shoal/deadletter/#, R/shoal/pipelines/#, R/shoal/combiners/+,
                       $SYS/#;
                 write R/shoal/pipelines/_request/+ (``shoal pipeline`` deploy, update, delete);
                 readwrite R/shoal/metrics/#, R/shoal/control/#
    control      read  R/shoal/pipelines/_request/+   write R/shoal/pipelines/_reply/+;
                 readwrite R/shoal/pipelines/+ (the retained documents), R/shoal/control/+

Everything else is denied. How Mosquitto 2.0.11 applies an ``acl_file`` (measured, see
``tests/integration/test_security.py``): a denied QoS 1 PUBLISH gets PUBACK "Not authorized"
and goes nowhere; SUBSCRIBE is always granted, and the read rule is checked for every message
(retained ones included) against the message's own topic, so a forbidden subscription stays
silent. For shared subscriptions that means the ``$share/<group>/`` prefix plays no part in
the check, and a client without read access that joins a group still takes its round-robin
turn: the broker drops the messages dealt to it. Nothing is lost for good (gateways re-send
unconfirmed batches), but only trusted users should hold credentials at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

from shoal.schemas.topics import Topics

Access = Literal["read", "write", "readwrite"]


@dataclass(frozen=True, slots=True)
class Rule:
    """One ACL line: an access right on a topic or topic filter."""

    access: Access
    topic: str

    def line(self) -> str:
        """The line as Mosquitto's ``acl_file`` spells it."""
        return f"topic {self.access} {self.topic}"


def _last_level_wild(topic: str) -> str:
    """``a/b/c`` → ``a/b/+``: every value of the last level."""
    return f"{topic.rsplit('/', 1)[0]}/+"


def _siblings_below(topic: str) -> str:
    """``a/b/c`` → ``a/b/#``: everything below the parent of ``topic``."""
    return f"{topic.rsplit('/', 1)[0]}/#"


def _every_alert(topics: Topics) -> str:
    """``R/shoal/alerts/#``: every pipeline's alerts."""
    return f"{topics.alerts(_ANY).rsplit('/', 2)[0]}/#"


_ANY: Final = "x"
"""A placeholder name, replaced by a wildcard in the rules below."""


def gateway_rules(gateway_ids: Iterable[str], topics: Topics) -> list[Rule]:
    """A gateway (or a concentrator) publishing for ``gateway_ids``."""
    rules = []
    for gateway_id in gateway_ids:
        rules += [
            Rule("write", topics.ingest("+", gateway_id)),
            Rule("write", topics.gateway_status(gateway_id)),
            Rule("read", topics.confirm_filter(gateway_id)),
        ]
    return rules


def worker_rules(pipeline: str | None, inputs: Iterable[str], topics: Topics) -> list[Rule]:
    """A worker of ``pipeline`` reading ``inputs`` (filters below the root).

    With no pipeline, a pool worker: every deployed pipeline reading those inputs.
    """
    rules = [
        *(Rule("read", topics.under_root(f)) for f in inputs),
        Rule("write", _last_level_wild(topics.partials(pipeline or "+", 0))),
        Rule("write", topics.deadletter(pipeline or "+")),
        Rule("write", topics.metrics("worker", "+")),
        # Its own control topic (drain markers); worker ids are not known in advance.
        Rule("readwrite", topics.control("+")),
    ]
    if pipeline is None:
        # The documents it serves, and the pool combiners' presence (it drops an older version
        # once no partition computes it). Mosquitto grants a SUBSCRIBE without a read rule and
        # stays silent; Mochi refuses it, and the pool worker could not start at all.
        rules.append(Rule("read", topics.pipeline_documents()))
        rules.append(Rule("read", topics.pool_combiners()))
    return rules


def combiner_rules(pipeline: str | None, topics: Topics) -> list[Rule]:
    """A combiner (any partition) of ``pipeline``.

    With no pipeline, a pool combiner: every deployed pipeline's partitions (it hosts those
    the pool assigns it), plus the pipeline documents, the pool's membership topics and its
    own control topic (the marker it joins with).
    """
    name = pipeline or "+"
    confirm = topics.confirm("+", name, 0)
    rules = [
        Rule("read", _last_level_wild(topics.partials(name, 0))),
        Rule("read", topics.gateway_status_all()),
        Rule("read", topics.combiner_control(name)),
        Rule("write", topics.results(name)),
        Rule("write", f"{topics.results(name)}/#"),
        Rule("write", topics.late(name)),
        Rule("write", topics.alerts(name)),
        Rule("write", _last_level_wild(confirm)),
        Rule("write", topics.metrics("combiner", "+")),
        # Partials over the state cap and result rows no message can carry.
        Rule("write", topics.deadletter(name)),
    ]
    if pipeline is None:
        rules += [
            Rule("read", topics.pipeline_documents()),
            Rule("readwrite", topics.pool_combiners()),
            # Its join marker, and the answers to `shoal pipeline flush` (§21).
            Rule("readwrite", topics.control("+")),
        ]
    else:
        # The answers to `shoal pipeline flush`, on the asker's control topic (§21).
        rules.append(Rule("write", topics.control("+")))
    return rules


def dashboard_rules(pipeline: str | None, topics: Topics) -> list[Rule]:
    """A reader of the results and health of ``pipeline`` (None: of every pipeline)."""
    # Heartbeats and gateway statuses name no pipeline in their topics: every dashboard
    # reads them (lag, workers, watermarks and clock offsets in ``shoal view``).
    health = [Rule("read", topics.metrics_all()), Rule("read", topics.gateway_status_all())]
    if pipeline is None:
        return [
            Rule("read", _siblings_below(topics.results(_ANY))),
            Rule("read", _every_alert(topics)),
            Rule("read", _siblings_below(topics.late(_ANY))),
            Rule("read", _siblings_below(topics.deadletter(_ANY))),
            Rule("read", topics.pipeline_documents()),
            *health,
        ]
    return [
        Rule("read", topics.results(pipeline)),
        Rule("read", f"{topics.results(pipeline)}/#"),
        Rule("read", topics.alerts(pipeline)),
        Rule("read", topics.late(pipeline)),
        Rule("read", topics.deadletter(pipeline)),
        Rule("read", topics.pipeline_document(pipeline)),
        *health,
    ]


def admin_rules(topics: Topics) -> list[Rule]:
    """Operations: lag, metrics, control commands, dead letters, ``$SYS``; no data path."""
    return [
        Rule("read", topics.gateway_status_all()),
        Rule("read", topics.confirm_all()),
        Rule("read", _siblings_below(topics.results(_ANY))),
        Rule("read", _siblings_below(topics.late(_ANY))),
        Rule("read", _every_alert(topics)),
        Rule("read", _siblings_below(topics.deadletter(_ANY))),
        Rule("readwrite", topics.metrics_all()),
        Rule("readwrite", _siblings_below(topics.control(_ANY))),
        # shoal pipeline: requests out; documents and its own replies in.
        Rule("write", topics.pipeline_requests()),
        Rule("read", _siblings_below(topics.pipeline_document(_ANY))),
        # The pool combiners' announcements (``shoal pipeline deploy`` waits for owners).
        Rule("read", topics.pool_combiners()),
        Rule("read", "$SYS/#"),
    ]


def control_rules(topics: Topics) -> list[Rule]:
    """The control plane (``shoal control``): requests in, documents and results out."""
    return [
        Rule("read", topics.pipeline_requests()),
        Rule("readwrite", topics.pipeline_documents()),
        Rule("write", _last_level_wild(topics.pipeline_reply(_ANY))),
        # Its own control topic (the restore marker); instance ids are not known in advance.
        Rule("readwrite", topics.control("+")),
    ]
