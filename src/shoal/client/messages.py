"""Per-key result records and pandas copies: what only the results client reads.

The window messages and the result layout (``HEADER_SCHEMA``, ``WindowMessage``,
``parse_window_message``) are ``shoal.schemas.results``, shared with the archive.

Must not import ``shoal.broker``: parsing is pure.
"""

from __future__ import annotations

import importlib
from typing import Any

import orjson
import polars as pl

from shoal.errors import SchemaError
from shoal.schemas.results import HEADER_SCHEMA, empty_results, field_dtype


def parse_key_message(payload: bytes) -> dict[str, Any]:
    """Parse a retained per-key result (``results/<pipeline>/<key>``) into a flat record.

    Raises:
        SchemaError: not a per-key result record.
    """
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"unreadable per-key result: {exc}", reason="bad_result_message") from exc
    if not isinstance(body, dict) or not isinstance(body.get("key"), str | None):
        raise SchemaError("per-key result is not a map with a key", reason="bad_result_message")
    for name in ("pipeline", "window", "start", "end"):
        if name not in body:
            raise SchemaError(
                "per-key result lacks a field", reason="bad_result_message", field=name
            )
    return body


def key_records_frame(records: list[dict[str, Any]]) -> pl.DataFrame:
    """Per-key records (``parse_key_message``) as one frame, typed like the result layout.

    Per-key records carry no partition, watermark or partitions; those columns are absent.
    """
    if not records:
        return empty_results().drop("partition", "partitions", "watermark")
    names: dict[str, None] = {}
    for record in records:
        names.update(dict.fromkeys(record))
    schema = {
        name: HEADER_SCHEMA[name] if name in HEADER_SCHEMA else field_dtype(name) for name in names
    }
    columns = {
        name: pl.Series(name, [r.get(name) for r in records], dtype=dtype, strict=False)
        for name, dtype in schema.items()
    }
    return pl.DataFrame(columns).sort("key", nulls_last=True)


def to_pandas(frame: pl.DataFrame) -> Any:
    """A ``pandas.DataFrame`` copy of a polars frame, without needing pyarrow.

    ``polars.DataFrame.to_pandas`` needs pyarrow; this goes through numpy column by column
    (nullable integers become floats with NaN, strings become objects).
    """
    pd: Any = importlib.import_module("pandas")  # lazily: pipeline processes never load it
    return pd.DataFrame({name: frame.get_column(name).to_numpy() for name in frame.columns})
