"""xPyD on N GPUs of one host: how the prefill-to-decode ratio changes goodput, and whether
the autoscaler's rule would have chosen the best ratio. Writes ``docs/data/xpyd.json``.

For N GPUs (default 4) every split ``pPdD`` with ``p + d = N`` (1P3D, 2P2D, 3P1D) and N
unified replicas, each a fresh ``pdserve up`` (one worker per GPU, KV over NCCL between
GPUs) on a nats-server of its own, run the same request-rate sweep with ``pdserve bench`` on
a prefill-heavy (2,048 in / 128 out) and a decode-heavy (128 in / 1,024 out) workload.
Goodput: requests/s whose TTFT <= 1 s and own p99 ITL <= 30 ms, the best over the sweep.

**The autoscaler's view.** Beside every disaggregated system the script runs the rule of
``pdserve up --autoscale`` (:mod:`pdserve.scaling`, through :class:`pdserve.autoscale.Autoscale`
with pools that only record what they are told) on that system's queues and registry, once a
second: the replicas each role *needs* under the load of each sweep point. The split it
would choose at a point is ``N * need_prefill / (need_prefill + need_decode)`` prefill GPUs,
rounded and held within ``1..N-1``; the result compares it, per workload, with the split
that measured best.

Every run is cold: each system starts fresh, every (system, workload, rate) point has its own
seed, and the cached tokens of each point are reported.

    python bench/xpyd.py                                  # a 4-GPU host, Qwen2.5-7B dimensions
    python bench/xpyd.py --configs 2P2D,4U                # some of the systems (merged into --out)
    python bench/xpyd.py --small --device cpu --gpus 2    # dry run: tiny model, gloo, this CPU
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, log, plot_goodput
from make_dummy_model import write_model_dir
from system import System
from two_gpu_pd import bench_point, best_goodput, greedy_probe, summary

from pdserve.bench.shapes import QWEN2_5_7B

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {"prefill_heavy": (2048, 128), "decode_heavy": (128, 1024)}
SMALL_WORKLOADS = {"prefill_heavy": (256, 8), "decode_heavy": (16, 48)}


def parse_config(name: str) -> tuple[int, int, int]:
    """``"1P3D"`` -> (1, 3, 0); ``"4U"`` -> (0, 0, 4)."""
    m = re.fullmatch(r"(\d+)P(\d+)D|(\d+)U", name.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"a configuration is like 1P3D or 4U, not {name!r}")
    if m.group(3):
        return 0, 0, int(m.group(3))
    return int(m.group(1)), int(m.group(2)), 0


def default_configs(gpus: int) -> list[str]:
    return [f"{p}P{gpus - p}D" for p in range(1, gpus)] + [f"{gpus}U"]


class XSystem(System):
    """``pdserve up`` with any number of workers of each role, on a given nats-server."""

    def __init__(self, name: str, model: Path, root: Path, extra: list[str], nats_url: str) -> None:
        prefill, decode, unified = parse_config(name)
        super().__init__("unified" if unified else "pd", model, root / name, extra)
        self.data_dir = root / name / "data"
        self.log_path = root / f"{name}.log"
        if unified:
            self.flags = ["--mode", "unified", "--unified-workers", str(unified)]
            self.roles = {"unified": unified}
        else:
            self.flags = ["--mode", "pd", "--prefill-workers", str(prefill), "--decode-workers", str(decode)]
            self.roles = {"prefill": prefill, "decode": decode}
        self.flags += ["--nats-url", nats_url]
        self.label = name


class FixedPool:
    """A pool the autoscaling rule may not change: it reports ``n`` serving replicas and
    records what it was told."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.told: list[int] = []

    def serving(self) -> list[object]:
        return [object()] * self.n

    def retiring(self) -> list[object]:
        return []

    def scale_to(self, replicas: int, in_flight: Any) -> None:
        self.told.append(replicas)


class RuleObserver:
    """The autoscaler's rule on a running system, read-only, in a thread of its own."""

    def __init__(self, nats_url: str, model: str, counts: dict[str, int], gpus: int, extra: list[str]) -> None:
        from pdserve.autoscale import size_for_autoscale
        from pdserve.cli import build_parser
        from pdserve.configs import broker_config, scaling_config

        argv = ["up", "--autoscale", "--max-prefill", str(gpus), "--max-decode", str(gpus), *extra]
        args, _ = build_parser().parse_known_args(argv)
        self.config = scaling_config(args)
        size_for_autoscale(args, self.config)  # fills in what the broker config needs, as `up` does
        self.broker = broker_config(args)
        self.nats_url, self.model, self.counts = nats_url, model, counts
        self.readings: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    async def _run(self) -> None:
        import nats

        from pdserve.autoscale import Autoscale
        from pdserve.broker.registry import WorkerRegistry
        from pdserve.broker.streams import worker_bucket

        pools = {role: FixedPool(n) for role, n in self.counts.items()}
        scaler = Autoscale(self.config, pools, self.model)  # type: ignore[arg-type]
        nc = await nats.connect(self.nats_url)
        try:
            js = nc.jetstream()
            registry = WorkerRegistry(await worker_bucket(js, self.broker), js)
            while not self._stop.is_set():
                decisions = await scaler.tick(js, registry)
                if decisions:
                    self.readings.append(
                        {
                            "t": time.monotonic(),
                            **{role: {"need": d.need, "needs": d.needs} for role, d in decisions.items()},
                        }
                    )
                await asyncio.sleep(1.0)
        finally:
            await nc.close()

    def needs_between(self, start: float, end: float) -> dict[str, float] | None:
        """Mean need of each role over the readings taken in ``[start, end]``."""
        inside = [r for r in self.readings if start <= r["t"] <= end and "prefill" in r and "decode" in r]
        if not inside:
            return None
        return {role: statistics.fmean(r[role]["need"] for r in inside) for role in ("prefill", "decode")}


def split_for(needs: dict[str, float] | None, gpus: int) -> int | None:
    """The prefill GPUs the rule's needs ask for out of ``gpus``."""
    if not needs or needs["prefill"] + needs["decode"] <= 0:
        return None
    share = needs["prefill"] / (needs["prefill"] + needs["decode"])
    return min(max(round(gpus * share), 1), gpus - 1)


def serve(args: argparse.Namespace, name: str, model: Path, extra: list[str], seed: int) -> dict[str, Any]:
    """Start one system (with its own nats-server), probe it, sweep it, stop it."""
    import random

    from pdserve.broker.server import start_nats_server

    root = Path(tempfile.mkdtemp(prefix=f"pd-xpyd-{name}-"))
    server = start_nats_server(root / "nats")
    system = XSystem(name, model, root, extra, server.url)
    prefill, decode, unified = parse_config(name)
    observer = None
    log(f"starting {name}: {' '.join(system.flags + extra)} (log {system.log_path})")
    out: dict[str, Any] = {"config": name, "prefill": prefill, "decode": decode, "unified": unified, "flags": extra}
    t0 = time.monotonic()
    try:
        system.start(timeout=args.start_timeout)
        out["start_s"] = time.monotonic() - t0
        log(f"  ready after {out['start_s']:.0f}s")
        rng = random.Random(args.seed)  # the same probe prompts on every system
        prompts = [[rng.randrange(3, 4000) for _ in range(n)] for n in (17, 130, 515)]
        out["greedy"] = asyncio.run(greedy_probe(system.url, model, prompts, args.greedy_tokens))
        if not unified:
            observer = RuleObserver(server.url, model.name, {"prefill": prefill, "decode": decode}, args.gpus, extra)
            observer.start()
        out["workloads"] = {}
        for k, (workload, lens) in enumerate(args.workloads.items()):
            points = []
            for j, rate in enumerate(args.rates):
                num = max(args.min_prompts, round(rate * args.duration))
                began = time.monotonic()
                point = asyncio.run(bench_point(args, system.url, model, lens, rate, num, seed + 100 * (k + 1) + j))
                p = summary(point)
                if observer is not None:
                    p["rule_needs"] = observer.needs_between(began, time.monotonic())
                    p["rule_prefill_gpus"] = split_for(p["rule_needs"], args.gpus)
                points.append(p)
                log(
                    f"  {workload} @ {rate:g} req/s: goodput {p['goodput_rps']:.2f} req/s, TTFT p99 "
                    f"{p['ttft_p99_ms'] or 0:.0f} ms, ITL p99 {p['itl_p99_ms'] or 0:.1f} ms, cached "
                    f"{p['cached_tokens']}" + (f", rule: {p['rule_prefill_gpus']}P" if observer else "")
                )
            out["workloads"][workload] = {"input_len": lens[0], "output_len": lens[1], "points": points}
    except Exception as exc:  # recorded with the log's tail: the other systems still run
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["log_tail"] = system.log_tail()
        log(f"  {name} failed: {out['error']}")
    finally:
        if observer is not None:
            observer.stop()
            out["rule_readings"] = len(observer.readings)
        system.stop()
        server.stop()
    return out


def conclude(result: dict[str, Any], gpus: int) -> None:
    """Per workload: each configuration's goodput, the best one, and the split the rule asked
    for at the best configuration's best point (and at every system's best point)."""
    systems = result["systems"]
    result["conclusion"] = {}
    for workload in result["workloads"]:
        goodputs = {name: best_goodput(run, workload) for name, run in systems.items()}
        measured = {n: g for n, g in goodputs.items() if g is not None}
        best = max(measured, key=lambda n: measured[n]) if measured else None
        best_pd = max((n for n in measured if "P" in n), key=lambda n: measured[n], default=None)
        rule: dict[str, int | None] = {}
        for name, run in systems.items():
            points = (run.get("workloads") or {}).get(workload, {}).get("points") or []
            if points and "P" in name:
                top = max(points, key=lambda p: p["goodput_rps"])
                rule[name] = top.get("rule_prefill_gpus")
        chosen = [v for v in rule.values() if v is not None]
        rule_choice = statistics.mode(chosen) if chosen else None
        strict = {name: best_goodput(run, workload, "goodput_rps_max_itl") for name, run in systems.items()}
        strict_measured = {n: g for n, g in strict.items() if g is not None}
        result["conclusion"][workload] = {
            "goodput_rps": goodputs,
            "best": best,
            # the same with each request's longest gap, which its own p99 forgives (PD's hand-off)
            "goodput_rps_max_itl": strict,
            "best_max_itl": max(strict_measured, key=lambda n: strict_measured[n]) if strict_measured else None,
            "best_disaggregated": best_pd,
            "rule_prefill_gpus_at_each_best_point": rule,
            "rule_choice": f"{rule_choice}P{gpus - rule_choice}D" if rule_choice else None,
            "rule_chose_best_disaggregated": (f"{rule_choice}P{gpus - rule_choice}D" == best_pd)
            if rule_choice
            else None,
        }
        for name, g in goodputs.items():
            result["systems"][name].setdefault("goodput_rps", {})[workload] = g


def plot(result: dict[str, Any], out: Path) -> list[str]:
    """Goodput against offered rate, one panel per workload, one line per configuration;
    the lines' labels."""
    heading = f"xPyD on {result['num_gpus']} x {(result['gpus'] or ['CPU'])[0]}"
    return plot_goodput(dict(sorted(result["systems"].items())), result["workloads"], result["slo"], heading, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--gpus", type=int, default=4, help="GPUs of the host (workers per system)")
    parser.add_argument("--small", action="store_true", help="tiny model and short sweeps (the dry run)")
    parser.add_argument("--model-path", type=Path, help="default: Qwen2.5-7B dimensions, random weights")
    parser.add_argument("--configs", default=None, help="comma-separated, e.g. 1P3D,2P2D,3P1D,4U (default: all)")
    parser.add_argument("--rates", default=None, help="request rates of the sweep (default 2,4,8,16; --small 1,2)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals per point (6; --small 3)")
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--slo-ttft", type=float, default=1000.0, help="ms")
    parser.add_argument("--slo-itl", type=float, default=30.0, help="ms, on each request's own p99 ITL")
    parser.add_argument("--greedy-tokens", type=int, default=16)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock (every run cold)")
    parser.add_argument("--out", type=Path, default=None, help="default docs/data/xpyd.json (--small: a temp file)")
    parser.add_argument("--img", type=Path, default=None, help="default docs/img/xpyd.png (--small: a temp file)")
    parser.add_argument("extra", nargs="*", help="more `pdserve up` flags (after --)")
    args = parser.parse_args()
    if args.gpus < 2:
        raise SystemExit("xPyD needs at least two workers")
    args.rates = [float(r) for r in (args.rates or ("1,2" if args.small else "2,4,8,16")).split(",")]
    args.duration = args.duration or (3.0 if args.small else 6.0)
    args.workloads = SMALL_WORKLOADS if args.small else WORKLOADS
    args.seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    configs = args.configs.split(",") if args.configs else default_configs(args.gpus)
    for name in configs:
        p, d, u = parse_config(name)
        if p + d + u != args.gpus:
            raise SystemExit(f"{name}: {p + d + u} workers, but --gpus {args.gpus}")
    out = args.out or (Path(tempfile.gettempdir()) / "xpyd_small.json" if args.small else ROOT / "docs/data/xpyd.json")
    img = args.img or (Path(tempfile.gettempdir()) / "xpyd_small.png" if args.small else ROOT / "docs/img/xpyd.png")
    if args.device == "cuda":
        if torch.cuda.device_count() < args.gpus:
            raise SystemExit(f"needs {args.gpus} CUDA devices (or --device cpu)")
        devices, backend = [f"cuda:{i}" for i in range(args.gpus)], "nccl"
        gpus = [torch.cuda.get_device_name(i) for i in range(args.gpus)]
    else:
        devices, backend, gpus = ["cpu"] * args.gpus, "gloo", []
    if args.model_path:
        model, dummy = args.model_path, []
    elif args.small:
        from pdserve.engine.tiny_model import ensure_default_model

        model, dummy = ensure_default_model(Path(tempfile.mkdtemp(prefix="pd-xpyd-model-"))), []
    else:
        model, dummy = (
            write_model_dir(Path(tempfile.mkdtemp(prefix="pd-xpyd-model-")), QWEN2_5_7B),
            ["--load-format", "dummy"],
        )
    common = ["--device", args.device, "--worker-devices", ",".join(devices), *dummy, *args.extra]
    if args.device == "cpu":
        common += ["--num-threads", "1"]
    # Systems measured before (another call, --configs) stay in the file; this run's replace them.
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() and args.configs else {}
    result.update(
        {
            "date": datetime.date.today().isoformat(),
            "gpus": gpus,
            "device": args.device,
            "num_gpus": args.gpus,
            "small": args.small,
            "commit": git_commit(),
            "argv": sys.argv[1:],
            "slo": {"ttft_ms": args.slo_ttft, "itl_ms": args.slo_itl, "itl_metric": "p99-itl (each request's own)"},
            "workloads": {k: {"input_len": i, "output_len": o} for k, (i, o) in args.workloads.items()},
            "rates": args.rates,
        }
    )
    result.setdefault("systems", {})
    for i, name in enumerate(configs):
        p, _, _ = parse_config(name)
        flags = [*common, "--disaggregation-transfer-backend", backend] if p else common
        run = serve(args, name, model, flags, args.seed + 1000 * (i + 1))
        run["seed"] = args.seed + 1000 * (i + 1)
        result["systems"][name] = run
        conclude(result, args.gpus)
        greedy = [r.get("greedy") for r in result["systems"].values() if r.get("greedy") is not None]
        result["greedy_identical"] = bool(greedy) and all(g == greedy[0] for g in greedy)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, img)
    for workload, c in result["conclusion"].items():
        log(
            f"{workload}: goodput {c['goodput_rps']}; best {c['best']} (by longest gap: {c['best_max_itl']}); "
            f"the rule: {c['rule_choice']}"
        )
    log(f"wrote {out} and {img}; greedy identical across systems: {result['greedy_identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
