"""Per-request timeline: one bar per request, coloured by stage, from what the client
measured (start, TTFT, end) and the server's ``meta_info.timings`` (``/generate`` only).

A request's bar starts when the client sent it. Its stages, in order:

- ``api``: HTTP, tokenizing and publishing, and the first token's way back (TTFT less the
  two stages below);
- ``queue wait (prefill)``, ``prefill``: until the first token (so the three end at TTFT);
- ``queue wait (decode)``, ``kv transfer``: the hand-off to a decode worker;
- ``decode``: the rest, until the last token.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (stage, the timings key it comes from, colour)
STAGES = (
    ("api", "", "#bab0ac"),
    ("queue wait (prefill)", "request_queue", "#f28e2b"),
    ("prefill", "prefill", "#4e79a7"),
    ("queue wait (decode)", "kv_queue", "#edc948"),
    ("kv transfer", "kv_transfer", "#e15759"),
    ("decode", "", "#59a14f"),
)


def segments(row: dict[str, Any]) -> list[tuple[str, float, float]]:
    """``(stage, start, seconds)`` of one request row (``RequestRecord.row()``); empty for a
    failed request or one without server timings."""
    timings = row.get("timings") or {}
    if not row.get("ok") or row.get("ttft") is None or row.get("latency") is None or "prefill" not in timings:
        return []
    queue, prefill = timings.get("request_queue", 0.0), timings["prefill"]
    ttft, latency = float(row["ttft"]), float(row["latency"])
    kv_queue, transfer = timings.get("kv_queue", 0.0), timings.get("kv_transfer", 0.0)
    durations = [
        max(ttft - queue - prefill, 0.0),
        queue,
        prefill,
        kv_queue,
        transfer,
        max(latency - ttft - kv_queue - transfer, 0.0),
    ]
    out = []
    at = float(row["start"])
    for (stage, _, _), seconds in zip(STAGES, durations, strict=True):
        out.append((stage, at, seconds))
        at += seconds
    return out


def plot_timeline(rows: Sequence[dict[str, Any]], out: str | Path, title: str | None = None) -> int:
    """Draw the rows that have server timings to ``out`` (PNG); returns how many."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    bars = [s for s in (segments(r) for r in sorted(rows, key=lambda r: r.get("start", 0.0))) if s]
    colours = {stage: colour for stage, _, colour in STAGES}
    height = min(max(2.5, 0.12 * len(bars) + 1.5), 14)
    fig, ax = plt.subplots(figsize=(11, height))
    for y, segs in enumerate(bars):
        ax.broken_barh(
            [(start, seconds) for _, start, seconds in segs],
            (y - 0.4, 0.8),
            facecolors=[colours[stage] for stage, _, _ in segs],
        )
    ax.set_ylim(-1, max(len(bars), 1))
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the benchmark started")
    ax.set_ylabel("request (by start time)")
    ax.legend(
        handles=[Patch(color=c, label=s) for s, _, c in STAGES],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 if len(bars) > 20 else -0.25),
        ncol=len(STAGES),
        frameon=False,
    )
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return len(bars)
