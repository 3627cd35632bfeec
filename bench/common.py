"""Starting and stopping `pdserve up` for the benchmark scripts."""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The checkout's short commit, or "" outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return ""


def py_spy(pid: int, path: Path, seconds: int = 4, rate: int = 250) -> subprocess.Popen[bytes] | None:
    """Sample ``pid`` and its children for ``seconds`` (py-spy's raw, collapsed stacks in
    ``path``); None, with a line on stderr, where py-spy is not installed."""
    exe = shutil.which("py-spy")
    if exe is None:
        print("no py-spy here: no profile", file=sys.stderr)
        return None
    cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--format", "raw", "--rate", str(rate)]
    cmd += ["--nonblocking", "--duration", str(seconds), "-o", str(path)]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # attached before the measured work starts
    return spy


def log(line: str) -> None:
    """A progress line on stderr, with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def say(msg: str) -> None:
    """A progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def fmt(v: float | None, digits: int = 1) -> str:
    """``v`` to ``digits`` places for a table; ``-`` for none or NaN."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_pdserve(
    mode: str,
    data_dir: Path,
    extra: list[str] | None = None,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    checkout: Path | None = None,
    log_path: Path | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """`pdserve up --mode MODE` on a free port in its own process group, with ``env`` added
    to this process's environment; returns once healthy. ``checkout``: run that source tree's
    pdserve instead (e.g. a worktree of another commit). Without ``--model-path`` in ``extra``
    it serves the random-weight tiny model built in ``data_dir`` (the model these benchmarks'
    figures were measured on), not pdserve's default."""
    if "--model-path" not in (extra or []):
        from pdserve.engine.tiny_model import ensure_default_model

        extra = ["--model-path", str(ensure_default_model(data_dir)), *(extra or [])]
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--mode",
        mode,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--data-dir",
        str(data_dir),
        "--log-level",
        "WARNING",
        *(extra or []),
    ]
    env = {**os.environ, **(env or {}), **({"PYTHONPATH": str(checkout)} if checkout else {})}
    sink = open(log_path, "wb") if log_path is not None else None
    proc = subprocess.Popen(cmd, start_new_session=True, env=env, cwd=checkout, stdout=sink, stderr=sink)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            stop_pdserve(proc)
            raise SystemExit("pdserve did not come up")
        time.sleep(0.5)


def stop_pdserve(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM to `pdserve up` alone: it stops its workers, then its broker; the whole
    process group is killed after ``timeout`` seconds."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def process_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``root`` and every process below it, summed by
    role: ``api`` (the `pdserve up` process, which serves HTTP), ``nats``, and each worker
    command's name (``unified``, ``prefill``, ``decode``). Linux only (reads ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for role, fields in _tree(root):
        totals[role] = totals.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


def process_threads(root: int) -> dict[str, int]:
    """Threads of ``root`` and every process below it, summed by role (as
    :func:`process_cpu_seconds` names them). A CPU worker whose model was loaded on one thread
    and stepped on another carries a second OpenMP pool: ``torch threads - 1`` more."""
    totals: dict[str, int] = {}
    for role, fields in _tree(root):
        totals[role] = totals.get(role, 0) + int(fields[17])  # num_threads
    return totals


def thread_seconds(root: int) -> dict[str, dict[int, float]]:
    """CPU seconds so far of each thread of ``root`` and every process below it, by role (as
    :func:`process_cpu_seconds` names them) and thread id. Two snapshots show which threads
    worked in between: a second *working* OpenMP pool doubles the busy ones, an idle pool
    (torch's pthreadpool, BLAS threads made at import) does not count."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, dict[int, float]] = {}
    for role, pid, _ in _tree_entries(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out.setdefault(role, {})[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def busy_threads(
    before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], floor: float = 0.05
) -> dict[str, object]:
    """Per role, how many threads used at least ``floor`` CPU seconds between two
    :func:`thread_seconds` snapshots, and the ten largest of those seconds."""
    out: dict[str, object] = {}
    for role, now in after.items():
        used = sorted((s - before.get(role, {}).get(tid, 0.0) for tid, s in now.items()), reverse=True)
        out[role] = {"busy": sum(u >= floor for u in used), "top_seconds": [round(u, 2) for u in used[:10]]}
    return out


def _tree(root: int) -> list[tuple[str, list[str]]]:
    return [(role, fields) for role, _, fields in _tree_entries(root)]


def _tree_entries(root: int) -> list[tuple[str, int, list[str]]]:
    """``(role, pid, /proc/PID/stat fields from the state on)`` of ``root`` and every process below it."""
    parents: dict[int, int] = {}
    info: dict[int, tuple[str, list[str]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        info[int(entry)] = (_role(argv), fields)
    mine = []
    for pid, (role, fields) in info.items():
        p = pid
        while p not in (root, 0, 1) and p in parents:
            p = parents[p]
        if p == root:
            mine.append((role, pid, fields))
    return mine


def _role(argv: list[str]) -> str:
    if any("nats-server" in a for a in argv):
        return "nats"
    if "pdserve" in argv:
        after = argv[argv.index("pdserve") + 1 :]
        if after and after[0] == "up":
            return "api"
        if after:
            return after[0]
    return "other"


def plot_goodput(
    runs: dict[str, Any], workloads: dict[str, Any], slo: dict[str, float], heading: str, out: Path
) -> list[str]:
    """Goodput against offered rate, one panel per workload (``workloads[w]``: its
    ``input_len`` and ``output_len``), one line per system (``runs[label]["workloads"][w]["points"]``,
    each point's ``rate`` and ``goodput_rps``) and, dashed in the same colour, the same with
    each request's longest gap where the points have it (``goodput_rps_max_itl``: the
    reading a request's own p99 cannot flatter), titled ``heading`` and the ``slo`` (its
    ``ttft_ms`` and ``itl_ms``), written to ``out`` (PNG). Returns the lines' labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for name, run in runs.items():
            points = (run.get("workloads") or {}).get(workload, {}).get("points") or []
            if not points:
                continue
            rates = [p["rate"] for p in points]
            (line,) = ax.plot(rates, [p["goodput_rps"] for p in points], marker="o", label=name)
            if all(p.get("goodput_rps_max_itl") is not None for p in points):
                strict = [p["goodput_rps_max_itl"] for p in points]
                ax.plot(rates, strict, marker="x", linestyle="--", color=line.get_color(), label=f"{name}, longest gap")
        lens = workloads[workload]
        ax.set_title(f"{workload}: {lens['input_len']} in / {lens['output_len']} out")
        ax.set_xlabel("offered requests/s")
        ax.set_ylabel("goodput (req/s within the SLO)")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend()
    fig.suptitle(
        f"{heading}: TTFT <= {slo['ttft_ms']:g} ms, each request's p99 ITL (dashed: longest gap) <= {slo['itl_ms']:g} ms"
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    labels = [str(line.get_label()) for ax in axes[0] for line in ax.get_lines()]
    plt.close(fig)
    return labels


async def greedy_probe(url: str, model: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of each prompt, one request at a time (batch 1: systems compared agree)."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for prompt in prompts:
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
            r = await client.post("/generate", json=body)
            r.raise_for_status()
            out.append(list(r.json()["output_ids"]))
    return out
