"""Every message that crosses a process boundary: versioned frozen dataclasses, orjson-encoded."""

from schemas.codec import Message, MessageError
from schemas.control import Cancel
from schemas.kv import KVHandle, KVLayout, KVReady, KVRelease
from schemas.request import GenerateRequest
from schemas.sampling import SamplingParams
from schemas.tokens import ErrorInfo, TokenChunk, TokenLogprob, Usage
from schemas.worker import WorkerInfo

__all__ = [
    "Cancel",
    "ErrorInfo",
    "GenerateRequest",
    "KVHandle",
    "KVLayout",
    "KVReady",
    "KVRelease",
    "Message",
    "MessageError",
    "SamplingParams",
    "TokenChunk",
    "TokenLogprob",
    "Usage",
    "WorkerInfo",
]
