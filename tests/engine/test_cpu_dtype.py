"""``--dtype auto`` on a CPU: 16-bit checkpoints in bfloat16 where the CPU has it natively."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pdserve.engine.checkpoint import resolve_dtype
from pdserve.engine.cpu_dtype import auto_cpu_dtype, cpu_flags

ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
SAPPHIRE_RAPIDS = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
OLDER = frozenset({"avx2", "avx512f"})


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bfloat16 in this torch's oneDNN")
@pytest.mark.parametrize("flags", [ZEN4, SAPPHIRE_RAPIDS])
def test_a_16_bit_checkpoint_runs_in_bfloat16_on_a_cpu_with_native_bf16(flags: frozenset[str]) -> None:
    for stored in (torch.bfloat16, torch.float16):
        dtype, why = auto_cpu_dtype(stored, flags)
        assert dtype == torch.bfloat16 and "bf16" in why


def test_float32_without_native_bf16_or_for_a_float32_checkpoint() -> None:
    assert auto_cpu_dtype(torch.bfloat16, OLDER)[0] == torch.float32
    dtype, why = auto_cpu_dtype(torch.float32, ZEN4)
    assert dtype == torch.float32 and "float32" in why
    assert auto_cpu_dtype(None, ZEN4)[0] == torch.float32


def test_the_choice_is_logged_and_an_explicit_dtype_wins(caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="pdserve.engine.checkpoint"):
        chosen = resolve_dtype("auto", torch.float32, cpu)
    assert chosen == torch.float32
    record = next(r for r in caplog.records if r.getMessage() == "cpu dtype")
    assert record.__dict__["dtype"] == "float32" and record.__dict__["reason"]
    assert resolve_dtype("float32", torch.bfloat16, cpu) == torch.float32
    assert resolve_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
