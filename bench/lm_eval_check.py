"""lm-evaluation-harness against pdserve, and against ``transformers`` on the same weights.

Runs `lm_eval` twice on two offline tasks built from ``engine/data/tiny_corpus.txt``: a cloze
(``multiple_choice``: a sentence's ending among four, scored by log-likelihood) and the
corpus' perplexity (``loglikelihood_rolling``). First through ``pdserve up`` with lm-eval's
``local-completions`` model (prompts as token ids, ``echo`` with ``logprobs``: the requests
its loglikelihood tasks send to an OpenAI-style server), then with its ``hf`` model, the
reference, in the same dtype. Reports both scores and the largest difference of any one
log-likelihood lm-eval computed, to ``--out``.

    python bench/lm_eval_check.py --model .pdserve/models/SmolLM2-135M-Instruct --out result.json

Needs ``lm_eval`` (``pip install "lm-eval[api]"``) importable by ``--lm-eval-python``
alongside torch and transformers (``hf``; docs/models.md shows one way); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "engine" / "data" / "tiny_corpus.txt"


def english_sentences(text: str) -> list[str]:
    """The corpus' English prose sentences (no code, no headings, no Chinese)."""
    prose = " ".join(
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith(("#", " ", "\t"))
    )
    sentences = re.split(r"(?<=[.!?])\s+", prose)
    return [
        s for s in sentences if s.isascii() and re.fullmatch(r"[A-Za-z0-9 ,;:'\"()\-.!?]+", s) and len(s.split()) >= 10
    ]


def english_paragraphs(text: str) -> list[str]:
    blocks = [b.strip() for b in text.split("\n\n")]
    return [
        " ".join(b.split())
        for b in blocks
        if len(b) > 200 and b.isascii() and not b.startswith(("#", "```", "def ", "    "))
    ]


def write_tasks(where: Path, seed: int) -> None:
    """Two lm-eval tasks over local JSON lines: ``pdserve_cloze`` and ``pdserve_corpus_ppl``."""
    text = CORPUS.read_text()
    rng = random.Random(seed)
    sentences = english_sentences(text)
    docs = []
    for s in sentences:
        words = s.split()
        cut = max(len(words) * 3 // 5, 4)
        others = rng.sample([o for o in sentences if o != s], 3)
        endings = [" ".join(o.split()[max(len(o.split()) * 3 // 5, 4) :]) for o in others]
        label = rng.randrange(4)
        endings.insert(label, " ".join(words[cut:]))
        docs.append({"context": " ".join(words[:cut]), "choices": endings, "label": label})
    (where / "cloze.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (where / "corpus.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in english_paragraphs(text)))
    common = "dataset_path: json\ntest_split: test\n"
    (where / "pdserve_cloze.yaml").write_text(
        "task: pdserve_cloze\n" + common + f"dataset_kwargs:\n  data_files:\n    test: {where / 'cloze.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (where / "pdserve_corpus_ppl.yaml").write_text(
        "task: pdserve_corpus_ppl\n" + common + f"dataset_kwargs:\n  data_files:\n    test: {where / 'corpus.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"pdserve up ended with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("pdserve up did not become healthy")


def lm_eval(python: str, tasks: Path, out: Path, model: str, model_args: str, extra: list[str]) -> dict[str, Any]:
    argv = [python, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
            "--tasks", "pdserve_cloze", "pdserve_corpus_ppl", "--include_path", str(tasks),
            "--output_path", str(out), "--log_samples", *extra]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(argv, check=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    seconds = time.perf_counter() - started
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {}
    for task in ("pdserve_cloze", "pdserve_corpus_ppl"):
        path = next(out.rglob(f"samples_{task}_*.jsonl"))
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return {"seconds": round(seconds, 1), "results": results["results"], "samples": samples}


def loglikelihoods(samples: list[dict[str, Any]]) -> list[float]:
    """Every log-likelihood of a task's samples, in order (per choice, or per document)."""
    out: list[float] = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        for resp in s["filtered_resps"]:
            out.append(float(resp[0] if isinstance(resp, list) else resp))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a local model directory")
    parser.add_argument("--dtype", default="float32", help="both sides' dtype (pdserve --dtype, hf dtype)")
    parser.add_argument("--mode", default="pd", choices=["pd", "unified"])
    parser.add_argument("--lm-eval-python", default=sys.executable, help="a Python with lm_eval, torch, transformers")
    parser.add_argument("--concurrent", type=int, default=4, help="lm-eval's num_concurrent against pdserve")
    parser.add_argument("--seed", type=int, default=0, help="the cloze's distractors")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pdserve-lmeval-"))
    tasks = work / "tasks"
    tasks.mkdir()
    write_tasks(tasks, args.seed)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--model-path", str(args.model), "--dtype", args.dtype,
         "--mode", args.mode, "--port", str(port), "--data-dir", str(work / "data")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_healthy(url, up, 300)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            name = json.loads(r.read())["data"][0]["id"]
        served = lm_eval(
            args.lm_eval_python, tasks, work / "pdserve", "local-completions",
            f"model={name},base_url={url}/v1/completions,tokenizer={args.model},tokenized_requests=True,"
            f"num_concurrent={args.concurrent},max_retries=1",
            [],
        )  # fmt: skip
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(timeout=60)
    reference = lm_eval(
        args.lm_eval_python, tasks, work / "hf", "hf", f"pretrained={args.model},dtype={args.dtype}",
        ["--device", "cpu", "--batch_size", "8"],
    )  # fmt: skip
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model.name,
        "dtype": args.dtype,
        "mode": args.mode,
        "command": " ".join(sys.argv),
        "tasks": {},
    }
    for task in ("pdserve_cloze", "pdserve_corpus_ppl"):
        ours, theirs = loglikelihoods(served["samples"][task]), loglikelihoods(reference["samples"][task])
        assert len(ours) == len(theirs), (task, len(ours), len(theirs))
        diffs = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
        metrics = {k: v for k, v in served["results"][task].items() if not k.startswith("alias")}
        reference_metrics = {k: v for k, v in reference["results"][task].items() if not k.startswith("alias")}
        report["tasks"][task] = {
            "docs": len(served["samples"][task]),
            "loglikelihoods": len(ours),
            "pdserve": metrics,
            "transformers": reference_metrics,
            "max_abs_loglikelihood_diff": max(diffs),
            "mean_abs_loglikelihood_diff": sum(diffs) / len(diffs),
        }
    report["seconds"] = {"pdserve": served["seconds"], "transformers": reference["seconds"]}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
