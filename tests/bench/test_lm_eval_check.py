"""``bench/lm_eval_check.py``'s offline tasks (lm-eval itself is not installed here): each cloze
question holds its sentence's true ending once among four, at its label; the paragraphs are the
corpus' English prose; the task files name those data files; the log-likelihoods are read back
from lm-eval's samples in document order."""

from __future__ import annotations

import importlib
import json
from pathlib import Path


def test_tasks_are_built_from_the_corpus(tmp_path: Path) -> None:
    check = importlib.import_module("lm_eval_check")
    check.write_tasks(tmp_path, seed=0)
    text = check.CORPUS.read_text()
    prose = " ".join(text.split())
    docs = [json.loads(line) for line in (tmp_path / "cloze.jsonl").read_text().splitlines()]
    assert len(docs) > 100
    for doc in docs:
        assert len(doc["choices"]) == 4 and 0 <= doc["label"] < 4
        sentence = doc["context"] + " " + doc["choices"][doc["label"]]
        assert sentence in prose
        assert sum(doc["context"] + " " + c in prose for c in doc["choices"]) == 1  # one true ending
    paragraphs = [json.loads(line)["text"] for line in (tmp_path / "corpus.jsonl").read_text().splitlines()]
    assert len(paragraphs) > 20 and all(p.isascii() and p in prose for p in paragraphs)
    assert f"test: {tmp_path / 'cloze.jsonl'}" in (tmp_path / "pdserve_cloze.yaml").read_text()
    again = tmp_path / "again"
    again.mkdir()
    check.write_tasks(again, seed=0)
    assert (again / "cloze.jsonl").read_text() == (tmp_path / "cloze.jsonl").read_text()  # seeded


def test_loglikelihoods_in_document_order() -> None:
    check = importlib.import_module("lm_eval_check")
    samples = [
        {"doc_id": 1, "filtered_resps": [[-3.0, False], [-1.0, True]]},
        {"doc_id": 0, "filtered_resps": [[-2.0, True], [-4.0, False]]},
    ]
    assert check.loglikelihoods(samples) == [-2.0, -4.0, -3.0, -1.0]
    assert check.loglikelihoods([{"doc_id": 0, "filtered_resps": [-12.5]}]) == [-12.5]  # rolling
