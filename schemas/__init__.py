"""Every message that crosses a process boundary: versioned frozen dataclasses, orjson-encoded."""

from pdserve.schemas.codec import Message, MessageError, UnsupportedVersion
from pdserve.schemas.control import Cancel, FlushCache, FlushCacheReply
from pdserve.schemas.kv import KVHandle, KVLayout, KVLease, KVLeaseReply, KVReady, KVRelease
from pdserve.schemas.kv_events import KVEvents, PlacementClaim
from pdserve.schemas.link import KVLink, KVLinkReply, KVPush, KVPushReply
from pdserve.schemas.request import GenerateRequest
from pdserve.schemas.sampling import SamplingParams
from pdserve.schemas.tokens import ErrorInfo, PromptLogprobs, TokenBatch, TokenChunk, TokenLogprob, Usage
from pdserve.schemas.worker import TierCounts, WorkerCounters, WorkerInfo, WorkerStats

__all__ = [
    "Cancel",
    "ErrorInfo",
    "FlushCache",
    "FlushCacheReply",
    "GenerateRequest",
    "KVEvents",
    "KVHandle",
    "KVLayout",
    "KVLease",
    "KVLeaseReply",
    "KVLink",
    "KVLinkReply",
    "KVPush",
    "KVPushReply",
    "KVReady",
    "KVRelease",
    "Message",
    "MessageError",
    "PlacementClaim",
    "PromptLogprobs",
    "SamplingParams",
    "TierCounts",
    "TokenBatch",
    "TokenChunk",
    "TokenLogprob",
    "UnsupportedVersion",
    "Usage",
    "WorkerCounters",
    "WorkerInfo",
    "WorkerStats",
]
