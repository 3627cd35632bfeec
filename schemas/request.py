"""``GenerateRequest``: the API (or any direct publisher) asks for a completion."""

from __future__ import annotations

import dataclasses

from pdserve.schemas.codec import Message
from pdserve.schemas.sampling import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateRequest(Message):
    """One generation request, published to ``pd.req.<model>`` with ``Nats-Msg-Id = rid``.

    ``reply_to`` is the core-NATS subject that receives the ``TokenChunk`` stream.
    ``batch_to`` (optional) is a subject of the same receiver that takes ``TokenBatch``es:
    a worker may send this request's token chunks there, together with other requests'
    chunks of the same step, instead of one message each to ``reply_to``.
    ``output_ids`` holds tokens already streamed when a stalled request is resumed;
    the worker continues after them and numbers its chunks from ``len(output_ids)``.
    ``deadline`` is a Unix time after which the request is dropped (0: none).
    ``published_at`` is the publisher's Unix time, for queueing-delay figures and to tell
    a request from an earlier one of the same ``rid`` that was cancelled.
    ``attempt`` counts migrations: the API resubmits a request whose worker died, stalled
    or handed it back as attempt ``n + 1`` carrying the tokens the client already has, and
    accepts chunks of the newest attempt only (earlier ones are cancelled).
    """

    rid: str
    model: str
    prompt_ids: tuple[int, ...]
    reply_to: str
    sampling: SamplingParams = SamplingParams()
    output_ids: tuple[int, ...] = ()
    deadline: float = 0.0
    published_at: float = 0.0
    attempt: int = 0
    batch_to: str = ""
    v: int = 1

    def __post_init__(self) -> None:
        if not self.rid:
            raise ValueError("rid must not be empty")
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if min(self.prompt_ids) < 0:
            raise ValueError("prompt_ids must be non-negative")
        if not self.reply_to:
            raise ValueError("reply_to must not be empty")
        if self.attempt < 0:
            raise ValueError("attempt must be non-negative")
