"""Write the golden output messages of the shoal contract (``schemas/CONTRACT.md`` §13-§22).

Run from the repository root, then review and commit the diff::

    .venv/bin/python schemas/golden/generate_outputs.py

Unlike the batch goldens (``generate.py``, built from the contract's rules), these are what
shoal's own code publishes for a fixed scenario (``_outputs.py``): the contract describes the
messages as they are. Tests run the scenario again and require the same bytes, so a change
to a message shows up as a change to these files, to be reviewed with its schema.

Layout: ``outputs/<case>.json`` (the exact payload) or ``outputs/<case>.msgpack`` with
``outputs/<case>.expected.json`` (its JSON view: ``bin`` as base64, see CONTRACT.md §13).
``outputs/manifest.json`` lists each file with its kind, topic, schema and what it shows.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Final

from _outputs import OutputCase, output_cases

from shoal.schemas.catalog import MESSAGES, json_view

HERE: Final = Path(__file__).resolve().parent
FOLDER: Final = "outputs"


def view_file(case: OutputCase) -> str | None:
    """The JSON view's path below ``golden/`` (MsgPack cases only)."""
    return None if case.syntax == "json" else f"{FOLDER}/{case.name}.expected.json"


def view_text(case: OutputCase) -> str:
    """The JSON view of a MsgPack case, as written (indented, keys in message order)."""
    return json.dumps(json_view(case.payload), indent=1, ensure_ascii=False) + "\n"


def manifest(cases: list[OutputCase]) -> dict[str, Any]:
    """What ``outputs/manifest.json`` holds for ``cases``."""
    schemas = {m.name: m.schema for m in MESSAGES}
    return {
        "contract": "schemas/CONTRACT.md",
        "generator": "schemas/golden/generate_outputs.py",
        "messages": [
            {
                "file": case.file,
                "kind": case.kind,
                "schema": schemas[case.kind],
                "topic": case.topic,
                "view": view_file(case),
                "note": case.note,
            }
            for case in cases
        ],
    }


def main() -> int:
    """Regenerate every output golden; prints a one-line summary."""
    cases = output_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "two cases share a name"
    shutil.rmtree(HERE / FOLDER, ignore_errors=True)
    (HERE / FOLDER).mkdir()
    for case in cases:
        (HERE / case.file).write_bytes(case.payload)
        view = view_file(case)
        if view is not None:
            (HERE / view).write_text(view_text(case), "utf-8")
    text = json.dumps(manifest(cases), indent=1, ensure_ascii=False) + "\n"
    (HERE / FOLDER / "manifest.json").write_text(text, "utf-8")
    sys.stdout.write(f"wrote {len(cases)} output messages\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
