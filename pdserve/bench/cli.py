"""``pdserve bench``: the serving benchmark's command line (also ``python -m pdserve.bench``).

``pdserve bench [options]`` runs a benchmark (or a sweep); ``pdserve bench plot`` overlays
result files; ``pdserve bench stub`` runs the instant stub server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.config import BACKENDS, DATASETS, ENDPOINTS, BenchConfig
from pdserve.bench.metrics import SLO_ITL_METRICS

D = BenchConfig()  # the defaults

EPILOG = """\
metrics: TTFT = first token-bearing event; ITL = gaps between token-bearing events as
observed (one per event); TPOT = (latency - TTFT) / (output tokens - 1), so events carrying
several tokens spread their gap over them; goodput = requests/s meeting every SLO given
(TTFT and the request's TPOT, or its mean, p99 or longest ITL with --slo-itl-metric).
examples:
  pdserve bench --backend generate --num-prompts 200 --request-rate 8 --input-len 512 --output-len 64
  pdserve bench --sweep 1,2,4,8 --slo-ttft 500 --slo-itl 50 --output-json pd.json --plot pd.png
  pdserve bench plot --inputs pd.json unified.json --labels PD unified --out fig.png
  pdserve bench stub --port 9000 --tokens 16 --itl-ms 0
"""


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 or inf; got {text}")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(t) for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrencies must be positive integers")
    return values


def _json_obj(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    """All the options of ``pdserve bench`` on ``p``."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="logging level (default: %(default)s)",
    )
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default=D.base_url, help="server to measure (default: %(default)s)")
    g.add_argument(
        "--backend",
        default=D.backend,
        choices=BACKENDS,
        help="request format: openai = /v1/completions, openai-chat = /v1/chat/completions, "
        "generate = SGLang /generate (default: %(default)s)",
    )
    g.add_argument(
        "--endpoint",
        default=None,
        help=f"path to POST to (default: by backend: {', '.join(f'{k} {v}' for k, v in ENDPOINTS.items())})",
    )
    g.add_argument("--model", default=None, help="model name to send (default: the first model GET /v1/models lists)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else none)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer (directory with tokenizer.json, or a HF model dir): exact token-id prompts and "
        "output counting when the server reports no usage (default: none; random-word prompts)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=D.request_timeout,
        help="seconds to wait for the next bytes of a response (default: %(default)s)",
    )
    g.add_argument(
        "--extra-body", type=_json_obj, default={}, help="JSON object merged into every request body (default: none)"
    )

    g = p.add_argument_group("load")
    g.add_argument(
        "--num-prompts", type=int, default=D.num_prompts, help="measured requests per run (default: %(default)s)"
    )
    g.add_argument(
        "--request-rate",
        type=_rate,
        default=D.request_rate,
        help="open-loop arrival rate in requests/s; inf sends all at once (default: %(default)s)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=D.burstiness,
        help="gamma shape of the inter-arrival times: 1 = Poisson, < 1 burstier, > 1 more regular "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight (closed loop with --request-rate inf) (default: no limit)",
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=D.warmup,
        help="requests sent (different prompts) and not measured before each run (default: %(default)s)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=D.seed,
        help="seed of prompts, lengths and arrivals (default: a fresh one each run, recorded in the"
        " result, so a rerun meets a cold prefix cache; give the recorded one to repeat a workload)",
    )

    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default=D.dataset, choices=DATASETS, help="workload (default: %(default)s)")
    g.add_argument("--input-len", type=int, default=D.input_len, help="random: prompt tokens (default: %(default)s)")
    g.add_argument(
        "--output-len",
        type=int,
        default=D.output_len,
        help="random/prefix-chat: output tokens per request (default: %(default)s)",
    )
    g.add_argument(
        "--range-ratio",
        type=float,
        default=D.range_ratio,
        help="random: lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (default: %(default)s)",
    )
    g.add_argument(
        "--short-fraction",
        type=float,
        default=D.short_fraction,
        help="random: this share of the prompts is drawn around --short-len instead (a mixed workload; "
        "default: %(default)s)",
    )
    g.add_argument(
        "--short-len",
        type=int,
        default=D.short_len,
        help="random with --short-fraction: the short prompts' tokens (default: %(default)s)",
    )
    g.add_argument(
        "--prompt-format",
        default=D.prompt_format,
        choices=["auto", "ids", "text"],
        help="auto: token ids when --tokenizer is given (exact lengths), else text; openai-chat always "
        "sends messages (default: %(default)s)",
    )
    g.add_argument("--dataset-path", default=None, help="sharegpt: the ShareGPT-format JSON file (default: none)")
    g.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="sharegpt: this output length instead of the recorded reply's (default: the reply's length)",
    )
    g.add_argument(
        "--num-groups",
        type=int,
        default=D.num_groups,
        help="prefix-chat: groups, each with its own shared system prompt (default: %(default)s)",
    )
    g.add_argument(
        "--prefix-len",
        type=int,
        default=D.prefix_len,
        help="prefix-chat: tokens of each group's system prompt (default: %(default)s)",
    )
    g.add_argument(
        "--num-turns",
        type=int,
        default=D.num_turns,
        help="prefix-chat: user turns per conversation (default: %(default)s)",
    )
    g.add_argument(
        "--turn-len", type=int, default=D.turn_len, help="prefix-chat: tokens of each user turn (default: %(default)s)"
    )
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos: true (default: send it, so output lengths are exact)",
    )
    g.add_argument(
        "--temperature", type=float, default=D.temperature, help="sampling temperature (default: %(default)s)"
    )

    g = p.add_argument_group("SLOs (goodput)")
    g.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in ms (default: none)")
    g.add_argument(
        "--slo-itl",
        type=float,
        default=None,
        help="per-token SLO in ms, on each request's TPOT, mean, p99 or longest ITL (default: none)",
    )
    g.add_argument(
        "--slo-itl-metric",
        default=D.slo_itl_metric,
        choices=list(SLO_ITL_METRICS),
        help="which per-request statistic --slo-itl bounds (default: %(default)s)",
    )

    g = p.add_argument_group("sweep")
    g.add_argument(
        "--sweep",
        type=_rates,
        default=None,
        metavar="RATES",
        help="comma-separated request rates, run in turn (e.g. 1,2,4,8,inf) (default: one run)",
    )
    g.add_argument(
        "--sweep-concurrency",
        type=_ints,
        default=None,
        metavar="NS",
        help="comma-separated max concurrencies, run in turn at --request-rate (default: none)",
    )
    g.add_argument(
        "--sweep-pause",
        type=float,
        default=D.sweep_pause,
        help="seconds to wait between sweep points (default: %(default)s)",
    )

    g = p.add_argument_group("output")
    g.add_argument(
        "--output-json",
        default=None,
        metavar="PATH",
        help="write config, metrics (every sweep point) and optionally requests here (default: none)",
    )
    g.add_argument("--save-requests", action="store_true", help="include per-request rows in the JSON (default: off)")
    g.add_argument(
        "--plot", default=None, metavar="PNG", help="plot latencies against rate to this PNG (default: none)"
    )
    g.add_argument(
        "--timeline",
        default=None,
        metavar="PNG",
        help="draw one bar per request, coloured by stage, to this PNG (--backend generate; default: none)",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar and no tables (default: off)")

    sub = p.add_subparsers(dest="bench_command", metavar="{plot,timeline,stub}", required=False)
    pl = sub.add_parser("plot", help="overlay the sweeps of several result files")
    pl.add_argument("--inputs", nargs="+", required=True, help="result JSON files of pdserve bench")
    pl.add_argument("--labels", nargs="+", default=None, help="one legend label per input (default: file names)")
    pl.add_argument("--out", required=True, help="PNG to write")
    pl.add_argument("--title", default=None, help="figure title (default: none)")
    pl.add_argument(
        "--axis",
        default="request_rate",
        choices=["request_rate", "max_concurrency"],
        help="x axis (default: %(default)s)",
    )
    tl = sub.add_parser("timeline", help="per-request timeline of a result file saved with --save-requests")
    tl.add_argument("--input", required=True, help="result JSON of pdserve bench --backend generate --save-requests")
    tl.add_argument("--out", required=True, help="PNG to write")
    tl.add_argument("--title", default=None, help="figure title (default: none)")
    st = sub.add_parser("stub", help="run an instant OpenAI/SGLang-compatible streaming stub server")
    st.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    st.add_argument("--port", type=int, default=9000, help="port; 0 picks a free one (default: %(default)s)")
    st.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="tokens per answer (default: the request's max_tokens/max_new_tokens, else 16)",
    )
    st.add_argument(
        "--itl-ms",
        type=float,
        default=0.0,
        help="delay between tokens; 0 sends the whole answer in one write (default: %(default)s)",
    )
    st.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token (default: %(default)s)")
    st.add_argument("--model", default="stub-model", help="model name it reports (default: %(default)s)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``pdserve`` command's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="serving benchmark: latency, throughput and goodput under load",
        description=__doc__,
        allow_abbrev=False,
    )
    configure(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench", description=__doc__, allow_abbrev=False)
    configure(p)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    names = BenchConfig.__dataclass_fields__
    return BenchConfig(**{k: v for k, v in vars(args).items() if k in names})


def run(args: argparse.Namespace) -> int:
    """Run what ``args`` (parsed by the ``bench`` parser) asks; the process exit code."""
    command = getattr(args, "bench_command", None)
    if command == "plot":
        return _plot(args)
    if command == "timeline":
        import orjson

        result = orjson.loads(Path(args.input).read_bytes())
        return _timeline(result, args.out, args.title)
    if command == "stub":
        from pdserve.bench.stub import serve

        return serve(args.host, args.port, args.tokens, args.itl_ms, args.ttft_ms, args.model)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    if args.timeline:
        cfg = dataclasses.replace(cfg, save_requests=True)
    return bench(cfg, args.output_json, args.plot, args.timeline)


def bench(
    cfg: BenchConfig, output_json: str | None = None, plot: str | None = None, timeline: str | None = None
) -> int:
    import asyncio

    from pdserve.bench import report
    from pdserve.bench.runner import run_benchmark

    def on_point(point: dict[str, Any]) -> None:
        if not cfg.quiet:
            print(report.point_table(point, cfg.backend), flush=True)

    try:
        result = asyncio.run(run_benchmark(cfg, on_point))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    points = result["points"]
    if len(points) > 1 and not cfg.quiet:
        print("\nsweep summary (latencies in ms, goodput in req/s):")
        print(report.sweep_summary(points))
    if output_json:
        report.write_json(output_json, result)
        if not cfg.quiet:
            print(f"wrote {output_json}", file=sys.stderr)
    if plot:
        from pdserve.bench.plot import plot_sweeps

        axis = "max_concurrency" if result["sweep"] == "max_concurrency" else "request_rate"
        plot_sweeps([(result.get("model") or "run", points)], plot, axis=axis)
        if not cfg.quiet:
            print(f"wrote {plot}", file=sys.stderr)
    if timeline and _timeline(result, timeline, None, cfg.quiet):
        return 2
    return 0 if any(p["metrics"]["completed"] for p in points) else 1


def _timeline(result: dict[str, Any], out: str, title: str | None, quiet: bool = False) -> int:
    """Draw the last point's requests of ``result``; 2 when none has server timings."""
    from pdserve.bench.timeline import plot_timeline

    rows = (result.get("points") or [{}])[-1].get("requests") or []
    drawn = plot_timeline(rows, out, title)
    if not drawn:
        print(
            "pdserve bench: error: no request has server timings (they come with --backend generate)", file=sys.stderr
        )
        return 2
    if not quiet:
        print(f"wrote {out} ({drawn} requests)", file=sys.stderr)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from pdserve.bench.plot import plot_sweeps
    from pdserve.bench.report import load_points

    labels = args.labels or [os.path.splitext(os.path.basename(p))[0] for p in args.inputs]
    if len(labels) != len(args.inputs):
        print("pdserve bench plot: error: give one label per input", file=sys.stderr)
        return 2
    series = [(label, load_points(path)) for label, path in zip(labels, args.inputs, strict=True)]
    out = plot_sweeps(series, args.out, args.title, args.axis)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pdserve.logs import setup_logging

    setup_logging(args.log_level, "bench")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
