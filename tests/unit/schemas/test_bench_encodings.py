"""``shoal bench encodings``: a fast smoke run by default, the real sizes behind ``benchmark``.

(Kept beside the wire tests because it measures the wire format; the code lives in
``shoal.loadtest.bench_encodings`` and ``shoal._cli.bench``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.cli import main
from shoal.loadtest import bench_encodings as bench
from shoal.schemas import Encoding

KEYS = {"encoding", "batch_size", "bytes_per_measurement", "encode_meas_per_s", "decode_meas_per_s"}
CODECS = {(e.value, False) for e in Encoding} | {(Encoding.BINARY_COLUMNAR.value, True)}


def check_records(records: list[dict[str, object]], sizes: tuple[int, ...], repeats: int) -> None:
    assert isinstance(records, list)
    assert len(records) == len(sizes) * len(CODECS)
    for record in records:
        assert set(record) >= KEYS
        assert record["batch_size"] in sizes
        assert record["repeats"] == repeats
        for key in ("bytes_per_measurement", "encode_meas_per_s", "decode_meas_per_s"):
            value = record[key]
            assert isinstance(value, float)
            assert value > 0
    for size in sizes:
        at_size = {(r["encoding"], r["zstd"]) for r in records if r["batch_size"] == size}
        assert at_size == CODECS


def test_cli_smoke_writes_the_records_and_prints_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "enc.json"
    code = main(["bench", "encodings", "--sizes", "40,200", "--repeat", "1", "--json", str(out)])
    assert code == 0
    records = json.loads(out.read_text("utf-8"))
    check_records(records, (40, 200), 1)
    assert all(r["machine"]["cores_logical"] >= 1 for r in records)
    printed = capsys.readouterr().out
    assert "1,000 sensors, values at 0.001 resolution" in printed
    assert "median of 1 timed samples" in printed
    assert "Python" in printed
    assert "polars" in printed
    for codec in ("json-rows", "msgpack-columnar", "binary-columnar+zstd"):
        assert codec in printed
    # Ratios are against JSON rows at the same size, so JSON rows reads 1.00x throughout.
    json_lines = [line for line in printed.splitlines() if line.startswith("json-rows ")]
    assert len(json_lines) == 2
    assert all(line.count("1.00x") == 3 for line in json_lines)


def test_wire_sizes_follow_from_the_layouts() -> None:
    # Sizes are deterministic (no timing): columnar beats rows, binary beats MsgPack maps.
    results = {r.codec: r for r in bench.run([500], repeats=1)}
    size = {codec: r.bytes_per_measurement for codec, r in results.items()}
    assert size["binary-columnar+zstd"] < size["binary-columnar"]
    assert size["binary-columnar"] < size["msgpack-columnar"] < size["msgpack-rows"]
    assert size["msgpack-rows"] < size["json-rows"]
    for r in results.values():
        assert r.payload_bytes == pytest.approx(r.bytes_per_measurement * 500)


def test_ratio_and_table_use_json_rows_as_the_baseline() -> None:
    base = bench.EncodingResult("json-rows", False, "json-rows", 10, 1000, 100.0, 2e6, 1e6, 3)
    other = bench.EncodingResult(
        "binary-columnar", True, "binary-columnar+zstd", 10, 100, 10.0, 4e6, 5e5, 3
    )
    assert bench.ratio(other, base) == {"bytes": 0.1, "encode": 2.0, "decode": 0.5}
    table = bench.format_table([base, other])
    assert "0.10x" in table
    assert "2.00x" in table
    assert "0.50x" in table


@pytest.mark.parametrize("bad", ["0,10", "ten", ""])
def test_bad_sizes_are_refused(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "encodings", "--sizes", bad])
    assert info.value.code == 2
    assert "sizes" in capsys.readouterr().err


def test_zero_repeats_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "encodings", "--sizes", "10", "--repeat", "0"]) == 2
    assert "--repeat" in capsys.readouterr().err


@pytest.mark.benchmark
def test_benchmark_real_sizes(tmp_path: Path) -> None:
    out = tmp_path / "enc.json"
    assert main(["bench", "encodings", "--json", str(out)]) == 0
    check_records(json.loads(out.read_text("utf-8")), bench.DEFAULT_SIZES, bench.DEFAULT_REPEATS)
