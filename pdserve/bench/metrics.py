"""Per-request records and the aggregate metrics computed from them.

Conventions (the same in the table, the JSON and the plots):

* **TTFT** — from the moment the request is handed to the HTTP client to the arrival of the
  first streamed event that carries at least one output token (non-empty ``text`` /
  ``delta.content`` for the OpenAI formats; growth of ``meta_info.completion_tokens`` or
  ``output_ids`` for ``/generate``).
* **ITL** — the gaps between successive token-bearing events, *as observed*: one value per
  gap, whatever the number of tokens the later event carries. A server that streams two
  tokens per event therefore shows ITLs about twice the per-token time; that is what a
  client sees. The ITL distribution pools the gaps of every successful request.
* **TPOT** — per request, ``(latency - TTFT) / (output_tokens - 1)``: the time after the
  first event divided over the remaining tokens, so an event carrying several tokens counts
  its gap once and spreads it over its tokens. Requests with a single output token have
  no TPOT.
* **E2E latency** — from hand-off to the end of the stream (``[DONE]`` or the connection's
  end).
* **Goodput** — successful requests per second of benchmark duration that meet every SLO
  given: ``TTFT <= --slo-ttft`` and the request's *TPOT* (default), its *mean ITL*
  (``--slo-itl-metric mean-itl``), the 99th percentile of its own ITLs
  (``--slo-itl-metric p99-itl``) or its longest gap (``--slo-itl-metric max-itl``)
  ``<= --slo-itl``. With about a hundred gaps a request's own p99 interpolates between its
  second and third longest and so forgives one stall, such as the wait of a disaggregated
  request between its first token (prefill) and its second (decode, after the KV pull);
  ``max-itl`` does not. Requests with one output token have no
  TPOT/ITL and pass that SLO. ``goodput_fraction`` divides by all requests, failed ones
  included.
* Percentiles interpolate linearly between order statistics (numpy's default method);
  ``std`` is the population standard deviation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)
# --slo-itl-metric: what each bounds (a RequestRecord property) and how it is printed
SLO_ITL_METRICS = {
    "tpot": ("tpot", "TPOT"),
    "mean-itl": ("mean_itl", "mean ITL"),
    "p99-itl": ("p99_itl", "p99 ITL"),
    "max-itl": ("max_itl", "max ITL"),
}


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds; ``scheduled``/``start`` are
    offsets from the benchmark's start."""

    index: int
    ok: bool = False
    error: str | None = None
    scheduled: float = 0.0
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    expected_output_tokens: int = 0
    token_events: int = 0
    token_source: str = ""  # "server" | "tokenizer" | "events": where output_tokens came from
    prompt_source: str = ""  # "server" | "dataset"
    cached_tokens: int | None = None
    timings: dict[str, float] | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def mean_itl(self) -> float | None:
        return sum(self.itl) / len(self.itl) if self.itl else None

    @property
    def p99_itl(self) -> float | None:
        return percentile(sorted(self.itl), 99) if self.itl else None

    @property
    def max_itl(self) -> float | None:
        return max(self.itl) if self.itl else None

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        out["tpot"] = self.tpot
        out["mean_itl"] = self.mean_itl
        out["p99_itl"] = self.p99_itl
        out["max_itl"] = self.max_itl
        return out


# ---- statistics ------------------------------------------------------------------------
def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, linear interpolation."""
    n = len(sorted_values)
    if n == 0:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def describe(values: Iterable[float], scale: float = 1000.0) -> dict[str, float] | None:
    """mean, std, median, p50/p90/p99, min, max of ``values`` times ``scale`` (seconds -> ms
    by default); None when there are no values."""
    data = sorted(v * scale for v in values)
    if not data:
        return None
    n = len(data)
    mean = sum(data) / n
    var = sum((v - mean) ** 2 for v in data) / n
    out = {"count": n, "mean": mean, "std": math.sqrt(var), "median": percentile(data, 50)}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(data, q)
    out["min"] = data[0]
    out["max"] = data[-1]
    return out


# ---- SLOs and goodput ----------------------------------------------------------------
@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    itl_ms: float | None = None
    itl_metric: str = "tpot"  # one of SLO_ITL_METRICS

    @property
    def active(self) -> bool:
        return self.ttft_ms is not None or self.itl_ms is not None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft is None or r.ttft * 1000.0 > self.ttft_ms):
            return False
        if self.itl_ms is not None:
            value = getattr(r, SLO_ITL_METRICS[self.itl_metric][0])
            if value is not None and value * 1000.0 > self.itl_ms:
                return False
        return True

    def describe(self) -> str:
        parts = []
        if self.ttft_ms is not None:
            parts.append(f"TTFT <= {self.ttft_ms:g} ms")
        if self.itl_ms is not None:
            label = SLO_ITL_METRICS[self.itl_metric][1]
            parts.append(f"{label} <= {self.itl_ms:g} ms")
        return " and ".join(parts) or "none"


# ---- aggregate ---------------------------------------------------------------------------
def summarize(
    records: Sequence[RequestRecord],
    duration: float,
    slo: SLO | None = None,
    offered_rate: float | None = None,
    send_lags: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The aggregate metrics of one run (a flat dict of numbers and ``describe`` dicts)."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    duration = max(duration, 1e-9)
    in_tokens = sum(r.prompt_tokens for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    m: dict[str, Any] = {
        "duration_s": duration,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "request_throughput": len(ok) / duration,
        "offered_request_rate": offered_rate,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "input_throughput": in_tokens / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "short_outputs": sum(1 for r in ok if r.expected_output_tokens and r.output_tokens < r.expected_output_tokens),
        "ttft_ms": describe(r.ttft for r in ok if r.ttft is not None),
        "tpot_ms": describe(t for r in ok if (t := r.tpot) is not None),
        "itl_ms": describe(g for r in ok for g in r.itl),
        "e2e_latency_ms": describe(r.latency for r in ok if r.latency is not None),
        "output_tokens_per_event": (out_tokens / max(1, sum(r.token_events for r in ok))) if ok else None,
    }
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if cached:
        m["total_cached_tokens"] = sum(cached)
        m["prefix_cache_hit_rate"] = sum(cached) / max(1, in_tokens)
    if slo is not None and slo.active:
        good = sum(1 for r in records if slo.met(r))
        m["slo"] = {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms, "itl_metric": slo.itl_metric, "text": slo.describe()}
        m["goodput"] = good / duration
        m["goodput_fraction"] = good / len(records) if records else 0.0
    if send_lags:
        m["send_lag_ms"] = describe(send_lags)
    timing_keys = sorted({k for r in ok if r.timings for k in r.timings})
    if timing_keys:
        server: dict[str, Any] = {}
        for key in timing_keys:
            values = [r.timings[key] for r in ok if r.timings and key in r.timings]
            if key == "recomputed":
                server[key] = {"count": sum(1 for v in values if v)}
            else:
                server[key] = describe(values)
        m["server_timings_ms"] = server
    if failed:
        errors: dict[str, int] = {}
        for r in failed:
            msg = (r.error or "unknown error")[:300]
            errors[msg] = errors.get(msg, 0) + 1
        m["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])
    return m


def stat(metrics: dict[str, Any], name: str, key: str) -> float | None:
    """``metrics[name][key]`` or None (missing or empty)."""
    d = metrics.get(name)
    if not isinstance(d, dict):
        return None
    value = d.get(key)
    return float(value) if isinstance(value, (int, float)) else None
