"""``--quantization fp8`` on pdserve's Triton pass (interpreted on the CPU): greedy output
against ``transformers`` with the same weights rounded to FP8 (dequantized: the very values
the kernels multiply by), the 16-bit weights gone before the pool is sized, and the refusals.

With GEMVs (their row limit raised to 64 here) a product is the FP8 GEMV with activations as
they are, so the reference is the dequantized model itself; without GEMVs every product
quantizes its activations per token first (then the batched W8A8 kernel or
``torch._scaled_mm``), and the reference does the same in a hook before each projection.
"""

from __future__ import annotations

import copy
import gc
import random
import weakref
from pathlib import Path

import pytest
import torch

from pdserve.bench import shapes
from pdserve.engine import quant
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kernels import elementwise, fp8
from pdserve.engine.loader import quiet_transformers
from pdserve.engine.model_runner import ModelRunner, ModelSpec
from pdserve.engine.models import fp8_reason
from pdserve.engine.models.llama_weights import is_fp8
from tests.engine.kernel_env import DEVICE, llama
from tests.engine.reference import assert_greedy_equal, hf_greedy, run

NEW = 5
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projections(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS]


def fp8_reference(model: torch.nn.Module, quantize_activations: bool) -> torch.nn.Module:
    """A copy of ``model`` with each projection's weight rounded to FP8 per output channel
    (and, asked, its input per token), every other weight as it is."""
    ref = copy.deepcopy(model)
    for m in projections(ref):
        m.weight.data = quant.quantize_fp8(m.weight.data).dequantize(m.weight.dtype)
        if quantize_activations:

            def per_token(_: torch.nn.Module, args: tuple) -> tuple:
                (x,) = args
                q, scale = quant.quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
                return ((q.to(torch.float32) * scale[:, None]).to(x.dtype).reshape(x.shape),)

            m.register_forward_pre_hook(per_token)
    return ref


def counted(monkeypatch: pytest.MonkeyPatch, **targets: tuple[object, str]) -> dict[str, int]:
    """Each of ``targets`` (a key: its module and function name) wrapped to count its calls."""
    calls = dict.fromkeys(targets, 0)
    for key, (module, name) in targets.items():

        def call(*args: object, _fn: object = getattr(module, name), _key: str = key, **kwargs: object) -> object:
            calls[_key] += 1
            return _fn(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(module, name, call)
    return calls


def fp8_config(**overrides: object) -> EngineConfig:
    values: dict = dict(
        device=str(DEVICE),
        max_total_tokens=512,
        model_impl="pdserve",
        chunked_prefill_size=16,
        cuda_graph_max_batch=0,
        quantization="fp8",
    )
    return EngineConfig(**{**values, **overrides})


@pytest.mark.parametrize(("kind", "use_gemv"), [("qwen2", True), ("llama", False)])
def test_fp8_greedy_equals_transformers_on_fp8_rounded_weights(
    kind: str, use_gemv: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    quiet_transformers()
    monkeypatch.setattr(fp8, "GEMV_MAX_ROWS", 64)  # read at each step: all of this test's steps
    model = shapes.small_model(kind, DEVICE)
    reference = fp8_reference(model, quantize_activations=not use_gemv)
    rng = random.Random(kind)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (4, 21)]
    expected = hf_greedy(reference, prompts, NEW)
    # FP8 rounding changes the weights: the reference is not the model itself
    assert not torch.equal(projections(reference)[0].weight, projections(model)[0].weight)
    config = fp8_config()
    runner = ModelRunner(ModelSpec(Path(kind)), config, model=model)
    assert runner.model_impl == "pdserve" and isinstance(runner.fast, llama.LlamaFamily)
    runner.fast.use_gemv = use_gemv  # with GEMVs every step here has at most 16 + 2 rows
    calls = counted(monkeypatch, norm=(elementwise, "add_rms_norm_fp8"), rows=(fp8, "quantize_rows"))
    ours = run(Engine(runner, config), prompts, NEW)
    assert_greedy_equal(reference, prompts, ours, expected)
    if use_gemv:
        assert calls == {"norm": 0, "rows": 0}
    else:  # qkv and gate_up take their rows quantized by the norm; o and down quantize their own
        assert calls["norm"] > 0 and calls["norm"] == calls["rows"]


def test_fp8_weights_replace_the_16_bit_ones_before_the_pool_is_sized(monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_transformers()
    model = shapes.small_model("qwen2", DEVICE)
    weights = [weakref.ref(m.weight) for m in projections(model)]
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    sized_after_quantizing = []
    num_pages = ModelRunner._num_pages

    def spy(self: ModelRunner) -> int:
        sized_after_quantizing.append(is_fp8(self.model))
        return num_pages(self)

    monkeypatch.setattr(ModelRunner, "_num_pages", spy)
    runner = ModelRunner(ModelSpec(Path("q")), fp8_config(), model=model)
    assert sized_after_quantizing == [True]
    gc.collect()
    assert all(ref() is None for ref in weights), "a 16-bit copy of a projection is still held"
    assert all(m.weight.is_meta for m in projections(model))
    assert runner.fast is not None
    for layer in runner.fast.layers:
        for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight):
            assert isinstance(w, quant.Fp8Weight) and w.q.dtype == torch.float8_e4m3fn
            assert w.scale.dtype == torch.float32 and w.scale.shape == (w.q.shape[0],)
    # not the embeddings or the LM head
    assert runner.fast.embed is embed and runner.fast.lm_head is head and head.dtype == torch.float32
    assert runner.fp8_bytes is not None
    before, after = runner.fp8_bytes
    # float32 weights: a quarter of the bytes, plus 4 bytes of scale per output channel
    channels = sum(m.weight.shape[0] for m in projections(model))
    assert before == 4 * sum(m.weight.numel() for m in projections(model))
    assert after == before // 4 + 4 * channels
    # a second runner over the same (co-located) model takes its FP8 weights as they are
    again = ModelRunner(ModelSpec(Path("q")), fp8_config(), model=model)
    assert again.fp8_bytes == (0, 0) and again.fast is not None
    assert again.fast.layers[0].qkv_weight is runner.fast.layers[0].qkv_weight


def test_fp8_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    quiet_transformers()
    model = shapes.small_model("qwen2", DEVICE)
    spec = ModelSpec(Path("r"))
    with pytest.raises(ValueError, match=r"model_impl .transformers. \(the stock code\) has no FP8 matmuls"):
        ModelRunner(spec, fp8_config(model_impl="transformers"), model=model)
    if DEVICE.type == "cpu":  # auto (and pdserve without the interpreter) take the CPU pass there
        with pytest.raises(ValueError, match="CPU pass has no FP8 matmuls"):
            ModelRunner(spec, fp8_config(model_impl="auto"), model=model)
        with pytest.raises(ValueError, match="CPU pass has no FP8 matmuls"):
            ModelRunner(spec, fp8_config(), model=model, allow_interpreter=False)
    assert not is_fp8(model), "a refusal leaves the model alone"
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(ValueError, match="cannot serve this model: architecture GPT2LMHeadModel has no fast path"):
        ModelRunner(spec, fp8_config(), model=gpt2.to(DEVICE))
    # a GPU before Ada: no FP8 conversions in Triton, no _scaled_mm
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    reason = fp8_reason(model, torch.device("cuda"), "pdserve")
    assert reason is not None and "NVIDIA A100 has compute capability 8.0; FP8 matmuls need 8.9" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_reason(model, torch.device("cuda"), "pdserve") is None
    with pytest.raises(ValueError, match="quantization is fp8 or None"):
        EngineConfig(quantization="int8")
