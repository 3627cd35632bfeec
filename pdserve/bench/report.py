"""Results as text: the end-of-run table, the sweep summary, markdown, the JSON file."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson

from pdserve.bench.metrics import stat


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"


def point_table(point: dict[str, Any], backend: str = "", title: str = "Serving Benchmark Result") -> str:
    """The result of one run, one metric a line."""
    m = point["metrics"]
    w = 44
    lines = [f"{' ' + title + ' ':=^{w + 16}}"]

    def row(name: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{name + ':':<{w}}{_num(value, digits):>16}")

    def section(name: str) -> None:
        lines.append(f"{' ' + name + ' ':-^{w + 16}}")

    if backend:
        lines.append(f"{'Backend:':<{w}}{backend:>16}")
    row("Target request rate (req/s)", point["request_rate"])
    if m.get("offered_request_rate") is not None:
        row("Offered request rate (schedule, req/s)", m["offered_request_rate"])
    row("Max concurrency", point.get("max_concurrency") or "-")
    row("Successful requests", m["completed"])
    row("Failed requests", m["failed"])
    row("Benchmark duration (s)", m["duration_s"])
    row("Total input tokens", m["total_input_tokens"])
    row("Cached input tokens (prefix cache)", m.get("total_cached_tokens", "not reported"))
    row("Total generated tokens", m["total_output_tokens"])
    row("Request throughput (req/s)", m["request_throughput"])
    row("Input token throughput (tok/s)", m["input_throughput"])
    row("Output token throughput (tok/s)", m["output_throughput"])
    row("Total token throughput (tok/s)", m["total_token_throughput"])
    if "goodput" in m:
        lines.append(f"{'SLO:':<{w - 24}}{m['slo']['text']:>40}")
        row("Goodput (req/s)", m["goodput"])
        row("Goodput fraction", m["goodput_fraction"], 3)
    if m.get("short_outputs"):
        row("Requests with fewer tokens than asked", m["short_outputs"])
    if m.get("prefix_cache_hit_rate") is not None:
        row("Prefix cache hit rate", m["prefix_cache_hit_rate"], 3)
    row("Seed (prompts, lengths, arrivals)", point.get("seed", "-"))
    for key, name in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st)"),
        ("itl_ms", "Inter-token Latency"),
        ("e2e_latency_ms", "End-to-end Latency"),
    ):
        d = m.get(key)
        if not d:
            continue
        section(name)
        short = key.split("_")[0].upper() if key != "e2e_latency_ms" else "E2E"
        for s in ("mean", "std", "median", "p90", "p99"):
            row(f"{s.capitalize() if s[0] != 'p' else s.upper()} {short} (ms)", d[s])
    if m.get("send_lag_ms"):
        section("Client send lag (actual - scheduled)")
        d = m["send_lag_ms"]
        for s in ("median", "p99", "max"):
            row(f"{s} lag (ms)", d[s], 3)
    timings = m.get("server_timings_ms") or {}
    if timings:
        section("Server timings (meta_info.timings)")
        for key, d in timings.items():
            if "p50" in d:
                row(f"{key} p50 (ms)", d["p50"], 3)
                row(f"{key} p99 (ms)", d["p99"], 3)
            else:
                row(f"{key} (requests)", d.get("count"))
    if m.get("client_behind_schedule"):
        lines.append(
            "WARNING: the client fell behind its arrival schedule (see send lag): results are partly client-bound"
        )
    if m.get("errors"):
        section("Errors (count: message)")
        for msg, count in m["errors"].items():
            lines.append(f"{count:>5}: {msg[: w + 9]}")
    lines.append("=" * (w + 16))
    return "\n".join(lines)


SUMMARY_COLUMNS = (
    ("rate", None, None),
    ("conc", None, None),
    ("ok/fail", None, None),
    ("req/s", "request_throughput", None),
    ("out tok/s", "output_throughput", None),
    ("TTFT p50", "ttft_ms", "p50"),
    ("TTFT p99", "ttft_ms", "p99"),
    ("TPOT p50", "tpot_ms", "p50"),
    ("TPOT p99", "tpot_ms", "p99"),
    ("ITL p50", "itl_ms", "p50"),
    ("ITL p99", "itl_ms", "p99"),
    ("E2E p50", "e2e_latency_ms", "p50"),
    ("goodput", "goodput", None),
)


def summary_rows(points: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = [c[0] for c in SUMMARY_COLUMNS]
    rows = []
    for p in points:
        m = p["metrics"]
        row = [_num(p["request_rate"], 2), _num(p.get("max_concurrency")), f"{m['completed']}/{m['failed']}"]
        for _, key, sub in SUMMARY_COLUMNS[3:]:
            if key is None:
                continue
            value = stat(m, key, sub) if sub else m.get(key)
            row.append(_num(value, 1))
        rows.append(row)
    return header, rows


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def sweep_summary(points: list[dict[str, Any]], markdown: bool = False) -> str:
    """One row per point; latencies in ms, goodput in req/s."""
    header, rows = summary_rows(points)
    return markdown_table(header, rows) if markdown else text_table(header, rows)


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def load_points(path: str | Path) -> list[dict[str, Any]]:
    """The points of a result file (a single run, a sweep, or a bare list of points)."""
    data = orjson.loads(Path(path).read_bytes())
    if isinstance(data, list):
        return data
    if "points" in data:
        return list(data["points"])
    if "metrics" in data:
        return [data]
    raise ValueError(f"{path}: not a pdserve bench result")
