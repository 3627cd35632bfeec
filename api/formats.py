"""Response bodies of the OpenAI and SGLang APIs, built from results and deltas."""

from __future__ import annotations

from typing import Any

from pdserve.api.completion import Delta, Result
from pdserve.api.model_info import ModelInfo
from pdserve.schemas import PromptLogprobs, TokenLogprob, Usage


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class TokenIdNames:
    """vLLM's ``return_tokens_as_token_ids``: logprobs name each token ``token_id:N`` (a token
    that is not text alone, a piece of a multi-byte character, stays exact)."""


TOKEN_ID_NAMES = TokenIdNames()
Names = ModelInfo | TokenIdNames  # how logprobs name tokens: the model's text, or their ids


def _piece(info: Names, token_id: int) -> str:
    if isinstance(info, TokenIdNames):
        return f"token_id:{token_id}"
    return info.tokenizer.decode([token_id])


def completion_logprobs(info: Names, ids: list[int], lps: list[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
    if not lps:
        return None
    tokens = [_piece(info, t) for t in ids]
    offsets = _offsets(tokens, offset)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_piece(info, i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)} for lp in lps],
        "text_offset": offsets,
    }


def echo_logprobs(
    info: Names, prompt_ids: list[int], scores: PromptLogprobs, ids: list[int], lps: list[TokenLogprob]
) -> dict[str, Any]:
    """Legacy completions with ``echo`` and ``logprobs``: the prompt's tokens first (the
    first has no log-probability: ``null``, as OpenAI's), each one's alternatives with the
    token itself among them, then the output's tokens as :func:`completion_logprobs`."""
    tokens = [_piece(info, t) for t in prompt_ids]
    top: list[dict[str, float] | None] = [None]
    for i in range(len(prompt_ids) - 1):
        alternatives = {_piece(info, a): v for a, v in scores.top(i)}
        alternatives.setdefault(tokens[i + 1], scores.logprobs[i])
        top.append(alternatives)
    out = {
        "tokens": tokens,
        "token_logprobs": [None, *scores.logprobs],
        "top_logprobs": top,
        "text_offset": _offsets(tokens, 0),
    }
    rest = completion_logprobs(info, ids, lps, sum(len(t) for t in tokens))
    if rest is not None:
        for key in out:
            out[key] += rest[key]
    return out


def _offsets(tokens: list[str], start: int) -> list[int]:
    offsets = []
    for t in tokens:
        offsets.append(start)
        start += len(t)
    return offsets


def vllm_prompt_logprobs(info: Names, prompt_ids: list[int], scores: PromptLogprobs) -> list[Any]:
    """vLLM's ``prompt_logprobs``: ``null`` for the first token, then per token a map from
    token id (a string) to its ``logprob``, ``rank`` and ``decoded_token``: the prompt's own
    token, then the most likely ones."""
    out: list[Any] = [None]
    for i, t in enumerate(prompt_ids[1:]):
        entry = {str(t): {"logprob": scores.logprobs[i], "rank": scores.ranks[i], "decoded_token": _piece(info, t)}}
        for rank, (a, v) in enumerate(scores.top(i), start=1):
            entry.setdefault(str(a), {"logprob": v, "rank": rank, "decoded_token": _piece(info, a)})
        out.append(entry)
    return out


def sglang_input_logprobs(
    meta: dict[str, Any], prompt_ids: list[int], scores: PromptLogprobs, start: int, text: ModelInfo | None = None
) -> None:
    """SGLang's ``input_token_logprobs`` (``[logprob, id, text]`` from ``logprob_start_len`` on;
    the first token's logprob ``null``; ``text`` each token's, with ``return_text_in_logprobs``
    (the model's ``text``), else ``null``) and, with ``top_logprobs_num``, ``input_top_logprobs``."""
    meta["input_token_logprobs"] = [
        [scores.logprobs[p - 1] if p else None, prompt_ids[p], _text(text, prompt_ids[p])]
        for p in range(start, len(prompt_ids))
    ]
    if scores.k:
        meta["input_top_logprobs"] = [
            [[v, a, _text(text, a)] for a, v in scores.top(p - 1)] if p else None for p in range(start, len(prompt_ids))
        ]


def _text(info: ModelInfo | None, token_id: int) -> str | None:
    return None if info is None else _piece(info, token_id)


def chat_logprobs(info: Names, ids: list[int], lps: list[TokenLogprob]) -> dict[str, Any] | None:
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


def sglang_logprobs(
    meta: dict[str, Any], ids: list[int], lps: list[TokenLogprob], text: ModelInfo | None = None
) -> None:
    """SGLang's ``output_token_logprobs`` and ``output_top_logprobs``: ``[logprob, id, text]``,
    ``text`` as :func:`sglang_input_logprobs` gives it."""
    if not lps:
        return
    meta["output_token_logprobs"] = [[lp.logprob, t, _text(text, t)] for t, lp in zip(ids, lps, strict=True)]
    meta["output_top_logprobs"] = [
        [[v, i, _text(text, i)] for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)] for lp in lps
    ]
