"""Response bodies of the OpenAI and SGLang APIs, built from results and deltas."""

from __future__ import annotations

from typing import Any

from pdserve.api.completion import Delta, Result
from pdserve.api.model_info import ModelInfo
from pdserve.schemas import TokenLogprob, Usage


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _piece(info: ModelInfo, token_id: int) -> str:
    return info.tokenizer.decode([token_id])


def completion_logprobs(
    info: ModelInfo, ids: list[int], lps: list[TokenLogprob], offset: int = 0
) -> dict[str, Any] | None:
    if not lps:
        return None
    tokens = [_piece(info, t) for t in ids]
    offsets = []
    pos = offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_piece(info, i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(info: ModelInfo, ids: list[int], lps: list[TokenLogprob]) -> dict[str, Any] | None:
    if not lps:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        piece = _piece(info, token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    return {
        "content": [
            {
                **entry(t, lp.logprob),
                "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)],
            }
            for t, lp in zip(ids, lps, strict=True)
        ]
    }


def openai_finish(reason: str | None) -> str | None:
    if reason in (None, "stop", "length"):
        return reason
    return "stop" if reason == "abort" else reason


def sglang_finish(reason: str | None, matched: str | int | None) -> dict[str, Any] | None:
    if reason is None:
        return None
    body: dict[str, Any] = {"type": reason}
    if reason == "stop" and matched is not None:
        body["matched"] = matched
    elif reason == "length":
        body["length"] = None
    return body


def sglang_meta(
    rid: str, r: Result | Delta, prompt_tokens: int, completion_tokens: int, cached: int, seconds: float | None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached,
        "finish_reason": sglang_finish(r.finish_reason, r.stop_reason),
    }
    if seconds is not None:
        meta["e2e_latency"] = seconds
    if r.timings:
        meta["timings"] = r.timings
    return meta


def sglang_logprobs(meta: dict[str, Any], ids: list[int], lps: list[TokenLogprob]) -> None:
    if not lps:
        return
    meta["output_token_logprobs"] = [[lp.logprob, t, None] for t, lp in zip(ids, lps, strict=True)]
    meta["output_top_logprobs"] = [
        [[v, i, None] for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)] for lp in lps
    ]
