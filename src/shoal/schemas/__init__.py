"""The batch wire format: encodings, envelope, codec, limits, and the topic names.

Imports nothing from the rest of shoal except ``errors``; everything else imports this.
"""

from shoal.schemas._codec import (
    DEFAULT_LIMITS,
    declared_encoding,
    decode_batch,
    encode_batch,
    peek_envelope,
)
from shoal.schemas._model import (
    ATTRIBUTE_COLUMNS,
    FRAME_SCHEMA,
    FUTURE_POLICIES,
    MAX_TS_MS,
    MIN_TS_MS,
    SCHEMA_VERSION,
    Batch,
    DecodeLimits,
    DictColumn,
    Encoding,
    Envelope,
    FuturePolicy,
    Measurements,
)
from shoal.schemas.topics import Topics

__all__ = [
    "ATTRIBUTE_COLUMNS",
    "DEFAULT_LIMITS",
    "FRAME_SCHEMA",
    "FUTURE_POLICIES",
    "MAX_TS_MS",
    "MIN_TS_MS",
    "SCHEMA_VERSION",
    "Batch",
    "DecodeLimits",
    "DictColumn",
    "Encoding",
    "Envelope",
    "FuturePolicy",
    "Measurements",
    "Topics",
    "declared_encoding",
    "decode_batch",
    "encode_batch",
    "peek_envelope",
]
