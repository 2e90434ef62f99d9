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
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import tomli_w

from shoal.errors import ConfigError
from shoal.processors.spec import PipelineSpec, inline_function_files, parse_pipeline
from shoal.processors.windows import WINDOW_KINDS
from shoal.rules.expressions import RULE_REASONS


@dataclass(frozen=True, slots=True)
class SpecRefusal:
    """Why a spec was refused.

    Attributes:
        reason: ``invalid_toml``, ``unknown_aggregate``, ``invalid_expression`` (a
            ``where``, ``derive``, ``having`` or alert condition), ``function_failed`` (a
            user function did not import or failed on sample data) or ``invalid_spec``.
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
        table: dict[str, Any] = {"name": window.name, "kind": window.kind}
        if window.gap_ms is not None:  # a session window: its size is its gap
            table.update(gap_ms=window.gap_ms, max_duration_ms=window.max_duration_ms)
            windows.append(table)
            continue
        table["size_ms"] = window.size_ms
        kind = WINDOW_KINDS[window.kind]
        if kind.takes_slide:
            table[kind.slide_key] = window.slide_ms
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
        # only when set: the hashes of specs that leave it at its default stay as they were
        **({"key_results_every_ms": e} if (e := spec.key_results_every_ms) else {}),
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
            # only when set: the hashes of specs that leave it at its default stay as they were
            **({} if spec.max_state_cells is None else {"max_state_cells": spec.max_state_cells}),
        },
        **_rules(spec),
    }


def _rules(spec: PipelineSpec) -> dict[str, Any]:
    """The rules settings, only where the spec has them (other specs' hashes stay as were)."""
    out: dict[str, Any] = {}
    if spec.where is not None:
        out["where"] = spec.where
    if spec.derive:
        out["derive"] = dict(spec.derive)
    if spec.having is not None:
        out["having"] = spec.having
    if spec.alerts:
        out["alerts"] = [
            {
                "name": a.name,
                "condition": a.condition,
                "for": a.for_windows,
                "window": a.window,
                **({} if a.resolve is None else {"resolve": a.resolve}),
            }
            for a in spec.alerts
        ]
    if spec.functions:
        out["functions"] = {
            f.name: {
                "kind": f.kind,
                "code": f.code,
                "entry": f.entry,
                "returns": f.returns,
                "budget_ms": f.budget_ms,
            }
            for f in spec.functions
        }
        out["degrade_after"] = spec.degrade_after
    return out


def spec_hash(mapping: Mapping[str, Any]) -> str:
    """The content hash of a canonical mapping, its name left out."""
    body = {k: v for k, v in mapping.items() if k != "name"}
    digest = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"sha256:{digest}"


def canonicalize(raw: Mapping[str, Any]) -> CanonicalSpec:
    """Validate a spec mapping and give its canonical form.

    Raises:
        ConfigError: the spec is invalid (its ``field`` and ``reason`` say where and why).
    """
    spec = parse_pipeline(raw)
    mapping = canonical_mapping(spec)
    return CanonicalSpec(spec, mapping, spec_hash(mapping))


def inline_files(text: str, folder: Path) -> str:
    """Spec TOML with each function's ``file`` read into its ``code`` (paths from ``folder``).

    What ``shoal pipeline deploy FILE`` sends: the code travels inside the spec, so the
    control plane stores and versions it with the document. Text without ``file`` is
    returned as is.

    Raises:
        ConfigError: a referenced file cannot be read.
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return text  # the control plane answers invalid_toml
    functions = raw.get("functions")
    if not isinstance(functions, dict) or not any(
        isinstance(t, dict) and "file" in t for t in functions.values()
    ):
        return text
    return tomli_w.dumps(inline_function_files(raw, folder), multiline_strings=True)


def canonicalize_toml(text: str) -> CanonicalSpec | SpecRefusal:
    """Parse TOML text as a spec: its canonical form, or why it is refused."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return SpecRefusal("invalid_toml", "", f"the spec is not valid TOML: {exc}")
    try:
        return canonicalize(raw)
    except ConfigError as exc:  # the validator names the field at fault and, if specific, why
        reason = exc.reason or "invalid_spec"
        if reason in RULE_REASONS:  # one refusal code for every rejected expression
            reason = "invalid_expression"
        return SpecRefusal(reason, exc.field or "", str(exc))
