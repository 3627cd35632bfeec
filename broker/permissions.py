"""What each role may publish and subscribe to on the broker, derived from the wire contract.

Every channel of :mod:`pdserve.broker.contract` names the roles that send and receive on
it; a role gets the subjects of its channels and nothing else, so the permissions cannot
drift from the code that uses them:

- a core channel: senders publish its subject, receivers subscribe where they listen;
- a service (request/reply): senders publish its subject (the reply comes to their own
  inbox), receivers subscribe and may answer (``allow_responses``);
- a work channel: senders publish its stream's subjects (the stream's ack comes to their
  inbox); receivers ask their pull consumer for messages and acknowledge them;
- the registry bucket: senders put their keys; everyone reads it.

Every role also creates and reads pdserve's streams, consumers and bucket (whoever starts
first creates them; nothing may delete or purge them), reads its own inbox only
(``_INBOX.<user>.>``), and takes part in moving dead letters (the max-deliveries advisory,
reading and deleting the message, storing it in ``PD_DEAD``, answering its client on
``pd.tokens.>``). An API user's receiving subjects are scoped to its own API id: it
cannot read another API's replies.

A ``client`` (a direct publisher, ``docs/protocol.md``) is an API without the API's
housekeeping: it publishes requests and cancels, and reads its own inbox and its own
replies ``pd.tokens.<id>.*`` and ``pd.tokens.<id>``; it creates no stream and moves no
dead letter.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from pdserve.broker import contract, subjects

COLOCATED = "colocated"  # `pdserve colocated`: a prefill and a decode worker in one process
WORKER_ROLES = ("prefill", "decode", "unified", COLOCATED)
CLIENT = "client"
ROLES = ("api", CLIENT, *WORKER_ROLES)

_SCOPE = "PDSCOPE"  # stands for one subject token while a pattern is built


@dataclasses.dataclass(frozen=True)
class Rights:
    """Subjects a user may publish and subscribe to (NATS wildcards allowed)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False

    def conf(self) -> dict[str, Any]:
        """The ``permissions`` of a user entry in the server's configuration."""
        perms: dict[str, Any] = {
            "publish": {"allow": list(self.publish)},
            "subscribe": {"allow": list(self.subscribe)},
        }
        if self.allow_responses:
            perms["allow_responses"] = True
        return {"permissions": perms}


def pattern(build: Callable[..., str], *scope: str) -> str:
    """The subject pattern of everything ``build`` makes: each argument not given in
    ``scope`` becomes a ``*`` wildcard (the whole subject token it lands in: NATS has no
    partial-token wildcards, so ``prefill-<model>`` becomes ``*``)."""
    count = len(inspect.signature(build).parameters)
    args = [*scope[:count], *[_SCOPE] * (count - len(scope))]
    return ".".join("*" if _SCOPE in part else part for part in build(*args).split("."))


def for_role(role: str, identity: str | None = None) -> Rights:
    """The rights of ``role``; ``identity`` (an API's or a client's id, which a client
    must have) scopes what it receives."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {ROLES}")
    if role == CLIENT and not identity:
        raise ValueError("a client's rights need its id (its replies are pd.tokens.<id>.*)")
    if role == COLOCATED:  # what its prefill worker and its decode worker may each do
        halves = [for_role("prefill"), for_role("decode")]
        inbox = [f"{subjects.inbox_prefix(COLOCATED)}.>"]
        theirs = {f"{subjects.inbox_prefix(half)}.>" for half in ("prefill", "decode")}
        return Rights(
            tuple(dict.fromkeys(s for r in halves for s in r.publish)),
            tuple(dict.fromkeys([*inbox, *(s for r in halves for s in r.subscribe if s not in theirs)])),
            any(r.allow_responses for r in halves),
        )
    scope = (identity,) if identity else ()
    pub: list[str] = []
    sub: list[str] = [f"{subjects.inbox_prefix(identity or role)}.>"]
    responds = False
    for channel in contract.CHANNELS:
        sends, receives = role in channel.senders, role in channel.receivers
        if isinstance(channel, contract.Channel):
            pub += [pattern(channel.subject)] if sends else []
            sub += [pattern(channel.listen, *(scope if channel.per_receiver else ()))] if receives else []
        elif isinstance(channel, contract.Service):
            pub += [pattern(channel.subject)] if sends else []
            sub += [pattern(channel.listen)] if receives else []
            responds = responds or receives
        elif isinstance(channel, contract.WorkChannel):
            pub += [pattern(channel.subject)] if sends else []
            if receives:
                stream = channel.stream
                pub += [pattern(subjects.pull_next, stream), f"$JS.ACK.{stream}.>"]
        elif isinstance(channel, contract.Bucket):
            pub += [f"{subjects.bucket_key_prefix(channel.bucket)}*"] if sends else []
    if role != CLIENT:
        pub += _jetstream_admin() + _dead_letters_publish()
        sub += _dead_letters_subscribe()
    return Rights(tuple(dict.fromkeys(pub)), tuple(dict.fromkeys(sub)), responds)


def everything() -> Rights:
    """Every subject: the embedded server's ``admin`` user (operators, test harnesses)."""
    return Rights((">",), (">",), allow_responses=False)


def _work_channels() -> list[contract.WorkChannel[Any]]:
    return [c for c in contract.CHANNELS if isinstance(c, contract.WorkChannel)]


def _jetstream_admin() -> list[str]:
    """Create, update and read pdserve's streams, consumers and bucket; read messages of
    the work streams and the bucket. No delete or purge of a stream or consumer."""
    buckets = [subjects.bucket_stream(c.bucket) for c in contract.CHANNELS if isinstance(c, contract.Bucket)]
    work = [c.stream for c in _work_channels()]
    streams = [*work, subjects.DEAD_STREAM, *buckets]
    rights = ["$JS.API.INFO"]
    for stream in streams:
        rights += [f"$JS.API.STREAM.{action}.{stream}" for action in ("CREATE", "UPDATE", "INFO")]
    for stream in [*work, *buckets]:
        rights += [f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>"]
    for stream in work:
        rights += [
            f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.*",
            f"$JS.API.CONSUMER.INFO.{stream}.*",
        ]
    return rights


def _dead_letters_publish() -> list[str]:
    """Move a dead letter (:mod:`pdserve.broker.deadletter`): delete it from its work
    stream, store it in ``PD_DEAD``, answer its client."""
    rights = [f"$JS.API.STREAM.MSG.DELETE.{c.stream}" for c in _work_channels()]
    return [*rights, subjects.DEAD_SUBJECTS, pattern(contract.TOKENS.subject)]


def _dead_letters_subscribe() -> list[str]:
    return [pattern(subjects.max_deliveries_advisory, c.stream) for c in _work_channels()]
