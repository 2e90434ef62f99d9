"""shoal: stream processing for MQTT at the edge.

The public surface is what ``__all__`` lists (pinned by ``tests/unit/test_public_api.py``);
modules and packages whose names start with ``_`` are internal.
"""

from shoal.errors import (
    BrokerError,
    BrokerNotFoundError,
    ConfigError,
    DecodeError,
    InputError,
    PayloadTooLargeError,
    SchemaError,
    ShoalError,
    SpoolError,
)
from shoal.schemas import (
    Batch,
    DecodeLimits,
    Encoding,
    Envelope,
    Measurements,
    Topics,
    decode_batch,
    encode_batch,
)

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BrokerError",
    "BrokerNotFoundError",
    "ConfigError",
    "DecodeError",
    "DecodeLimits",
    "Encoding",
    "Envelope",
    "InputError",
    "Measurements",
    "PayloadTooLargeError",
    "SchemaError",
    "ShoalError",
    "SpoolError",
    "Topics",
    "__version__",
    "decode_batch",
    "encode_batch",
]
