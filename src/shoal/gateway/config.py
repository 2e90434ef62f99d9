"""The gateway's configuration: one frozen dataclass, validated once when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from shoal.broker.session import PROTOCOL_OVERHEAD
from shoal.broker.settings import BrokerSettings
from shoal.errors import ConfigError
from shoal.schemas import DEFAULT_LIMITS, Encoding, Topics
from shoal.schemas.topics import check_segment

MIN_PACKET_BYTES: Final = 1024
"""Smallest ``max_packet_bytes`` accepted: room for the topic, the envelope and a few rows."""

MAX_PACKET_BYTES: Final = 268_435_455
"""The largest packet MQTT can express (its variable byte integer)."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How one gateway batches, spools and publishes its measurements.

    Attributes:
        gateway_id: the gateway's name; last segment of its ingest topic and part of every
            batch's identity (gateway, seq).
        stream: the stream it publishes to (``ingest/<stream>/<gateway_id>``).
        broker: where the broker is.
        topics: the topic namespace (root prefix).
        encoding: how batches are encoded.
        zstd: compress binary-columnar bodies with zstd.
        batch_size: rows per sealed batch.
        max_delay_ms: seal a partial batch once its oldest row has waited this long.
        spool_dir: folder of the on-disk spool; None keeps the spool in memory (simulations
            and tests only: a restart then forgets unconfirmed batches and starts at seq 0).
        spool_fsync: fsync every spool write. Off, the spool survives kill -9 (the page cache
            outlives the process); on, it also survives power loss.
        max_spool_bytes: payload bytes the spool may hold; beyond, ``add*`` refuses rows.
        resend_after_ms: re-send the oldest unconfirmed batches when confirmations have not
            advanced for this long (per-batch exponential backoff, capped at 60 s). This
            repairs what gap reports cannot name: the last batches before a pause in the
            stream, or a whole window, lost together. The end-to-end window bounds what a
            re-send round costs, so the timer can be short.
        resend_window: at most this many of the oldest unconfirmed batches are re-sent per
            round (the window bounds them anyway: about 75 batches of 16,000 rows).
        resend_gap_ms: a batch a combiner reports missing (``Confirm.missing``: lost on the
            way while later batches arrived) is re-sent at once, and again at most this often.
        resend_jitter: every re-send wait is shortened by a random share up to this
            (exponential backoff with jitter; see ``ResendPolicy``).
        max_inflight: batches published but not yet acknowledged by the broker (PUBACK).
        max_unconfirmed_bytes: payload bytes published but not yet confirmed by the pipeline:
            the end-to-end flow-control window. A backlog beyond it stays in the spool (and
            shows as lag) instead of filling the broker's queues, which drop messages when
            full. Per gateway throughput is at most this window per confirmation round trip
            (about a combiner checkpoint interval). By arithmetic, not a measurement: 16 MiB
            per ~1 s round trip at ~12.7 bytes per binary measurement is ~1.3 M
            measurements/s per gateway.
        max_packet_bytes: largest MQTT packet sent; the effective limit is the smaller of this
            and the broker's CONNACK Maximum Packet Size.
        confirm_from: pipelines whose confirmation releases a batch (all of them, each with
            all of its partitions); empty: any one pipeline, all of its partitions.
        status_interval_ms: how often the retained ``GatewayStatus`` is published.
        max_future_ms: refuse rows whose timestamp is more than this far ahead of the
            gateway's clock, as workers would (``DecodeLimits.max_future_ms``); None: no check.
        release_on_puback: drop a batch from the spool once the broker accepted it instead of
            waiting for the pipeline's confirmation. No end-to-end guarantee: for load tests
            of the broker alone (``shoal simulate --spool off``).
    """

    gateway_id: str
    stream: str = "default"
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    topics: Topics = field(default_factory=Topics)
    encoding: Encoding = Encoding.BINARY_COLUMNAR
    zstd: bool = False
    batch_size: int = 16_000
    max_delay_ms: int = 1_000
    spool_dir: Path | None = None
    spool_fsync: bool = False
    max_spool_bytes: int = 1024 * 1024 * 1024
    resend_after_ms: int = 5_000
    resend_window: int = 256
    resend_gap_ms: int = 2_000
    resend_jitter: float = 0.5
    max_inflight: int = 32
    max_unconfirmed_bytes: int = 16 * 1024 * 1024
    max_packet_bytes: int = 8 * 1024 * 1024
    confirm_from: tuple[str, ...] = ()
    status_interval_ms: int = 1_000
    max_future_ms: int | None = DEFAULT_LIMITS.max_future_ms
    release_on_puback: bool = False

    def __post_init__(self) -> None:
        """Refuse values that could never work, saying which option and why."""
        names = [("gateway id", self.gateway_id), ("stream", self.stream)]
        names += [("pipeline name in confirm_from", p) for p in self.confirm_from]
        for what, name in names:
            check_segment(name, what)  # a TopicError is a ConfigError
        if not isinstance(self.encoding, Encoding):
            raise ConfigError(f"encoding must be an Encoding, not {self.encoding!r}")
        if self.zstd and self.encoding is not Encoding.BINARY_COLUMNAR:
            raise ConfigError("zstd applies to the binary-columnar encoding only")
        if not 1 <= self.batch_size <= DEFAULT_LIMITS.max_rows:
            raise ConfigError(
                f"batch_size must be in [1, {DEFAULT_LIMITS.max_rows}] (workers refuse larger "
                f"batches), not {self.batch_size}"
            )
        positive = {
            "max_delay_ms": self.max_delay_ms,
            "max_spool_bytes": self.max_spool_bytes,
            "resend_after_ms": self.resend_after_ms,
            "resend_window": self.resend_window,
            "resend_gap_ms": self.resend_gap_ms,
            "max_inflight": self.max_inflight,
            "max_unconfirmed_bytes": self.max_unconfirmed_bytes,
            "status_interval_ms": self.status_interval_ms,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name} must be positive, not {value}")
        if not 0.0 <= self.resend_jitter < 1.0:
            raise ConfigError(f"resend_jitter must be in [0, 1), not {self.resend_jitter}")
        if self.max_future_ms is not None and self.max_future_ms < 0:
            raise ConfigError("max_future_ms must be >= 0 or None")
        if not MIN_PACKET_BYTES <= self.max_packet_bytes <= MAX_PACKET_BYTES:
            raise ConfigError(
                f"max_packet_bytes must be in [{MIN_PACKET_BYTES}, {MAX_PACKET_BYTES}], "
                f"not {self.max_packet_bytes}"
            )
        if self.payload_limit(None) < MIN_PACKET_BYTES // 4:
            raise ConfigError(
                f"max_packet_bytes {self.max_packet_bytes} leaves too little room for a payload "
                f"after the topic {self.ingest_topic!r} and {PROTOCOL_OVERHEAD} bytes of headers"
            )

    @property
    def ingest_topic(self) -> str:
        """Where this gateway publishes its batches."""
        return self.topics.ingest(self.stream, self.gateway_id)

    def payload_limit(self, broker_max_packet: int | None) -> int:
        """Largest payload that fits a packet, given the broker's CONNACK limit (None: none).

        Uses the same accounting as the MQTT session's own check, so a payload within this
        limit is never refused before it is sent.
        """
        packet = self.max_packet_bytes
        if broker_max_packet is not None:
            packet = min(packet, broker_max_packet)
        return packet - len(self.ingest_topic) - PROTOCOL_OVERHEAD
