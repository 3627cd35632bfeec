"""Reasoning on ``/v1/chat/completions``: a model that thinks between ``<think>`` and
``</think>`` (Qwen3, QwQ, DeepSeek-R1 and its distills) gets its thinking in
``reasoning_content`` and its answer in ``content``, whole or streamed (DeepSeek's API and
vLLM's ``--reasoning-parser`` spell it so). ``--reasoning-parser auto`` turns this on where the
chat template mentions ``</think>``; ``none`` leaves the text as the model wrote it.

A reply begins inside the thinking when the prompt ends with ``<think>`` (templates that open
it for the model, as DeepSeek-R1's does); otherwise a reply that begins with ``<think>`` is
thinking up to ``</think>``, and one that begins otherwise is all answer (Qwen3 with
``chat_template_kwargs`` ``{"enable_thinking": false}``). Thinking cut short by
``max_tokens`` stays thinking."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pdserve.api.tools import partial_suffix, template_text

PARSERS = ("auto", "think", "none")
OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """``on``: replies are split into thinking and answer; ``why``: how that was decided."""

    on: bool
    why: str


def resolve_reasoning(tokenizer: Any, parser: str = "auto") -> ReasoningFormat:
    if parser not in PARSERS:
        raise ValueError(f"reasoning parser {parser!r}: use one of {', '.join(PARSERS)}")
    specials = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    if parser == "none":
        return ReasoningFormat(False, "--reasoning-parser none")
    if OPEN in specials or CLOSE in specials:
        if parser == "think":
            raise ValueError("--reasoning-parser think: the tokenizer drops <think> as a special token")
        return ReasoningFormat(False, "the tokenizer drops <think> as a special token")
    if parser == "think":
        return ReasoningFormat(True, "--reasoning-parser think")
    if CLOSE in template_text(tokenizer):
        return ReasoningFormat(True, "the chat template knows </think>")
    return ReasoningFormat(False, "the chat template has no </think>")


def opens_thinking(prompt: str) -> bool:
    """The prompt leaves the model inside its thinking (the template wrote ``<think>``)."""
    return bool(re.search(re.escape(OPEN) + r"\s*$", prompt))


class ThinkReader:
    """Splits one sample's text, as it streams, into (thinking, answer) pieces; reading a
    text whole gives what reading it in any pieces gives."""

    def __init__(self, inside: bool = False) -> None:
        self.state = "opened" if inside else "start"  # start -> opened -> inside -> after -> answer
        self.pending = ""
        self.thought = inside  # the reply had a thinking part

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        thinking = answer = ""
        while True:
            if self.state == "start":
                head = self.pending.lstrip()
                if head.startswith(OPEN):
                    self.pending = head[len(OPEN) :]
                    self.state = "opened"
                    self.thought = True
                    continue
                if not head or OPEN.startswith(head):
                    return thinking, answer  # not yet known
                self.state = "answer"
                continue
            if self.state == "opened":  # the whitespace that opens the thinking is not part of it
                self.pending = self.pending.lstrip()
                if not self.pending:
                    return thinking, answer
                self.state = "inside"
            if self.state == "inside":
                at = self.pending.find(CLOSE)
                if at < 0:  # hold back what may begin </think>, and the whitespace before it
                    body = self.pending[: len(self.pending) - partial_suffix(self.pending, CLOSE)]
                    body = body.rstrip()
                    thinking += body
                    self.pending = self.pending[len(body) :]
                    return thinking, answer
                thinking += self.pending[:at].rstrip()
                self.pending = self.pending[at + len(CLOSE) :]
                self.state = "after"
                continue
            if self.state == "after":  # the whitespace between thinking and answer is neither
                self.pending = self.pending.lstrip()
                if not self.pending:
                    return thinking, answer
                self.state = "answer"
            answer += self.pending
            self.pending = ""
            return thinking, answer

    def finish(self) -> tuple[str, str]:
        text, self.pending = self.pending, ""
        if self.state in ("opened", "inside"):
            return text, ""
        if self.state == "after":
            return "", ""
        return "", text


def split_whole(text: str, inside: bool) -> tuple[str | None, str]:
    """A whole reply's thinking (None when it had none) and answer."""
    reader = ThinkReader(inside)
    parts = [reader.feed(text), reader.finish()]
    thinking = "".join(p[0] for p in parts)
    return (thinking if reader.thought else None), "".join(p[1] for p in parts)
