"""Typed access to the tables of a mapping file: every refusal a ``ConfigError`` with a path.

A ``Table`` hands out one TOML table's settings by type (``integer``, ``choice``, ...) and
remembers which keys were read; ``finish`` refuses the rest (a misspelt setting is an error,
not a silent default). Errors carry the setting's path (``routes[0].timestamp.unit``) as
``field`` and the reason ``invalid_mapping``. Pure: no I/O.

The pipeline spec has a reader of the same kind (``shoal.processors.spec._Reader``) whose
messages and edge rules (empty lists, required choices, no reason) differ; merging the two
would change refusal texts that users see, so they stay apart for now.
"""

from __future__ import annotations

from typing import Any

from shoal.errors import ConfigError
from shoal.schemas.topics import check_segment


class Table:
    """Typed access to one TOML table that refuses keys nobody read."""

    def __init__(self, raw: Any, path: str, where: str) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: {path or 'the mapping'} must be a table", field=path)
        self.raw: dict[str, Any] = raw
        self.path = path
        self.where = where
        self.used: set[str] = set()

    def error(self, key: str, problem: str) -> ConfigError:
        field = f"{self.path}.{key}" if self.path else key
        return ConfigError(
            f"{self.where}: {field}: {problem}", field=field, reason="invalid_mapping"
        )

    def _get(self, key: str) -> Any:
        self.used.add(key)
        return self.raw.get(key)

    def string_or_none(self, key: str) -> str | None:
        value = self._get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise self.error(key, f"must be a non-empty string, not {value!r}")
        return value

    def string(self, key: str) -> str:
        value = self.string_or_none(key)
        if value is None:
            raise self.error(key, "is required")
        return value

    def segment(self, key: str, *, default: str) -> str:
        value = self.string_or_none(key) or default
        try:
            return check_segment(value, key)
        except ConfigError as exc:
            raise self.error(key, str(exc)) from None

    def strings(self, key: str, *, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self.error(key, f"must be a list of non-empty strings, not {value!r}")
        return tuple(value)

    def string_map(self, key: str) -> dict[str, str]:
        value = self._get(key)
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise self.error(key, f"must be a table of strings, not {value!r}")
        return dict(value)

    def choice(self, key: str, options: tuple[str, ...], *, default: str | None) -> str:
        value = self._get(key)
        if value is None:
            if default is None:
                raise self.error(key, f"is required: one of {list(options)}")
            return default
        if value not in options:
            raise self.error(key, f"must be one of {list(options)}, not {value!r}")
        return str(value)

    def integer(self, key: str, *, default: int, low: int, high: int) -> int:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.error(key, f"must be an integer in [{low}, {high}], not {value!r}")
        return value

    def integer_or_none(self, key: str, *, default: int | None) -> int | None:
        value = self._get(key)
        if value is None:
            return default
        if value is False:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.error(key, f"must be a non-negative integer or false, not {value!r}")
        return value

    def boolean(self, key: str, *, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, not {value!r}")
        return value

    def table(self, key: str) -> Table:
        value = self._get(key)
        path = f"{self.path}.{key}" if self.path else key
        return Table({} if value is None else value, path, self.where)

    def tables(self, key: str) -> list[Table]:
        value = self._get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(key, "must be an array of tables ([[routes]])")
        return [Table(v, f"{key}[{i}]", self.where) for i, v in enumerate(value)]

    def finish(self) -> None:
        extra = sorted(set(self.raw) - self.used)
        if extra:
            raise self.error(extra[0], f"unknown setting (known here: {sorted(self.used)})")
