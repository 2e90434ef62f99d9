"""Sinks: window results and alerts delivered to the systems operators already run.

* ``follow``: the shared core: follow a topic with a persistent MQTT session and acknowledge
  each message only after a ``Handler`` made it safe (retries and backoff in ``Backoff``);
* ``postgres`` (``shoal sink postgres``): window results upserted into a PostgreSQL table,
  exactly once (idempotent by window identity, committed before the acknowledgement);
* ``webhook`` (``shoal sink webhook``): each message POSTed to a URL, at least once, with an
  ``Idempotency-Key`` header.

Reads results like ``shoal.archive`` and ``shoal.client`` do and sits beside them; talks
MQTT only through ``shoal.broker.session.Session``. ``postgres`` imports psycopg (the
``sinks`` extra) and is not imported here, so the web hook needs no database driver.
"""

from shoal.sinks.follow import Backoff, FollowConfig, Follower, FollowStats, Handler
from shoal.sinks.webhook import WebhookConfig, WebhookSink, WebhookStats, idempotency_key

__all__ = [
    "Backoff",
    "FollowConfig",
    "FollowStats",
    "Follower",
    "Handler",
    "WebhookConfig",
    "WebhookSink",
    "WebhookStats",
    "idempotency_key",
]
