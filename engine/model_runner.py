"""Loads a ``transformers`` causal LM, owns the KV pool, runs one packed forward pass.

Any architecture whose attention goes through ``transformers``' attention registry
works: the runner asks for :data:`ATTN_IMPLEMENTATION` and passes the step's layout
as a keyword argument. The runner never decides what runs; the scheduler does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.engine.attention import AttentionMetadata, DecodeGroup, PrefillSpan, Workspace, page_rows, write_rows
from pdserve.engine.checkpoint import ModelSpec, load_model
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graph import DecodeGraphs
from pdserve.engine.kernels import decode_splits
from pdserve.engine.kv_pool import KVPool, bytes_per_token, dtype_name, kv_dtype_name, page_bytes
from pdserve.engine.models import FP8_MIN_CAPABILITY, create_fast_model, fast_path_reason, fp8_reason
from pdserve.engine.models.batch import build_step, rows_step, verify_rows
from pdserve.engine.models.llama_cpu import LlamaFamilyCPU
from pdserve.engine.models.llama_weights import quantize_fp8_
from pdserve.engine.sequence import ScheduledBatch, Sequence
from pdserve.schemas import KVLayout

if TYPE_CHECKING:
    from pdserve.engine.models.llama import LlamaFamily
    from pdserve.engine.parallel import TPGroup

log = logging.getLogger(__name__)

VERIFY_GRAPH_MAX_ROWS = 512  # rows of the largest verify graph (64 sequences verifying 7 drafts)

# ``model_impl='auto'`` takes pdserve's own pass on a CPU too (a Llama-family model):
# bench/engine_bench.py --model smollm2 --modes pdserve,stock, 256 in / 64 out, fresh prompts,
# 3 interleaved runs on 2 shared cores (2026-12-03), medians at 1 / 8 / 16 in flight, out tok/s:
# bfloat16 31 / 107 / 108 against the stock code's 19 / 59 / 59, float32 20 / 68 / 82 against
# 12 / 40 / 53 (docs/cpu.md).


def kv_layout_of(model: torch.nn.Module, page_size: int, tp_size: int = 1, kv_cache_dtype: str = "auto") -> KVLayout:
    """The layout of one rank's pool: with tensor parallelism, its share of the KV heads;
    ``kv_cache_dtype`` (``--kv-cache-dtype``): ``auto`` the model's dtype, ``bf16``, ``fp8_e4m3``."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=(getattr(config, "num_key_value_heads", None) or heads) // tp_size,
        head_dim=head_dim,
        page_size=page_size,
        dtype=kv_dtype_name(kv_cache_dtype, next(model.parameters()).dtype),
    )


def kv_cache_dtype_reason(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> str | None:
    """Why ``--kv-cache-dtype`` cannot serve a model of ``model_dtype`` on ``device``, or ``None``."""
    if kv_cache_dtype == "bf16" and model_dtype != torch.bfloat16:
        return (
            f"the model runs in {dtype_name(model_dtype)}; a bfloat16 pool beside it is not supported: "
            "use --dtype bfloat16, or --kv-cache-dtype auto (the model's dtype) or fp8_e4m3"
        )
    if kv_cache_dtype == "fp8_e4m3" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            return (
                f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}; "
                "the FP8 attention kernels need 8.9 or above (Ada, Hopper and later)"
            )
    return None


class ModelRunner:
    """``model``, if given, is used as is (it must already use :data:`ATTN_IMPLEMENTATION`).

    ``tp``: this process's place in a tensor-parallel group (see :mod:`.parallel`): the
    model is split by its plan, the pool holds this rank's KV heads, and rank 0 sends each
    step (and each page copy) to the followers before running it; a follower runs
    :meth:`follow`. The page count is rank 0's, sent to the followers, so pools match.

    ``allow_interpreter``: with ``model_impl='pdserve'`` on a CPU under Triton's interpreter
    (the tests), run the Triton pass interpreted; ``False``: pdserve's CPU pass (torch ops)."""

    def __init__(
        self,
        spec: ModelSpec,
        config: EngineConfig,
        model: torch.nn.Module | None = None,
        tp: TPGroup | None = None,
        allow_interpreter: bool = True,
    ) -> None:
        self.config = config
        self.allow_interpreter = allow_interpreter
        self.fp8_bytes: tuple[int, int] | None = None  # --quantization fp8: the weights' bytes before, after
        self.device = torch.device(config.device)
        self.tp = tp
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        started = time.monotonic()
        self.model = model if model is not None else load_model(spec, self.device, config.quantization)
        tp_size = 1 if tp is None else tp.size
        if tp is not None:
            from pdserve.engine.parallel import shard_model

            shard_model(self.model, tp.rank, tp.size, tp.all_reduce)
        if config.quantization == "fp8":  # before the pool is sized: it gets the memory freed
            self._quantize_fp8()
        text_config = self.model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_model_len = config.max_model_len or getattr(text_config, "max_position_embeddings", 4096)
        reason = kv_cache_dtype_reason(config.kv_cache_dtype, next(self.model.parameters()).dtype, self.device)
        if reason is not None:
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype}: {reason}")
        self.layout = kv_layout_of(self.model, config.page_size, tp_size, config.kv_cache_dtype)
        self.num_pages = self._num_pages()
        if tp is not None:  # the pools of all ranks have the same pages: as many as the smallest holds
            self.num_pages = _smallest(tp, self.num_pages)
        # One page past the allocator's: padded rows of a replayed decode graph write there.
        self.scratch_page = self.num_pages
        self.pool = KVPool(self.layout, self.num_pages + 1, self.device, config.kv_shared_dir)
        self.workspace = Workspace()
        self.fast = self._fast_model()
        self.model_impl = "transformers" if self.fast is None else "pdserve"
        self.graphs: DecodeGraphs | None = None
        if self.fast is not None and self.device.type == "cuda" and config.cuda_graph_max_batch > 0:
            self.graphs = DecodeGraphs(
                self.fast.forward,
                min(config.cuda_graph_max_batch, config.max_num_seqs),
                -(-self.max_model_len // config.page_size),
                config.page_size,
                self.scratch_page,
                self._splits,
                self.device,
            )
            self.graphs.capture()
        # Speculative verifies as decode rows (engine/models/batch.verify_rows): replayed as
        # graphs of their own (each row's K/V stored before attention), up to the decode graphs'
        # batch times K + 1 rows (at most VERIFY_GRAPH_MAX_ROWS); more rows, or no graphs, run
        # eagerly as rows; a verify beside a prefill runs as prefill chunks. Each way is counted
        # in ``verify_paths``.
        self.verify_graphs: DecodeGraphs | None = None
        self.verify_as_rows = self.fast is not None and self.device.type == "cuda"
        self.verify_paths = {"graph": 0, "rows": 0, "chunks": 0}
        if self.graphs is not None and config.speculative_algorithm:
            self.verify_graphs = DecodeGraphs(
                self.fast.forward,  # type: ignore[union-attr]
                min(self.graphs.max_batch * (config.speculative_num_draft_tokens + 1), VERIFY_GRAPH_MAX_ROWS),
                -(-self.max_model_len // config.page_size),
                config.page_size,
                self.scratch_page,
                self._splits,
                self.device,
                kv_first=True,
            )
            self.verify_graphs.capture()
        if self.fast is not None and self.device.type == "cuda":
            assert not isinstance(self.fast, LlamaFamilyCPU)
            self.fast.warm_up_decode(self._splits(n) for n in range(1, config.max_num_seqs + 1))
            self.fast.warm_up_prefill()
            self.fast.warm_up_sdpa(config.chunked_prefill_size)
        log.info(
            "model loaded",
            extra={
                "path": str(spec.path),
                "seconds": round(time.monotonic() - started, 2),
                "pages": self.num_pages,
                "kv_bytes": self.pool.nbytes,
                "model_impl": self.model_impl,
                "quantization": config.quantization,
                "kv_dtype": self.layout.dtype,
                "kv_bytes_per_token": bytes_per_token(self.layout),
                "cuda_graphs": self.graphs is not None,
            },
        )

    def _quantize_fp8(self) -> None:
        """The decoder layers' linear weights in FP8 (see :func:`quantize_fp8_`), or a
        ``ValueError`` saying why this model, pass or device cannot run them."""
        impl = self.config.model_impl
        reason = fp8_reason(self.model, self.device, impl, impl == "pdserve" and self.allow_interpreter)
        if reason is not None:
            raise ValueError(f"--quantization fp8: {reason}")
        before, after = self.fp8_bytes = quantize_fp8_(self.model)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the 16-bit weights' memory back to the device, for the pool
        layers = len(self.model.model.layers)  # type: ignore[union-attr,arg-type]
        log.info(
            "fp8 weights",
            extra={
                "layers": f"qkv, o, gate_up, down of {layers} decoder layers (embeddings and LM head unchanged)",
                "bytes_before": before,
                "bytes_after": after,
                "bytes_saved": before - after,
                "already_quantized": before == 0,  # a model shared with an engine that quantized it
            },
        )

    def _fast_model(self) -> LlamaFamily | LlamaFamilyCPU | None:
        """pdserve's own forward pass where the architecture and device allow it (logged
        once, with the reason, whichever pass is chosen)."""
        impl = self.config.model_impl
        if impl == "transformers":
            log.info("stock transformers forward pass", extra={"reason": "model_impl 'transformers'"})
            return None
        interpret = impl == "pdserve" and self.allow_interpreter
        reason = fast_path_reason(self.model, self.device, allow_interpreter=interpret)
        if reason is not None:
            if impl == "pdserve":
                raise ValueError(f"model_impl 'pdserve' cannot serve this model: {reason}")
            log.info("stock transformers forward pass", extra={"reason": reason})
            return None
        fast = create_fast_model(
            self.model,
            self.pool.kv,
            self.max_model_len,
            self.tp,
            interpret,
            self.pool.kv_scales,
            self.config.cpu_attention,
        )
        log.info("pdserve forward pass", extra={"reason": f"model_impl {impl!r}", "pass": type(fast).__name__})
        return fast

    def _splits(self, batch: int) -> int:
        if self.device.type != "cuda":
            return 2
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return decode_splits(batch, self.layout.num_kv_heads, sms)

    def _num_pages(self) -> int:
        page = self.config.page_size
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens // page
        per_page = page_bytes(self.layout)  # FP8: with its blocks' scales, 1.996x bf16's tokens at head_dim 128
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.kv_memory_fraction)
        else:
            budget = self.config.cpu_kv_bytes
        return max(budget // per_page, 1)

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, feed: tuple[torch.Tensor, list[int]] | None = None
    ) -> tuple[list[Sequence], torch.Tensor | None]:
        """Run the batch; returns the sequences that get a next token and their logits rows,
        followed by every row of each speculative verify (``batch.verifies``, in order), then
        the prompt rows to score (``batch.scored``, in order).

        ``feed``: device tokens of the step before and, per decode, the row there that is
        its input token (-1: the sequence's own last token); the fast path only.
        """
        if self.tp is not None and self.tp.is_leader:
            from pdserve.engine.parallel import step_command

            self.tp.send(step_command(batch, None if feed is None else feed[1]))
        if self.fast is not None:
            return self._execute_fast(batch, feed)
        assert feed is None, "only the fast path takes its input tokens from the device"
        meta, input_ids, positions, sample_index, sample_seqs = self._prepare(batch)
        if not sample_seqs and not batch.verifies and not batch.scored:
            self.model(input_ids=input_ids, position_ids=positions, pd_attn=meta, use_cache=False, logits_to_keep=1)
            return [], None
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            pd_attn=meta,
            use_cache=False,
            logits_to_keep=sample_index,
        )
        return sample_seqs, out.logits[0]

    def _execute_fast(
        self, batch: ScheduledBatch, feed: tuple[torch.Tensor, list[int]] | None
    ) -> tuple[list[Sequence], torch.Tensor | None]:
        assert self.fast is not None
        graphs = self.graphs
        if graphs is not None and not batch.prefills and not batch.verifies and len(batch.decodes) <= graphs.max_batch:
            seqs = batch.decodes
            logits = graphs.run(
                [s.last_token for s in seqs], [s.num_tokens - 1 for s in seqs], [s.page_table for s in seqs], feed
            )
            return seqs, logits
        if batch.verifies and not batch.prefills and self.verify_as_rows:
            assert feed is None, "speculation turns the overlap off"
            ids, positions, tables, seqs = verify_rows(batch)
            verify_graphs = self.verify_graphs
            if verify_graphs is not None and len(ids) <= verify_graphs.max_batch:
                self.verify_paths["graph"] += 1
                return seqs, verify_graphs.run(ids, positions, tables)
            self.verify_paths["rows"] += 1
            rows = rows_step(ids, positions, tables, self.config.page_size, self.device, self._splits(len(ids)))
            return seqs, self.fast.forward(rows)
        if batch.verifies:
            self.verify_paths["chunks"] += 1
        step, seqs = build_step(
            batch,
            self.config.page_size,
            self.device,
            self._splits(len(batch.decodes)),
            getattr(self.fast, "prefixed_sdpa_rows", 0),
        )
        if feed is not None:
            from pdserve.engine.kernels import elementwise  # the fast path has Triton

            src = torch.tensor(feed[1], dtype=torch.long).to(self.device, non_blocking=True)
            elementwise.feed(step.input_ids[: step.num_decodes], src, feed[0])
        logits = self.fast.forward(step)
        return (seqs, logits) if seqs or batch.verifies or batch.scored else ([], None)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page ``src`` into ``dst`` (every rank's share of it)."""
        if self.tp is not None and self.tp.is_leader:
            self.tp.send(("copy", src, dst))
        self.pool.copy_page(src, dst)

    def follow(self, handlers: dict[str, Callable[..., None]] | None = None) -> None:
        """A follower rank: run rank 0's commands until it says stop (or is gone, which
        raises). ``handlers`` serve the commands of the worker's floor (KV pulls)."""
        from pdserve.engine.parallel import mirror_batch

        assert self.tp is not None and not self.tp.is_leader
        handlers = handlers or {}
        shared: torch.Tensor | None = None  # rank 0's last sampled tokens (they feed its next step)
        while True:
            kind, *rest = self.tp.receive()
            if kind == "step":
                decodes, prefills, rows, verifies, scored = rest
                feed = None if rows is None else (shared, rows)
                with torch.inference_mode():
                    self.execute(mirror_batch(decodes, prefills, verifies, scored), feed)  # type: ignore[arg-type]
            elif kind == "tokens":
                shared = torch.empty(rest[0], dtype=torch.long, device=self.device)
                self.tp.broadcast(shared)
            elif kind == "copy":
                self.pool.copy_page(*rest)
            elif kind == "stop":
                return
            else:
                handlers[kind](*rest)

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0, after sampling on the device: the followers get the step's tokens too (a
        step left queued feeds them to the next); returns the tokens, as ``long``."""
        tokens = tokens.to(torch.long).contiguous()
        if self.tp is not None and self.tp.is_leader:
            self.tp.send(("tokens", tokens.shape[0]))
            self.tp.broadcast(tokens)
        return tokens

    def stop_followers(self) -> None:
        """Rank 0, when the worker ends: the followers leave :meth:`follow`."""
        if self.tp is not None and self.tp.is_leader:
            self.tp.send(("stop",))

    def _prepare(
        self, batch: ScheduledBatch
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, list[Sequence]]:
        page = self.config.page_size
        ids: list[int] = []
        pos: list[int] = []
        pages: list[int] = []
        offsets: list[int] = []
        sample_index: list[int] = []
        sample_seqs: list[Sequence] = []
        decodes = sorted(batch.decodes, key=lambda s: s.num_tokens, reverse=True)
        for seq in decodes:
            p = seq.num_tokens - 1
            ids.append(seq.last_token)
            pos.append(p)
            pages.append(seq.page_table[p // page])
            offsets.append(p % page)
            sample_index.append(len(ids) - 1)
            sample_seqs.append(seq)
        spans: list[PrefillSpan] = []
        first_row: dict[int, int] = {}  # a prefill's sequence (id) -> the row of its chunk's first token
        for seq, n in batch.prefills:
            start = seq.num_computed
            q_start = len(ids)
            first_row[id(seq)] = q_start - start
            tokens = seq.tokens
            ids.extend(tokens[start : start + n])
            for p in range(start, start + n):
                pos.append(p)
                pages.append(seq.page_table[p // page])
                offsets.append(p % page)
            ctx = start + n
            rows = None
            if ctx != n:
                table = torch.tensor([seq.page_table[: -(-ctx // page)]], dtype=torch.long, device=self.device)
                rows = page_rows(self.pool.kv, table)
            spans.append(PrefillSpan(q_start, n, ctx, rows))
            if ctx == seq.num_tokens:
                sample_index.append(len(ids) - 1)
                sample_seqs.append(seq)
        for seq, draft in batch.verifies:  # speculative: the last token and the draft, every row sampled
            start = seq.num_tokens - 1
            q_start = len(ids)
            ids += [seq.last_token, *draft]
            ctx = start + len(draft) + 1
            for p in range(start, ctx):
                pos.append(p)
                pages.append(seq.page_table[p // page])
                offsets.append(p % page)
            table = torch.tensor([seq.page_table[: -(-ctx // page)]], dtype=torch.long, device=self.device)
            spans.append(PrefillSpan(q_start, len(draft) + 1, ctx, page_rows(self.pool.kv, table)))
            sample_index.extend(range(q_start, ctx - start + q_start))
        for seq, p, n in batch.scored:  # prompt rows to score come last
            sample_index.extend(range(first_row[id(seq)] + p, first_row[id(seq)] + p + n))
        device = self.device
        meta = AttentionMetadata(
            kv_pool=self.pool.kv,
            kv_scales=self.pool.kv_scales,
            write_rows=write_rows(
                self.pool.kv,
                torch.tensor(pages, dtype=torch.long, device=device),
                torch.tensor(offsets, dtype=torch.long, device=device),
            ),
            decode_groups=self._decode_groups(decodes),
            prefills=spans,
            workspace=self.workspace,
        )
        return (
            meta,
            torch.tensor([ids], dtype=torch.long, device=device),
            torch.tensor([pos], dtype=torch.long, device=device),
            torch.tensor(sample_index, dtype=torch.long, device=device),
            sample_seqs,
        )

    def _decode_groups(self, decodes: list[Sequence]) -> list[DecodeGroup]:
        """Split decodes (sorted longest first) where padding to the group's longest gets wasteful."""
        page = self.config.page_size
        groups: list[DecodeGroup] = []
        start = 0
        while start < len(decodes):
            max_pages = -(-decodes[start].num_tokens // page)
            end = start + 1
            while end < len(decodes) and (end - start < 8 or -(-decodes[end].num_tokens // page) * 2 > max_pages):
                end += 1
            members = decodes[start:end]
            tables = [s.page_table[:max_pages] + [0] * (max_pages - len(s.page_table[:max_pages])) for s in members]
            groups.append(
                DecodeGroup(
                    start=start,
                    count=end - start,
                    rows=page_rows(self.pool.kv, torch.tensor(tables, dtype=torch.long, device=self.device)),
                    ctx_lens=torch.tensor([s.num_tokens for s in members], dtype=torch.long, device=self.device),
                    positions=torch.arange(max_pages * page, device=self.device)[None, :],
                    length=members[0].num_tokens,
                )
            )
            start = end
        return groups


def _smallest(tp: TPGroup, value: int) -> int:
    """The smallest of every rank's ``value``, on every rank."""
    import torch.distributed as dist

    box = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=tp.control)
    return int(box.item())
