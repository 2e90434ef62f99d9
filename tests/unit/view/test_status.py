"""``shoal status``'s document: per gateway, the partitions' views merged; why windows wait."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shoal.scaler.monitor import GatewayLag, Snapshot
from shoal.view.status import format_status, gateway_notes, pipeline_status

NOW = 1_700_000_100_000
HOUR = 3_600_000


def view(watermark: int | None, **extra: Any) -> dict[str, Any]:
    base = {
        "watermark": watermark,
        "holding": True,
        "holding_others_ms": 0,
        "released": False,
        "refused_batches": 0,
        "clock_offset_ms": 5,
    }
    return {**base, **extra}


def snapshot(combiners: dict[int, dict[str, Any]]) -> Snapshot:
    return Snapshot(
        at_ms=NOW,
        rows_in_per_s=1000.0,
        rows_out_per_s=990.0,
        workers=("w1",),
        lag=(GatewayLag("a", 9, 7, 2, 2000, 300), GatewayLag("b", 4, 4, 0, 0, None)),
        lag_batches=2,
        lag_rows=2000,
        oldest_unconfirmed_age_ms=300,
        rows_generated=10_000,
        batch_rows_applied=8_000,
        windows_emitted=3,
        rows_in_results=7_000,
        deadletters=4,
        late_rows=12,
        window_memberships=7_012,
        windows_per_row=1,
        latest=(),
        combiners=combiners,
        worker_metrics={"w1": {"state": "running", "rows_per_s": 990.0, "cpu_percent": 40.0}},
    )


def beat(progress: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"at": NOW - 400, "watermark": NOW - 2_000, "closed_through": NOW - 4_000,
            "max_hold_ms": 24_000, "pending_batches": 0, "gateway_progress": progress}  # fmt: skip


def test_partitions_name_the_gateway_the_windows_wait_for_and_gateways_merge() -> None:
    status = pipeline_status(
        "p",
        snapshot(
            {
                0: beat(
                    {
                        "a": view(NOW - 2_000),
                        "b": view(NOW - 500),
                        "c": view(NOW - HOUR, holding=False, released=True, clock_offset_ms=HOUR),
                    }
                ),
                1: beat(
                    {
                        "a": view(NOW - 1_000, holding_others_ms=1_500, clock_offset_ms=15),
                        "d": view(None, holding=False, refused_batches=7),
                    }
                ),
            }
        ),
        listened_s=2.0,
    )
    assert status["late_measurements_while_listening"] == 12
    assert [p["waiting_for"] for p in status["partitions"]] == [["a"], ["a"]]
    gateways = {g["id"]: g for g in status["gateways"]}
    assert set(gateways) == {"a", "b", "c", "d"}
    a = gateways["a"]
    assert a["watermark"] == NOW - 2_000  # the lower of the two partitions'
    assert a["holding_others_ms"] == 1_500
    assert a["clock_offset_ms"] == 10
    assert a["unconfirmed_batches"] == 2
    assert gateways["c"]["released"]
    assert gateways["c"]["event_time_behind_ms"] == HOUR
    assert gateways["d"]["refused_batches"] == 7
    assert gateways["d"]["unconfirmed_batches"] is None  # no status seen from it
    text = format_status(status)
    assert "watermark held at" in text
    assert "by a" in text


def test_a_holding_gateway_without_data_is_named_and_no_combiner_is_said() -> None:
    status = pipeline_status("p", snapshot({0: beat({"new": view(None), "b": view(NOW)})}), 1.0)
    assert status["partitions"][0]["waiting_for"] == ["new"]
    assert "first accepted data of new" in status["partitions"][0]["why"]
    empty = pipeline_status("p", snapshot({}), 1.0)
    assert empty["partitions"] == []
    assert "no combiner heartbeat" in format_status(empty)


def test_gateway_notes_name_what_is_wrong_and_are_stable_without_durations() -> None:
    status = pipeline_status(
        "p",
        snapshot(
            {
                0: beat(
                    {
                        "fine": view(NOW),
                        "late": view(
                            NOW - HOUR, holding=False, released=True, clock_offset_ms=HOUR
                        ),
                        "slow": view(NOW - 9_000, holding_others_ms=4_000),
                        "ahead": view(
                            None, holding=False, refused_batches=3, clock_offset_ms=-HOUR
                        ),
                    }
                )
            }
        ),
        listened_s=1.0,
    )
    notes = gateway_notes(status)
    assert set(notes) == {"late", "slow", "ahead"}
    assert "released" in notes["late"]
    assert "60.0 min behind" in notes["late"]
    assert "for 4.0 s" in notes["slow"]
    assert "3 batches refused" in notes["ahead"]
    assert "60.0 min ahead" in notes["ahead"]
    stable = gateway_notes(status, durations=False)
    assert "for" not in stable["slow"]
    assert stable["ahead"].startswith("batches refused")


def test_partials_a_partition_refused_are_reported_only_when_there_are_some() -> None:
    refusing = {**beat({"a": view(NOW)}), "partials_refused": 2}
    status = pipeline_status("p", snapshot({0: refusing, 1: beat({"a": view(NOW)})}), 1.0)
    assert [p["partials_refused"] for p in status["partitions"]] == [2, 0]
    lines = format_status(status).splitlines()
    assert "2 partials refused" in next(line for line in lines if "partition 0:" in line)
    assert "refused (see" not in next(line for line in lines if "partition 1:" in line)


def test_clamped_measurements_are_summed_over_the_workers_and_shown_when_there_are_some() -> None:
    snap = snapshot({0: beat({"a": view(NOW)})})
    quiet = pipeline_status("p", snap, 1.0)  # a worker before rows_clamped: counts as 0
    assert quiet["clamped_measurements"] == 0
    assert quiet["workers"][0]["rows_clamped"] == 0
    assert "clamped" not in format_status(quiet)
    workers = {
        "w1": {"state": "running", "rows_clamped": 1_200},
        "w2": {"state": "running", "rows_clamped": 34},
    }
    status = pipeline_status("p", replace(snap, worker_metrics=workers), 1.0)
    assert status["clamped_measurements"] == 1_234
    assert [w["rows_clamped"] for w in status["workers"]] == [1_200, 34]
    line = next(x for x in format_status(status).splitlines() if "clamped" in x)
    assert "1,234 measurements had timestamps beyond max_future_ms" in line


def test_corrections_are_reported_when_the_spec_allows_late_corrections() -> None:
    correcting = {
        **beat({"a": view(NOW)}),
        "allowed_lateness_ms": 30_000,
        "kept_windows": 3,
        "corrections_emitted": 2,
        "rows_corrected": 1_500,
    }
    status = pipeline_status("p", snapshot({0: correcting, 1: beat({"a": view(NOW)})}), 1.0)
    first, second = status["partitions"]
    assert (first["kept_windows"], first["corrections_emitted"], first["rows_corrected"]) == (
        3,
        2,
        1_500,
    )
    assert second["allowed_lateness_ms"] == 0  # a heartbeat without the fields counts as 0
    lines = format_status(status).splitlines()
    line = next(x for x in lines if "partition 0:" in x)
    assert "2 revised results, 1,500 late measurements folded in, 3 closed windows kept" in line
    assert "allowed lateness 30.0 s" in line
    assert "corrections" not in next(x for x in lines if "partition 1:" in x)


def test_a_partition_hosted_by_a_pool_combiner_names_its_owner() -> None:
    hosted = {**beat({"a": view(NOW)}), "owner": "edge-7-4242"}
    status = pipeline_status("p", snapshot({0: hosted, 1: beat({"a": view(NOW)})}), 1.0)
    assert [p["owner"] for p in status["partitions"]] == ["edge-7-4242", None]
    text = format_status(status)
    assert "partition 0 (pool combiner edge-7-4242): windows closed" in text
    assert "partition 1: windows closed" in text


def test_a_pipeline_whose_functions_fail_is_degraded_with_its_failures_summed() -> None:
    snap = snapshot({0: beat({"a": view(NOW)})})
    plain = pipeline_status("p", snap, 1.0)
    assert "degraded" not in plain
    assert "functions" not in format_status(plain)

    def report(failures: dict[str, int], consecutive: int, degraded: bool) -> dict[str, Any]:
        return {
            "batches_ok": 3,
            "failures": failures,
            "consecutive_failures": consecutive,
            "degraded": degraded,
            "last_error": "boom" if failures else None,
        }

    workers = {
        "w1": {"state": "running", "functions": {"p": report({"function_error": 4}, 4, True)}},
        "w2": {"state": "running", "functions": {"p": report({"function_error": 1}, 0, False)}},
        "w3": {"state": "running", "functions": {"other": report({}, 0, False)}},
    }
    status = pipeline_status("p", replace(snap, worker_metrics=workers), 1.0)
    assert status["degraded"] is True
    assert status["functions"]["failed_batches"] == {"function_error": 5}
    assert set(status["functions"]["workers"]) == {"w1", "w2"}
    line = next(x for x in format_status(status).splitlines() if "functions" in x)
    assert "DEGRADED" in line
    assert "5 function_error" in line
    healthy = {"w2": workers["w2"]}
    assert pipeline_status("p", replace(snap, worker_metrics=healthy), 1.0)["degraded"] is False
    # A combiner whose UDAF calls fail reports the same way, by its client id.
    stuck = {
        **beat({"a": view(NOW)}),
        "id": "shoal-combiner-p-0",
        "functions": {"p": report({"function_timeout": 1, "function_stuck": 2}, 3, True)},
    }
    status = pipeline_status("p", replace(snapshot({0: stuck}), worker_metrics=healthy), 1.0)
    assert status["degraded"] is True
    assert set(status["functions"]["workers"]) == {"w2", "shoal-combiner-p-0"}
    assert status["functions"]["failed_batches"] == {
        "function_error": 1,
        "function_timeout": 1,
        "function_stuck": 2,
    }
