"""``alert_after_result``: alert transitions timed against their window's result message."""

from __future__ import annotations

from shoal.loadtest.alert_latency import alert_after_result
from shoal.loadtest.bench_pipeline import alert_lines
from tests.support.alert_messages import alert_message as _alert
from tests.support.alert_messages import result_message as _result


def test_each_transition_is_timed_from_its_own_partitions_first_result() -> None:
    results = [
        (10.000, _result(0, 5_000, partition=0, part=0)),
        (10.004, _result(0, 5_000, partition=0, part=1)),  # later part: not the reference
        (10.050, _result(0, 5_030, partition=1)),
        (11.000, _result(1000, 6_000, partition=0)),
    ]
    alerts = [
        (10.002, _alert(0, 5_001)),  # 2 ms after partition 0's first part
        (10.056, _alert(0, 5_034, "resolved", partition=1)),  # 6 ms after partition 1's
        (11.010, _alert(1000, 6_007)),  # 10 ms
        (12.000, _alert(2000, 7_000)),  # its result never came
    ]
    out = alert_after_result(results, alerts)
    assert out["received"] == {"p50": 6.0, "p99": 10.0, "max": 10.0, "count": 3}
    assert out["emitted"] == {"p50": 4.0, "p99": 7.0, "max": 7.0, "count": 3}
    assert out["transitions"] == {"firing": 3, "resolved": 1}
    assert out["unmatched"] == 1
    assert out["windows_received"] == 3


def test_only_results_received_in_the_measured_span_are_timed() -> None:
    results = [(1.0, _result(0, 100)), (5.0, _result(1000, 200))]
    alerts = [(1.5, _alert(0, 150)), (5.001, _alert(1000, 203))]
    out = alert_after_result(results, alerts, since=2.0, until=6.0)
    assert out["received"] == {"p50": 1.0, "p99": 1.0, "max": 1.0, "count": 1}
    assert out["emitted"] == {"p50": 3.0, "p99": 3.0, "max": 3.0, "count": 1}
    assert out["outside_window"] == 1


def test_no_transition_no_figure_and_the_table_says_so() -> None:
    out = alert_after_result([(1.0, _result(0, 100))], [])
    assert out["received"] is None
    assert out["emitted"] is None
    lines = alert_lines({**out, "retained_ignored": 0})
    assert lines == [
        "  alert transitions: 0 firing, 0 resolved; 0 outside the measured window, "
        "0 without their result"
    ]
    assert alert_lines(None) == []
