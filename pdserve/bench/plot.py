"""Sweep plots: TTFT, TPOT/ITL and throughput/goodput against request rate (matplotlib,
imported only here, with the Agg backend)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import stat


def x_value(point: dict[str, Any], axis: str = "request_rate") -> float:
    """The x of a point: its target rate, or its achieved request throughput when the rate
    was ``inf``; its max concurrency in a concurrency sweep."""
    if axis == "max_concurrency" and point.get("max_concurrency"):
        return float(point["max_concurrency"])
    rate = point.get("request_rate")
    if rate is None or rate == "inf" or (isinstance(rate, float) and math.isinf(rate)):
        return float(point["metrics"]["request_throughput"])
    return float(rate)


def plot_sweeps(
    series: Sequence[tuple[str, list[dict[str, Any]]]],
    out: str | Path,
    title: str | None = None,
    axis: str = "request_rate",
) -> Path:
    """One figure with three panels; each (label, points) pair is one colour.

    TTFT: p50 solid, p99 dashed. Per-token latency: TPOT p50 solid, TPOT p99 dashed, ITL
    p99 dotted. Throughput: achieved req/s solid, goodput dashed (when SLOs were given).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    xlabel = "max concurrency" if axis == "max_concurrency" else "request rate (req/s)"
    any_goodput = False
    for k, (label, points) in enumerate(series):
        pts = sorted(points, key=lambda p: x_value(p, axis))
        xs = [x_value(p, axis) for p in pts]
        c = colors[k % len(colors)]

        def ys(name: str, key: str, pts: list[dict[str, Any]] = pts) -> list[float]:
            return [v if (v := stat(p["metrics"], name, key)) is not None else math.nan for p in pts]

        axes[0].plot(xs, ys("ttft_ms", "p50"), "o-", color=c, label=f"{label} p50")
        axes[0].plot(xs, ys("ttft_ms", "p99"), "s--", color=c, label=f"{label} p99")
        axes[1].plot(xs, ys("tpot_ms", "p50"), "o-", color=c, label=f"{label} TPOT p50")
        axes[1].plot(xs, ys("tpot_ms", "p99"), "s--", color=c, label=f"{label} TPOT p99")
        axes[1].plot(xs, ys("itl_ms", "p99"), "^:", color=c, label=f"{label} ITL p99")
        axes[2].plot(xs, [p["metrics"]["request_throughput"] for p in pts], "o-", color=c, label=f"{label} throughput")
        if any("goodput" in p["metrics"] for p in pts):
            any_goodput = True
            axes[2].plot(
                xs, [p["metrics"].get("goodput", math.nan) for p in pts], "s--", color=c, label=f"{label} goodput"
            )
    axes[0].set_title("time to first token")
    axes[0].set_ylabel("ms")
    axes[1].set_title("per-token latency")
    axes[1].set_ylabel("ms")
    axes[2].set_title("throughput and goodput" if any_goodput else "throughput")
    axes[2].set_ylabel("completed req/s")
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
