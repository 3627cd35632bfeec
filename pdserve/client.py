"""A small client that talks to pdserve's workers over NATS alone, with no HTTP API.

    from pdserve.client import Client

    async with await Client.connect("nats://127.0.0.1:4222", "my-model", tokenizer="/models/x") as client:
        async for piece in client.stream("Hello", max_new_tokens=32, temperature=0):
            print(piece.text, end="", flush=True)
        done = await client.generate([1, 2, 3], max_new_tokens=8)   # token ids in, all at once

    text = generate("Hello", nats_url=..., model=..., tokenizer=...).text  # no asyncio needed

It speaks the protocol of ``docs/protocol.md`` exactly as any other publisher must: it
publishes ``GenerateRequest`` to ``pd.req.<model>`` (``Nats-Msg-Id`` = request id), reads
``TokenChunk``s at ``pd.tokens.<client-id>.<rid>`` and ``TokenBatch``es at
``pd.tokens.<client-id>``, puts chunks in ``seq`` order without duplicates, and, like the
HTTP API, moves a request to another worker when its worker hands it back, fails it with a
retryable error or goes silent (a new attempt carrying the tokens already received). On a
timeout, on :meth:`Client.cancel`, and when the caller stops reading a stream, it publishes
``Cancel``. With the embedded broker's users on, connect as a user made with
``pdserve up --nats-client NAME``: the client id is then the user's name.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, cast

from nats.aio.client import Client as Nats
from nats.aio.subscription import Subscription

from pdserve.api.detokenizer import IncrementalDetokenizer, StopMatcher
from pdserve.api.token_stream import TokenStream
from pdserve.broker import contract, queues
from pdserve.broker.auth import NatsAuth
from pdserve.broker.connection import QueueFullError, connect
from pdserve.schemas import (
    Cancel,
    ErrorInfo,
    GenerateRequest,
    SamplingParams,
    TokenBatch,
    TokenChunk,
    TokenLogprob,
    Usage,
)

WATCH_SECONDS = 0.2


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class RequestError(RuntimeError):
    """The request failed: ``type`` and ``code`` are the error chunk's (OpenAI-style
    ``invalid_request_error``/``server_error``/``timeout``; ``malformed_message``,
    ``unsupported_version``...)."""

    def __init__(self, message: str, type: str = "server_error", code: str | None = None) -> None:
        super().__init__(message)
        self.type = type
        self.code = code


class RequestTimeout(RequestError, TimeoutError):
    """The request's ``timeout`` passed before its last token; it has been cancelled."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "timeout")


class DuplicateRequest(RequestError):
    """The request id is in use by this client, or the stream saw it within its dedup window."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "invalid_request_error", "duplicate_request_id")


@dataclass(frozen=True)
class Piece:
    """What arrived for a request since the last piece: consecutive tokens and their text
    (``""`` without a tokenizer; text cut before a stop string). The last piece has a
    ``finish_reason`` (``stop``, ``length``, ``abort``) and ``usage``."""

    rid: str
    token_ids: tuple[int, ...]
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    attempt: int = 0  # 0 unless the request moved to another worker on the way


@dataclass(frozen=True)
class Completion:
    """A whole answer: every token, the text (with a tokenizer), why it ended, and usage."""

    rid: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    stop_reason: str | int | None
    usage: Usage | None
    attempts: int = 1


@dataclass
class _Live:
    request: GenerateRequest
    stream: TokenStream
    deadline: float  # monotonic
    migrating: bool = False


class Client:
    """One connection to NATS and the subscriptions for this client's replies. Make it with
    :meth:`connect`; close it with :meth:`close` (or ``async with``). Not thread-safe."""

    def __init__(
        self,
        nc: Nats,
        model: str,
        client_id: str,
        tokenizer: Tokenizer | None = None,
        stall_timeout: float = 10.0,
        gap_timeout: float = 1.0,
        max_migrations: int = 3,
        own_connection: bool = True,
    ) -> None:
        self.nc = nc
        self.model = model
        self.client_id = client_id
        self.tokenizer = tokenizer
        self.stall_timeout = stall_timeout
        self.gap_timeout = gap_timeout
        self.max_migrations = max_migrations
        self._own_connection = own_connection
        self._live: dict[str, _Live] = {}
        self._subs: list[Subscription] = []
        self._background: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(
        cls,
        nats_url: str,
        model: str,
        *,
        user: str | None = None,
        password: str | None = None,
        auth: NatsAuth | None = None,
        client_id: str | None = None,
        tokenizer: Tokenizer | str | Path | None = None,
        **options: Any,
    ) -> Client:
        """Connect to ``nats_url`` (as ``user``/``password``, or as ``auth`` says) and listen
        for replies. ``client_id`` names the reply subjects ``pd.tokens.<client_id>.*``;
        it defaults to the user's name (what the broker's permissions expect) or a random
        ``client-<hex>``. ``tokenizer`` (a model directory or a tokenizer object) lets
        :meth:`stream` take text and give text. ``options``: ``stall_timeout``,
        ``gap_timeout``, ``max_migrations``."""
        if auth is None and user is not None:
            auth = NatsAuth(user=user, password=password)
        client_id = client_id or (auth.user if auth and auth.user else None) or f"client-{uuid.uuid4().hex[:8]}"
        if isinstance(tokenizer, (str, Path)):
            tokenizer = _load_tokenizer(tokenizer)
        nc = await connect(nats_url, client_id, auth)
        client = cls(nc, model, client_id, tokenizer, **options)
        await client.start()
        return client

    async def start(self) -> None:
        self._subs = [
            await contract.subscribe(self.nc, contract.TOKENS, self._on_chunk, self.client_id),
            await contract.subscribe(self.nc, contract.TOKEN_BATCHES, self._on_batch, self.client_id),
        ]

    async def close(self) -> None:
        """Cancel what is still running, then drain (or leave) the connection."""
        for rid in list(self._live):
            await self.cancel(rid, "client closed")
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for sub in self._subs:
            await sub.unsubscribe()
        if self._own_connection and not self.nc.is_closed:
            await self.nc.drain()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- requests ------------------------------------------------------------------
    async def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> Completion:
        """The whole answer to ``prompt`` (see :meth:`stream` for the arguments)."""
        pieces = [piece async for piece in self.stream(prompt, **kwargs)]
        last = pieces[-1]
        assert last.finish_reason is not None
        return Completion(
            rid=last.rid,
            token_ids=tuple(t for p in pieces for t in p.token_ids),
            text="".join(p.text for p in pieces),
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            usage=last.usage,
            attempts=last.attempt + 1,
        )

    async def stream(
        self,
        prompt: str | Sequence[int],
        *,
        rid: str | None = None,
        timeout: float = 600.0,
        sampling: SamplingParams | None = None,
        add_special_tokens: bool = True,
        **sampling_fields: Any,
    ) -> AsyncIterator[Piece]:
        """Publish one request and yield :class:`Piece`\\ s as tokens arrive, the last one
        with a ``finish_reason``.

        ``prompt`` is text (needs a tokenizer) or token ids. Sampling is ``sampling`` or
        the :class:`SamplingParams` fields given by name (``max_new_tokens=16``,
        ``temperature=0``...). ``timeout`` bounds the whole request: it is the request's
        deadline for the workers too. Raises :class:`QueueFullError` (nothing was stored:
        retry later), :class:`DuplicateRequest`, :class:`RequestTimeout` and
        :class:`RequestError`. Stopping early (``break``, cancelling the task) publishes
        ``Cancel``."""
        sampling = replace(sampling or SamplingParams(), **sampling_fields)
        prompt_ids = self._encode(prompt, add_special_tokens)
        rid = rid or uuid.uuid4().hex
        if rid in self._live:
            raise DuplicateRequest(f"request id {rid!r} is in use")
        now = time.time()
        request = GenerateRequest(
            rid=rid,
            model=self.model,
            prompt_ids=prompt_ids,
            reply_to=contract.TOKENS.subject(self.client_id, rid),
            batch_to=contract.TOKEN_BATCHES.subject(self.client_id),
            sampling=sampling,
            deadline=now + timeout,
            published_at=now,
        )
        live = _Live(request, TokenStream(rid, heard_at=time.monotonic()), time.monotonic() + timeout)
        self._live[rid] = live
        finished = False
        text = _Text(self.tokenizer, sampling.stop)
        try:
            try:
                stored = await queues.submit(self.nc, contract.request_channel(request), request, self.model, rid)
            except QueueFullError:
                finished = True  # refused: nothing to cancel (any other failure may hide a stored request)
                raise
            if not stored:
                finished = True
                raise DuplicateRequest(f"request id {rid!r} was submitted within the stream's dedup window")
            while True:
                chunk = await self._next(live)
                if chunk.error is not None:
                    finished = True
                    if chunk.error.type == "timeout":
                        raise RequestTimeout(chunk.error.message)
                    raise RequestError(chunk.error.message, chunk.error.type, chunk.error.code)
                finished = chunk.finish_reason is not None
                piece = Piece(
                    rid=rid,
                    token_ids=chunk.token_ids,
                    text=text.add(chunk.token_ids, finished),
                    finish_reason=chunk.finish_reason,
                    stop_reason=chunk.stop_reason,
                    usage=chunk.usage,
                    logprobs=chunk.logprobs,
                    attempt=chunk.attempt,
                )
                if finished:
                    self._live.pop(rid, None)
                yield piece
                if finished:
                    return
        finally:
            if self._live.get(rid) is live:
                del self._live[rid]
            if not finished:
                # A task of its own: the caller may be closing this generator from a
                # cancelled task, where an await here would be cancelled too.
                self._spawn(
                    self._publish_cancel(Cancel(rid=rid, reason="client stopped reading", issued_at=time.time()))
                )

    async def cancel(self, rid: str, reason: str = "cancelled by the client") -> None:
        """Stop every attempt of ``rid``: workers drop it and free its pages; its stream
        ends with ``finish_reason="abort"``."""
        live = self._live.get(rid)
        await self._publish_cancel(Cancel(rid=rid, reason=reason, issued_at=time.time()))
        if live is not None:
            stream = live.stream
            live.stream.queue.put_nowait(
                TokenChunk(rid=rid, seq=stream.next_seq, finish_reason="abort", attempt=stream.attempt)
            )

    # ---- inside --------------------------------------------------------------------
    async def _next(self, live: _Live) -> TokenChunk:
        """The next chunk to hand out (merged with whatever queued behind it), migrating the
        request when its worker is lost and raising :class:`RequestTimeout` past its deadline."""
        stream = live.stream
        while True:
            chunk = stream.take()
            if chunk is not None:
                return chunk
            remaining = live.deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(f"request {live.request.rid} timed out")
            try:
                async with asyncio.timeout(min(remaining, WATCH_SECONDS)):  # wait_for (3.11) can drop a cancel
                    first = await stream.queue.get()
            except TimeoutError:
                reason = stream.expired(time.monotonic(), self.stall_timeout, self.gap_timeout)
                if reason is not None:
                    await self._migrate(live, reason)
                continue
            merged = stream.take(first)
            assert merged is not None
            return merged

    async def _on_chunk(self, chunk: TokenChunk) -> None:
        live = self._live.get(chunk.rid)
        if live is None:
            return
        reason = live.stream.deliver(chunk, time.monotonic())
        if reason is not None:
            self._spawn(self._migrate(live, reason))

    async def _on_batch(self, batch: TokenBatch) -> None:
        for chunk in batch.chunks:
            await self._on_chunk(chunk)

    async def _migrate(self, live: _Live, reason: str) -> None:
        """Attempt ``n + 1`` from the tokens received so far (earlier attempts cancelled),
        or an error once the request has moved ``max_migrations`` times."""
        stream, rid = live.stream, live.request.rid
        if self._live.get(rid) is not live or live.migrating:
            return
        if stream.attempt >= self.max_migrations:
            error = f"request lost its worker {stream.attempt + 1} times; giving up (last: {reason})"
            stream.queue.put_nowait(_error_chunk(rid, stream, error))
            live.migrating = True  # for good
            return
        live.migrating = True
        try:
            attempt = stream.attempt + 1
            stream.restart(attempt, time.monotonic())
            output = tuple(stream.output_ids)
            if len(output) >= live.request.sampling.max_new_tokens:  # only the last chunk was lost
                usage = Usage(len(live.request.prompt_ids), len(output))
                stream.queue.put_nowait(
                    TokenChunk(rid=rid, seq=stream.next_seq, finish_reason="length", usage=usage, attempt=attempt)
                )
                return
            now = time.time()
            await self._publish_cancel(Cancel(rid=rid, reason="superseded", attempt=attempt, issued_at=now))
            request = replace(live.request, output_ids=output, published_at=now, attempt=attempt)
            await queues.submit(self.nc, contract.request_channel(request), request, self.model, rid, attempt)
        except Exception as exc:
            stream.queue.put_nowait(_error_chunk(rid, stream, f"could not resubmit after '{reason}': {exc}"))
        finally:
            live.migrating = False

    async def _publish_cancel(self, cancel: Cancel) -> None:
        if self.nc.is_connected:
            await contract.publish(self.nc, contract.CANCEL, cancel)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _encode(self, prompt: str | Sequence[int], add_special_tokens: bool) -> tuple[int, ...]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (Client.connect(..., tokenizer=...))")
            return tuple(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        return tuple(int(t) for t in prompt)


class _Text:
    """Token ids to text as they arrive: incremental detokenization, cut before a stop string."""

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop = StopMatcher(stop)

    def add(self, token_ids: Sequence[int], last: bool) -> str:
        if self._detokenizer is None:
            return ""
        text = self._stop.feed(self._detokenizer.add(token_ids))
        if last:
            text += self._stop.feed(self._detokenizer.flush()) + self._stop.flush()
        return text


def _error_chunk(rid: str, stream: TokenStream, message: str) -> TokenChunk:
    return TokenChunk(
        rid=rid, seq=stream.next_seq, finish_reason="error", error=ErrorInfo(message), attempt=stream.attempt
    )


def _load_tokenizer(path: str | Path) -> Tokenizer:
    from transformers import AutoTokenizer

    return cast(Tokenizer, AutoTokenizer.from_pretrained(str(path)))


def generate(
    prompt: str | Sequence[int],
    *,
    nats_url: str,
    model: str,
    user: str | None = None,
    password: str | None = None,
    auth: NatsAuth | None = None,
    tokenizer: Tokenizer | str | Path | None = None,
    **kwargs: Any,
) -> Completion:
    """One request, start to end, from synchronous code: connects, generates, closes.
    ``kwargs`` are :meth:`Client.stream`'s (``timeout``, ``max_new_tokens``...)."""

    async def run() -> Completion:
        client = await Client.connect(nats_url, model, user=user, password=password, auth=auth, tokenizer=tokenizer)
        async with client:
            return await client.generate(prompt, **kwargs)

    return asyncio.run(run())


__all__ = [
    "Client",
    "Completion",
    "DuplicateRequest",
    "Piece",
    "QueueFullError",
    "RequestError",
    "RequestTimeout",
    "generate",
]
