"""The per-request timeline: stages laid end to end from a request row, drawn to a PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench.timeline import STAGES, plot_timeline, segments


def _row(start: float, ttft: float, latency: float, **timings: float) -> dict:
    return {"ok": True, "start": start, "ttft": ttft, "latency": latency, "timings": timings}


def test_stages_fill_the_request_from_send_to_last_token() -> None:
    row = _row(2.0, 0.5, 1.5, request_queue=0.1, prefill=0.3, kv_queue=0.05, kv_transfer=0.02)
    segs = segments(row)
    assert [s for s, _, _ in segs] == [stage for stage, _, _ in STAGES]
    durations = dict((s, d) for s, _, d in segs)
    assert durations["api"] == pytest.approx(0.1)
    assert durations["decode"] == pytest.approx(1.5 - 0.5 - 0.05 - 0.02)
    starts = [start for _, start, _ in segs]
    assert starts[0] == 2.0 and starts == sorted(starts)
    assert starts[3] == pytest.approx(2.0 + 0.5)  # the hand-off starts at the first token
    assert segs[-1][1] + segs[-1][2] == pytest.approx(2.0 + 1.5)


def test_failed_requests_and_requests_without_server_timings_are_left_out(tmp_path: Path) -> None:
    assert segments({"ok": False, "start": 0.0, "ttft": None, "latency": None, "timings": None}) == []
    assert segments(_row(0.0, 0.1, 0.2)) == []
    rows = [_row(0.1 * i, 0.2, 0.6, request_queue=0.01, prefill=0.1, kv_queue=0.01, kv_transfer=0.01) for i in range(5)]
    out = tmp_path / "t.png"
    assert plot_timeline([*rows, _row(0.0, 0.1, 0.2)], out) == 5
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
