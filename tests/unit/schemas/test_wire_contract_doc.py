"""CONTRACT.md stays in step with the code and the golden files it quotes."""

from __future__ import annotations

import re
from pathlib import Path

from shoal.schemas import DEFAULT_LIMITS, Encoding

SCHEMAS = Path(__file__).resolve().parents[3] / "schemas"
SOURCE = Path(__file__).resolve().parents[3] / "src" / "shoal" / "schemas"
CONTRACT = (SCHEMAS / "CONTRACT.md").read_text("utf-8")


def _section(start: str, end: str) -> str:
    """The text of CONTRACT.md from the heading ``start`` to the heading ``end``."""
    return CONTRACT[CONTRACT.index(start) : CONTRACT.index(end)]


def _reasons_in(folder: Path, skip: tuple[str, ...] = ()) -> set[str]:
    found: set[str] = set()
    for path in folder.glob("*.py"):
        if path.name in skip:
            continue
        found |= set(re.findall(r'reason="([a-z_]+)"', path.read_text("utf-8")))
    return found


def test_every_reason_in_the_source_is_in_the_error_table() -> None:
    errors = _section("## 8. Errors", "## 9.")
    table = set(re.findall(r"^\| `([a-z_]+)` \| (?:Decode|Schema)Error", errors, re.M))
    assert _reasons_in(SOURCE) == table


def test_every_adapter_reason_is_in_the_adapter_table() -> None:
    adapters = _section("### 18.1 Dead letters from adapters", "## 19.")
    first_cells = re.findall(r"^\| (`[a-z_]+`(?:, `[a-z_]+`)*) \| [A-Za-z]+Error", adapters, re.M)
    table = {name for cell in first_cells for name in re.findall(r"`([a-z_]+)`", cell)}
    # mapping.py's (and its reader _table.py's) reasons are ConfigErrors of the mapping file,
    # refused at start, not dead letters
    skip = ("mapping.py", "_table.py")
    assert _reasons_in(SOURCE.parent / "adapters", skip=skip) <= table


def test_every_encoding_and_content_type_is_documented() -> None:
    for encoding in Encoding:
        assert f"`{encoding.value}`" in CONTRACT
        assert f"`{encoding.content_type}`" in CONTRACT


def test_limit_defaults_match_the_code() -> None:
    table = dict(re.findall(r"^\| `(max_[a-z_]+)` — [^|]+\| ([^|]+) \|", CONTRACT, re.M))
    assert set(table) == {
        "max_payload_bytes",
        "max_rows",
        "max_string_bytes",
        "max_decompressed_bytes",
        "max_future_ms",
        "max_past_ms",
    }
    for name, text in table.items():
        value = getattr(DEFAULT_LIMITS, name)
        if value is None:
            assert text.strip() == "none"
        else:
            # "16 MiB (16 777 216)" or "1 000 000" or "300 000 (5 min)": the exact number.
            exact = re.search(r"\(([\d ]+)\)", text) or re.match(r"\s*([\d ]+)", text)
            assert exact is not None, text
            assert int(exact.group(1).replace(" ", "")) == value, name


def test_hex_dumps_are_the_golden_files_they_name() -> None:
    # Each xxd block belongs to the last golden file named before it.
    checked = 0
    for block in re.finditer(r"```\n((?:[0-9a-f]{8}: .*\n)+)```", CONTRACT):
        names = re.findall(r"`golden/([\w/.-]+\.msgpack)`", CONTRACT[: block.start()])
        lines = block.group(1).splitlines()
        data = bytes.fromhex("".join(line[10:50].replace(" ", "") for line in lines))
        assert data == (SCHEMAS / "golden" / names[-1]).read_bytes(), names[-1]
        checked += 1
    assert checked == 3


def test_the_json_example_is_the_golden_file() -> None:
    golden = (SCHEMAS / "golden" / "json-rows" / "example.json").read_text("utf-8")
    assert '"gateway_id": "gw-01"' in golden
    for fragment in ('{"sensor_id": "t1", "ts": 1700000000000, "value": 21.5, "unit": "°C"}',):
        assert fragment in golden
        assert fragment in CONTRACT
