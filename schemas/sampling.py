"""Sampling parameters carried by a request from the API to the workers."""

from __future__ import annotations

import dataclasses
import functools

import regex

from pdserve.schemas.kv_events import salt_root

MAX_STOP_STRINGS = 16
MAX_STOP_REGEX = 256  # characters of one stop_regex pattern
MAX_TOP_LOGPROBS = 20
MAX_SAMPLES = 64  # n: parallel samples of one prompt
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_BAD_WORDS = 256  # token sequences of bad_words (a word tokenized two ways counts twice)
MAX_BAD_WORD_TOKENS = 32
MAX_CACHE_SALT = 256  # characters of cache_salt
MAX_PRIORITY = 1 << 31  # |priority|


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction (``ValueError``).

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` and
    ``min_p == 0`` disable those filters. ``seed`` makes sampling reproducible for
    the request, independent of what else is in the batch.
    """

    max_new_tokens: int = 128
    # No end of sequence, stop token or stop string before this many output tokens (vLLM's
    # min_tokens, SGLang's min_new_tokens): the end tokens' logits are masked until then.
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # SGLang's stop_regex: generation stops once the text matches one (Python's regular
    # expressions, as the ``regex`` package reads them; the text is cut before the match)
    stop_regex: tuple[str, ...] = ()
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    # The prompt's own tokens' log-probabilities (each given the tokens before it, from the
    # second on), with this many alternatives each; ``None``: not wanted. Computed in full:
    # such a request takes nothing from the prefix cache. With ``n`` > 1, once, on every
    # sample's first chunk.
    prompt_logprobs: int | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: tuple[int, ...] = ()  # non-empty: only these tokens may be drawn (vLLM's)
    # Token sequences the output may not complete (vLLM's bad_words, each word tokenized by the
    # API): a sequence's last token is barred where the output's last tokens are the rest of it
    # (a sequence of one token: everywhere). The output's own tokens, as vLLM reads them.
    bad_words: tuple[tuple[int, ...], ...] = ()
    # vLLM's cache_salt: the prompt's page hashes start from this salt, so its prefix is found
    # in the caches (the device's, the KV tiers', the API's placement index) only by requests
    # that give the same salt (one tenant's prompts kept from another's timing). Not sampling,
    # but the parameters every worker that hashes the prompt receives.
    cache_salt: str | None = None
    # Scheduling, not sampling, but it goes wherever the request is scheduled (prefill, decode,
    # unified): lower values first (vLLM's ``priority``), ties by arrival; 0 is the default.
    priority: int = 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # xgrammar's structural tag (a JSON text, {"type": "structural_tag", "format": ...}): free text
    # with tagged parts constrained, as vLLM and SGLang take it for tool calls
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        _require(self.max_new_tokens >= 1, "max_new_tokens must be at least 1")
        _require(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens must be between 0 and max_new_tokens")
        _require(0.0 <= self.temperature <= 100.0, "temperature must be between 0 and 100")
        _require(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        _require(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]")
        _require(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be between -2 and 2")
        _require(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be between -2 and 2")
        _require(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]")
        _require(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        _require(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
            f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}",
        )
        _require(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings")
        _require(all(s for s in self.stop), "stop strings must not be empty")
        _require(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative")
        _require(len(self.stop_regex) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop_regex patterns")
        for pattern in self.stop_regex:
            _require(
                isinstance(pattern, str) and 1 <= len(pattern) <= MAX_STOP_REGEX,
                f"each stop_regex must be 1 to {MAX_STOP_REGEX} characters",
            )
            compiled = stop_pattern(pattern)
            _require(compiled is not None, f"stop_regex {pattern!r} is not a valid regular expression")
            _require(
                compiled is not None and compiled.fullmatch("") is None,
                f"stop_regex {pattern!r} matches the empty text",
            )
        _require(self.seed is None or 0 <= self.seed < 2**63, "seed must be a non-negative 64-bit integer")
        _require(1 <= self.n <= MAX_SAMPLES, f"n must be between 1 and {MAX_SAMPLES}")
        _require(all(t >= 0 for t in self.allowed_token_ids), "allowed_token_ids must be non-negative")
        _require(
            self.cache_salt is None or 1 <= len(self.cache_salt) <= MAX_CACHE_SALT,
            f"cache_salt must be 1 to {MAX_CACHE_SALT} characters",
        )
        _require(
            isinstance(self.priority, int)
            and not isinstance(self.priority, bool)
            and abs(self.priority) <= MAX_PRIORITY,
            f"priority must be an integer from -{MAX_PRIORITY} to {MAX_PRIORITY}",
        )
        _require(len(self.bad_words) <= MAX_BAD_WORDS, f"bad_words may hold at most {MAX_BAD_WORDS} token sequences")
        _require(
            all(1 <= len(w) <= MAX_BAD_WORD_TOKENS and min(w) >= 0 for w in self.bad_words),
            f"each of bad_words must be 1 to {MAX_BAD_WORD_TOKENS} non-negative token ids",
        )
        bias = self.logit_bias or {}
        _require(len(bias) <= MAX_LOGIT_BIAS, f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries")
        _require(all(k.isdigit() for k in bias), "logit_bias keys must be token ids (non-negative integers)")
        _require(all(-100.0 <= v <= 100.0 for v in bias.values()), "logit_bias values must be between -100 and 100")
        constraints = [c for c in (self.json_schema, self.regex, self.ebnf, self.structural_tag) if c is not None]
        _require(len(constraints) <= 1, "give at most one of json_schema, regex, ebnf and structural_tag")
        _require(not (constraints and self.min_new_tokens), "min_new_tokens does not go with structured output")
        _require(all(constraints), "a constraint must not be empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def page_root(self) -> bytes | None:
        """Where the prompt's page-hash chain starts: :func:`~.kv_events.salt_root` of
        ``cache_salt`` (``None``: the chain every unsalted prompt shares)."""
        return salt_root(self.cache_salt)

    @property
    def reads_history(self) -> bool:
        """Whether a token's draw reads the output before it: penalties, or a bad word of more
        than one token (such a row's tokens are on the host before its next draw)."""
        return self.has_penalties or any(len(w) > 1 for w in self.bad_words)

    @property
    def has_bias(self) -> bool:
        return bool(self.logit_bias)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """``(kind, spec)`` of the structured-output constraint: ``json_schema``, ``regex``
        ``ebnf`` or ``structural_tag``; ``None`` when the output is free."""
        for kind in ("json_schema", "regex", "ebnf", "structural_tag"):
            spec = getattr(self, kind)
            if spec is not None:
                return kind, spec
        return None

    def bias_items(self) -> list[tuple[int, float]]:
        return [(int(k), v) for k, v in (self.logit_bias or {}).items()]

    def for_sample(self, index: int) -> SamplingParams:
        """What sample ``index`` of an ``n > 1`` request draws with: ``n`` of 1, and with a
        ``seed``, ``seed + index`` (so sample 0 of a seeded request equals that request with
        ``n`` of 1, and a sample moved to another worker alone continues exactly)."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return dataclasses.replace(self, n=1, seed=seed)


def sample_rid(rid: str, index: int) -> str:
    """The request id that sample ``index`` of an ``n > 1`` request ``rid`` streams under."""
    return f"{rid}#{index}"


@functools.lru_cache(maxsize=256)
def stop_pattern(pattern: str) -> regex.Pattern[str] | None:
    """``pattern`` compiled (``None`` where it is not a regular expression), once a process."""
    try:
        return regex.compile(pattern)
    except (regex.error, ValueError, OverflowError, RecursionError):
        return None


# Seconds a stop_regex may search one text (a pattern that backtracks without end, such as
# ``(a|aa)+$x``, would otherwise hold a worker's engine thread or the API's event loop): past
# it ``TimeoutError``, and the caller gives that pattern up for the request, counted
STOP_REGEX_TIMEOUT = 0.01


def stop_match(
    pattern: regex.Pattern[str], text: str, partial: bool = False, timeout: float = STOP_REGEX_TIMEOUT
) -> regex.Match[str] | None:
    """The first match of ``pattern`` in ``text`` that is not empty (a zero-width assertion's
    is no stop); with ``partial``, one that the text's end may still complete counts too.
    ``TimeoutError`` after ``timeout`` seconds."""
    for m in pattern.finditer(text, partial=partial, timeout=timeout):
        if m.end() > m.start() or m.partial:
            return m
    return None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
