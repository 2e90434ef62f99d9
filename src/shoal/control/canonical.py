"""The canonical form of a pipeline spec, its content hash, and where a refused spec is wrong.

Pure. A spec sent to the control plane is TOML text; it is validated by the same code as a
file (``shoal.processors.spec.parse_pipeline``) and rendered back as a mapping with every
setting explicit and defaults resolved (aliases resolved, default window names filled in).
That mapping is again a valid spec: ``parse_pipeline(canonical_mapping(spec))`` gives the
same ``PipelineSpec``. Two specs that compute the same thing have the same canonical form,
and, with the name left out, the same ``spec_hash`` (what sharing compares, issue 15).

Never imports ``broker``.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from shoal.errors import ConfigError
from shoal.processors.spec import PipelineSpec, parse_pipeline
from shoal.processors.windows import WINDOW_KINDS

WHERE: Final = "pipeline spec"
"""How ``parse_pipeline`` names a spec that came from no file (the prefix of its errors)."""


@dataclass(frozen=True, slots=True)
class SpecRefusal:
    """Why a spec was refused.

    Attributes:
        reason: ``invalid_toml``, ``unknown_aggregate`` or ``invalid_spec``.
        field: the path of the setting at fault (``windows[0].size_ms``; ``""``: the spec as a
            whole).
        message: the validator's words.
    """

    reason: str
    field: str
    message: str


@dataclass(frozen=True, slots=True)
class CanonicalSpec:
    """A validated spec in canonical form.

    Attributes:
        spec: the parsed spec.
        mapping: the canonical mapping (TOML-shaped: what ``parse_pipeline`` reads).
        spec_hash: ``sha256:<hex>`` of the canonical JSON of ``mapping`` without its name.
    """

    spec: PipelineSpec
    mapping: dict[str, Any]
    spec_hash: str


def canonical_mapping(spec: PipelineSpec) -> dict[str, Any]:
    """Every setting of ``spec``, explicit, in the shape of a TOML spec file."""
    windows = []
    for window in spec.windows:
        table: dict[str, Any] = {
            "name": window.name,
            "kind": window.kind,
            "size_ms": window.size_ms,
        }
        if WINDOW_KINDS[window.kind].takes_slide:
            table["slide_ms"] = window.slide_ms
        windows.append(table)
    limits = spec.limits
    return {
        "name": spec.name,
        "inputs": list(spec.inputs),
        "key": spec.key,
        "windows": windows,
        "aggregates": list(spec.aggregate_names),
        "lateness_ms": spec.lateness_ms,
        "allowed_lateness_ms": spec.allowed_lateness_ms,
        "idle_timeout_ms": spec.idle_timeout_ms,
        "max_hold_ms": spec.max_hold_ms or 0,
        "partitions": spec.partitions,
        "output_encodings": list(spec.output_encodings),
        "checkpoint_interval_ms": spec.checkpoint_interval_ms,
        "sketch": {"relative_accuracy": spec.sketch_accuracy},
        "limits": {
            "max_payload_bytes": limits.max_payload_bytes,
            "max_rows": limits.max_rows,
            "max_string_bytes": limits.max_string_bytes,
            "max_decompressed_bytes": limits.max_decompressed_bytes,
            # TOML has no null: false means "no bound", as in a spec file.
            "max_future_ms": False if limits.max_future_ms is None else limits.max_future_ms,
            "max_past_ms": False if limits.max_past_ms is None else limits.max_past_ms,
            "on_future": limits.on_future,
        },
    }


def spec_hash(mapping: Mapping[str, Any]) -> str:
    """The content hash of a canonical mapping, its name left out."""
    body = {k: v for k, v in mapping.items() if k != "name"}
    digest = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"sha256:{digest}"


def canonicalize(raw: Mapping[str, Any]) -> CanonicalSpec:
    """Validate a spec mapping and give its canonical form.

    Raises:
        ConfigError: the spec is invalid (``refusal_of`` says why and where).
    """
    spec = parse_pipeline(raw)
    mapping = canonical_mapping(spec)
    return CanonicalSpec(spec, mapping, spec_hash(mapping))


def canonicalize_toml(text: str) -> CanonicalSpec | SpecRefusal:
    """Parse TOML text as a spec: its canonical form, or why it is refused."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return SpecRefusal("invalid_toml", "", f"the spec is not valid TOML: {exc}")
    try:
        return canonicalize(raw)
    except ConfigError as exc:
        return refusal_of(exc)


_DEFAULTS: Final = canonical_mapping(parse_pipeline({"name": "x", "windows": [{"size_ms": 1}]}))
_SPEC_KEYS: Final = frozenset(
    {*_DEFAULTS, *_DEFAULTS["sketch"], *_DEFAULTS["limits"], "kind", "size_ms", "slide_ms"}
)
"""Every setting name a spec may hold, at any level."""

_SCOPE: Final = re.compile(r"(?:(\w+\[\d+\])|\[(\w+)\]): ")
_UNKNOWN: Final = re.compile(r"unknown setting\(s\) \['([^']*)'")
_FIRST_WORD: Final = re.compile(r"([a-z_]+)\b")


def refusal_of(error: ConfigError) -> SpecRefusal:
    """The reason code and field path of a ``parse_pipeline`` error.

    The validator names the table (``windows[0]:``, ``[limits]:``) and then the setting in its
    message; this reads them back into a path such as ``windows[0].size_ms``.
    """
    message = str(error)
    rest = message.removeprefix(f"{WHERE}: ")
    path: list[str] = []
    while (scope := _SCOPE.match(rest)) is not None:
        path.append(scope.group(1) or scope.group(2))
        rest = rest[scope.end() :]
    reason = "invalid_spec"
    leaf: str | None = None
    if "unknown aggregate" in rest or "aggregate is listed twice" in rest:
        reason, leaf = ("unknown_aggregate" if "unknown" in rest else "invalid_spec"), "aggregates"
    elif (unknown := _UNKNOWN.search(rest)) is not None:
        leaf = unknown.group(1)
    elif "[[windows]]" in rest or rest.startswith("window names"):
        leaf = "windows"
    elif "need slide_ms" in rest:
        leaf = "slide_ms"
    elif (word := _FIRST_WORD.match(rest)) is not None and word.group(1) in _SPEC_KEYS:
        leaf = word.group(1)
    elif rest.startswith("[") and (table := re.match(r"\[(\w+)\]", rest)) is not None:
        leaf = table.group(1)
    if leaf is not None:
        path.append(leaf)
    return SpecRefusal(reason, ".".join(path), message)
