"""Write the golden payloads of the shoal wire contract (``schemas/CONTRACT.md``).

Run from the repository root, then review and commit the diff::

    .venv/bin/python schemas/golden/generate.py

The output is deterministic: the same inputs give the same bytes (zstd output depends on the
zstd library version, which ``manifest.json`` records). Tests decode the committed files and
never run this script.

Payloads are built from the contract's primitives (``_wire.py``: JSON text, MsgPack maps,
little-endian buffers, zstd frames), not with shoal's encoder, so the goldens check the
decoder against the contract rather than against the encoder. The ``encoder`` cases are the
exception: they pin that what ``shoal.encode_batch`` writes conforms too.

Layout: ``<encoding>/<case>.<ext>`` with ``<encoding>/<case>.expected.json`` beside it
(``_valid.py``), and ``invalid/<case>.<ext>`` (``_invalid.py``). ``manifest.json`` lists every
file with its MQTT content type (null: none was set, the in-band marker decides) and what
decoding must give: the envelope and rows, or the error class, reason, field and row, with
any ``limits`` overrides and receiver clock ``now_ms`` to decode with.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Final

import zstandard
from _invalid import Invalid, invalid_cases
from _valid import Valid, valid_cases

HERE: Final = Path(__file__).resolve().parent


def write(valid: list[Valid], invalid: list[Invalid]) -> None:
    """Replace every golden file and the manifest."""
    for folder in HERE.iterdir():
        # outputs/ holds the output messages, written by generate_outputs.py.
        if folder.is_dir() and not folder.name.startswith(("_", ".")) and folder.name != "outputs":
            shutil.rmtree(folder)
    valid_entries = []
    for case in valid:
        expected = case.path.rsplit(".", 1)[0] + ".expected.json"
        _write(case.path, case.payload)
        _write(expected, expected_json(case).encode())
        valid_entries.append(
            {
                "file": case.path,
                "content_type": case.content_type,
                "expected": expected,
                "note": case.note,
            }
        )
    invalid_entries = []
    for bad in invalid:
        _write(bad.path, bad.payload)
        entry: dict[str, Any] = {
            "file": bad.path,
            "content_type": bad.content_type,
            "error": bad.error,
            "reason": bad.reason,
            "field": bad.field,
            "row": bad.row,
        }
        if bad.limits:
            entry["limits"] = bad.limits
        if bad.now_ms is not None:
            entry["now_ms"] = bad.now_ms
        if bad.schema_expressible is not None:
            entry["schema_expressible"] = bad.schema_expressible
        if bad.note:
            entry["note"] = bad.note
        invalid_entries.append(entry)
    manifest = {
        "contract": "schemas/CONTRACT.md",
        "version": 1,
        "generator": "schemas/golden/generate.py",
        "zstd": zstandard.ZSTD_VERSION,
        "valid": valid_entries,
        "invalid": invalid_entries,
    }
    _write("manifest.json", (_dumps(manifest, indent=1) + "\n").encode())


def _write(path: str, data: bytes) -> None:
    target = HERE / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def expected_json(case: Valid) -> str:
    """The expected envelope and rows, one row per line so diffs stay readable."""
    rows = ",\n".join(f"  {_dumps(r)}" for r in case.rows)
    body = f"[\n{rows}\n ]" if case.rows else "[]"
    return f'{{\n "envelope": {_dumps(case.envelope)},\n "rows": {body}\n}}\n'


def _dumps(obj: Any, indent: int | None = None) -> str:
    # Python prints floats in shortest round-trip form, so every value survives exactly.
    return json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False)


def main() -> int:
    """Regenerate every golden file; prints a one-line summary."""
    valid, invalid = valid_cases(), invalid_cases()
    paths = [c.path for c in valid] + [c.path for c in invalid]
    assert len(paths) == len(set(paths)), "two cases share a file name"
    write(valid, invalid)
    sys.stdout.write(f"wrote {len(valid)} valid and {len(invalid)} invalid payloads\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
