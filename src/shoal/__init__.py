"""shoal: stream processing for MQTT at the edge.

The public surface is what ``__all__`` lists (pinned by ``tests/unit/test_public_api.py``);
modules and packages whose names start with ``_`` are internal. Names are imported lazily,
so ``import shoal`` stays cheap and processes can configure polars before it loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
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

_LAZY = {
    "Batch": "shoal.schemas",
    "DecodeLimits": "shoal.schemas",
    "Encoding": "shoal.schemas",
    "Envelope": "shoal.schemas",
    "Measurements": "shoal.schemas",
    "Topics": "shoal.schemas",
    "decode_batch": "shoal.schemas",
    "encode_batch": "shoal.schemas",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
