"""Wire messages: encode/decode round trips and strict, readable rejection of bad payloads."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import orjson
import pytest

from pdserve.schemas import (
    Cancel,
    ErrorInfo,
    GenerateRequest,
    KVHandle,
    KVLayout,
    KVLease,
    KVLeaseReply,
    KVLink,
    KVLinkReply,
    KVPush,
    KVPushReply,
    KVReady,
    KVRelease,
    Message,
    MessageError,
    SamplingParams,
    TokenBatch,
    TokenChunk,
    TokenLogprob,
    Usage,
    WorkerCounters,
    WorkerInfo,
)

FULL_SAMPLING = SamplingParams(
    max_new_tokens=32,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=1234,
    stop=("\n\n", "END"),
    stop_token_ids=(2, 7),
    ignore_eos=True,
    frequency_penalty=0.5,
    presence_penalty=-0.5,
    repetition_penalty=1.1,
    logprobs=True,
    top_logprobs=5,
)

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16")

HANDLE = KVHandle(
    backend="mooncake",
    endpoint="10.0.0.1:12345",
    layout=LAYOUT,
    segments=((140000000000, 4 * 65536), (140000900000, 65536)),
    num_tokens=70,
    expires_at=1700000000.5,
)


def _generate(**overrides: Any) -> GenerateRequest:
    fields: dict[str, Any] = {
        "rid": "req-1",
        "model": "tiny",
        "prompt_ids": (1, 2, 3),
        "reply_to": "_INBOX.abc",
        "sampling": FULL_SAMPLING,
        "output_ids": (9, 8),
        "deadline": 1700000100.25,
        "published_at": 1700000000.0,
    }
    fields.update(overrides)
    return GenerateRequest(**fields)


MESSAGES: list[Message] = [
    _generate(),
    GenerateRequest(rid="r", model="m", prompt_ids=(0,), reply_to="x"),  # all defaults
    KVReady(
        rid="req-2",
        model="tiny",
        prompt_ids=(5, 6, 7, 8),
        output_ids=(11,),
        reply_to="_INBOX.def",
        sampling=FULL_SAMPLING,
        prefill_id="prefill-0",
        handle=HANDLE,
        cached_tokens=16,
        deadline=1.5,
        published_at=2.5,
        request_published_at=3.5,
        timings={"queue": 0.01, "prefill": 0.25},
    ),
    TokenChunk(
        rid="req-3",
        seq=4,
        token_ids=(10, 11, 12),
        finish_reason="stop",
        stop_reason="END",
        usage=Usage(prompt_tokens=7, completion_tokens=7, cached_tokens=3),
        logprobs=(
            TokenLogprob(-0.5, (10, 3), (-0.5, -1.25)),
            TokenLogprob(-0.125),
            TokenLogprob(-2.0, (4,), (-0.75,)),
        ),
        worker_id="decode-1",
        timings={"transfer": 0.002},
    ),
    TokenChunk(rid="req-4", seq=0, finish_reason="stop", stop_reason=7),  # int stop reason
    TokenChunk(
        rid="req-5",
        seq=2,
        finish_reason="error",
        error=ErrorInfo("the KV pool is full", "server_error", "pool_exhausted"),
    ),
    TokenChunk(rid="req-6", seq=0, error=ErrorInfo("boom")),
    Cancel(rid="req-7"),
    Cancel(rid="req-8", reason="deadline"),
    KVRelease(rid="req-9", prefill_id="prefill-0"),
    KVRelease(rid="req-9", prefill_id="prefill-0", ok=False),
    WorkerInfo(
        worker_id="w1",
        role="decode",
        model="tiny",
        host="node-1",
        pid=4242,
        capacity=128,
        pages_total=1000,
        pages_used=17,
        page_size=16,
        requests_in_flight=3,
        transfer_endpoint="10.0.0.2:1",
        model_path="/models/tiny",
        started_at=100.0,
        updated_at=200.5,
    ),
    # Minor additions of issue 8: attempts, chunk states, leases, generations, counters.
    _generate(attempt=3),
    # Token batches: one message per engine step and receiver.
    _generate(batch_to="pd.tokens.api-1"),
    TokenBatch(
        (
            TokenChunk(rid="req-20", seq=3, token_ids=(9,), worker_id="decode-1"),
            TokenChunk(rid="req-21", seq=0, token_ids=(1, 2), finish_reason="length", usage=Usage(4, 2)),
        )
    ),
    TokenBatch(()),
    TokenChunk(rid="req-10", seq=5, worker_id="decode-1", attempt=2, state="alive"),
    TokenChunk(rid="req-11", seq=0, token_ids=(4,), state="queued"),
    Cancel(rid="req-12", reason="superseded", attempt=2, issued_at=1700000000.5),
    KVRelease(rid="req-13", prefill_id="prefill-0", generation=1234567),
    KVLease(rid="req-14", prefill_id="prefill-0", generation=1234567, seconds=10.0),
    KVLeaseReply(rid="req-14", granted=False, reason="another generation"),
    WorkerInfo(
        worker_id="w2",
        role="decode",
        model="tiny",
        host="node-1",
        pid=1,
        capacity=8,
        pages_total=10,
        pages_used=0,
        page_size=16,
        requests_in_flight=0,
        counters=WorkerCounters(kv_pulls=3, kv_pull_bytes=1 << 40, recomputes=1, migrations=2),
        kv_layout=LAYOUT,
        transfer_backend="mooncake",
        transfer_protocol="rdma",
    ),
    # Issue 11: the point-to-point link of the nccl and gloo backends.
    KVLink("decode-1", "prefill-0", "nccl", LAYOUT, 1 << 20, "cuda-GPU-0c3e"),
    KVLinkReply(granted=True, store="10.0.0.2:29500", prefix="decode-1/3", epoch=3),
    KVLinkReply(granted=False, reason="page size: prefill 16, decode 8"),
    KVPush("decode-1", "prefill-0", 3, ((1 << 40, 1 << 20), (5 << 40, 2 << 20))),
    KVPushReply(accepted=False, reason="no open link"),
    WorkerInfo(
        worker_id="w3",
        role="prefill",
        model="tiny",
        host="node-2",
        pid=2,
        capacity=8,
        pages_total=10,
        pages_used=0,
        page_size=16,
        requests_in_flight=0,
        counters=WorkerCounters(kv_sends=4, kv_send_bytes=1 << 30, kv_links_opened=1, kv_pull_ops=4),
        transfer_backend="nccl",
        transfer_protocol="nccl",
    ),
]


# ---- round trips -------------------------------------------------------------------


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    data = msg.encode()
    assert isinstance(data, bytes)
    back = type(msg).decode(data)
    assert back == msg
    assert type(back) is type(msg)
    # decoding from str works too, and re-encoding is stable
    assert type(msg).decode(data.decode()) == msg
    assert back.encode() == data


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_encoding_is_plain_json_with_version(msg: Message) -> None:
    raw = orjson.loads(msg.encode())
    assert raw["v"] == 1
    assert set(raw) == {f.name for f in dataclasses.fields(msg)}


def test_round_trip_keeps_nested_types() -> None:
    ready = next(m for m in MESSAGES if isinstance(m, KVReady))
    back = KVReady.decode(ready.encode())
    assert isinstance(back.handle, KVHandle)
    assert isinstance(back.handle.layout, KVLayout)
    assert back.handle.layout.page_numel == 4 * 2 * 16 * 2 * 64
    assert back.handle.segments == HANDLE.segments
    assert all(isinstance(s, tuple) for s in back.handle.segments)
    assert isinstance(back.sampling, SamplingParams)
    assert back.sampling.stop == ("\n\n", "END")
    assert isinstance(back.prompt_ids, tuple)

    chunk = next(m for m in MESSAGES if isinstance(m, TokenChunk) and m.logprobs)
    back_chunk = TokenChunk.decode(chunk.encode())
    assert isinstance(back_chunk.usage, Usage)
    assert back_chunk.logprobs is not None
    assert all(isinstance(lp, TokenLogprob) for lp in back_chunk.logprobs)
    assert back_chunk.logprobs[0].top_ids == (10, 3)


def test_int_accepted_for_float_fields() -> None:
    raw = orjson.loads(_generate().encode())
    raw["deadline"] = 5
    raw["sampling"]["temperature"] = 1
    req = GenerateRequest.decode(orjson.dumps(raw))
    assert req.deadline == 5.0 and isinstance(req.deadline, float)
    assert req.sampling.temperature == 1.0 and isinstance(req.sampling.temperature, float)


def test_unknown_fields_are_ignored() -> None:
    raw = orjson.loads(MESSAGES[2].encode())
    raw["new_optional_field"] = {"anything": [1, 2]}
    raw["handle"]["compression"] = "zstd"
    raw["handle"]["layout"]["kv_quant"] = None
    raw["sampling"]["future_knob"] = 3
    assert KVReady.decode(orjson.dumps(raw)) == MESSAGES[2]


def test_optional_fields_take_defaults() -> None:
    req = GenerateRequest.decode(b'{"v": 1, "rid": "r", "model": "m", "prompt_ids": [1], "reply_to": "x"}')
    assert req.sampling == SamplingParams()
    assert req.output_ids == ()
    assert req.deadline == 0.0
    chunk = TokenChunk.decode(b'{"v": 1, "rid": "r", "seq": 0}')
    assert chunk.usage is None and chunk.error is None and chunk.logprobs is None and chunk.token_ids == ()


def test_explicit_null_for_optional_fields() -> None:
    chunk = TokenChunk.decode(b'{"v":1,"rid":"r","seq":0,"usage":null,"error":null,"logprobs":null,"stop_reason":null}')
    assert chunk == TokenChunk(rid="r", seq=0)


# ---- rejection -----------------------------------------------------------------------


def _expect_error(cls: type[Message], data: bytes | str, *fragments: str) -> MessageError:
    with pytest.raises(MessageError) as info:
        cls.decode(data)
    text = str(info.value)
    assert text.startswith(cls.__name__), text
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"
    return info.value


def _mutated(msg: Message, path: tuple[str, ...], value: Any, delete: bool = False) -> bytes:
    raw = orjson.loads(msg.encode())
    node = raw
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return orjson.dumps(raw)


@pytest.mark.parametrize("data", [b"not json", b"{", b"", b"\xff\xfe", b"{'v': 1}"])
def test_rejects_non_json(data: bytes) -> None:
    _expect_error(GenerateRequest, data, "not JSON")


@pytest.mark.parametrize("data", [b"[]", b'[{"v": 1}]', b"1", b'"text"', b"null", b"true"])
def test_rejects_non_object(data: bytes) -> None:
    _expect_error(GenerateRequest, data, "expected a JSON object")


@pytest.mark.parametrize("version", [2, 0, "1", None, 1.5])
def test_rejects_wrong_version(version: Any) -> None:
    data = _mutated(_generate(), ("v",), version)
    _expect_error(GenerateRequest, data, "unsupported version", "expected 1")


def test_rejects_missing_version() -> None:
    _expect_error(Cancel, _mutated(Cancel(rid="x"), ("v",), None, delete=True), "unsupported version")


def test_rejects_bool_version() -> None:
    # True == 1 in Python, but a boolean is not a version number
    with pytest.raises(MessageError):
        Cancel.decode(b'{"v": true, "rid": "x"}')


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (_generate(), "rid"),
        (_generate(), "prompt_ids"),
        (_generate(), "reply_to"),
        (_generate(), "model"),
        (MESSAGES[2], "handle"),
        (MESSAGES[2], "prefill_id"),
        (MESSAGES[3], "seq"),
        (MESSAGES[-1], "pid"),
        (Cancel(rid="x"), "rid"),
        (KVRelease(rid="x", prefill_id="p"), "prefill_id"),
    ],
)
def test_rejects_missing_required_field(msg: Message, field: str) -> None:
    _expect_error(type(msg), _mutated(msg, (field,), None, delete=True), f"missing field {field!r}")


def test_rejects_missing_nested_field() -> None:
    data = _mutated(MESSAGES[2], ("handle", "layout", "page_size"), None, delete=True)
    _expect_error(KVReady, data, "KVReady.handle.layout", "missing field 'page_size'")


@pytest.mark.parametrize(
    ("msg", "path", "value", "fragment"),
    [
        # string where int
        (MESSAGES[3], ("seq",), "4", "TokenChunk.seq: expected an integer"),
        (MESSAGES[-1], ("pid",), "4242", "WorkerInfo.pid: expected an integer"),
        (
            _generate(),
            ("sampling", "max_new_tokens"),
            "32",
            "GenerateRequest.sampling.max_new_tokens: expected an integer",
        ),
        # bool where int
        (MESSAGES[3], ("seq",), True, "TokenChunk.seq: expected an integer"),
        (_generate(), ("sampling", "top_k"), False, "sampling.top_k: expected an integer"),
        # float where int
        (MESSAGES[3], ("seq",), 4.0, "TokenChunk.seq: expected an integer"),
        # float (and others) where int list
        (_generate(), ("prompt_ids",), [1.5, 2.0], "GenerateRequest.prompt_ids[0]: expected an integer"),
        (_generate(), ("prompt_ids",), [1, 2, 3.0], "GenerateRequest.prompt_ids[2]: expected an integer"),
        (_generate(), ("prompt_ids",), [1, True], "GenerateRequest.prompt_ids[1]: expected an integer"),
        (_generate(), ("prompt_ids",), "1 2 3", "GenerateRequest.prompt_ids: expected a list"),
        (_generate(), ("prompt_ids",), {"0": 1}, "GenerateRequest.prompt_ids: expected a list"),
        # int where string
        (_generate(), ("rid",), 17, "GenerateRequest.rid: expected a string"),
        (_generate(), ("sampling", "stop"), ["ok", 3], "sampling.stop[1]: expected a string"),
        # wrong number / bool types
        (_generate(), ("deadline",), "soon", "GenerateRequest.deadline: expected a number"),
        (_generate(), ("deadline",), True, "GenerateRequest.deadline: expected a number"),
        (_generate(), ("sampling", "ignore_eos"), 1, "sampling.ignore_eos: expected a boolean"),
        (KVRelease(rid="r", prefill_id="p"), ("ok",), "yes", "KVRelease.ok: expected a boolean"),
        # nested objects
        (_generate(), ("sampling",), [1, 2], "GenerateRequest.sampling: expected an object"),
        (_generate(), ("sampling",), "greedy", "GenerateRequest.sampling: expected an object"),
        (MESSAGES[2], ("handle", "layout"), None, "KVReady.handle.layout: expected an object"),
        (MESSAGES[2], ("handle", "segments"), [[1, 2], "x"], "KVReady.handle.segments[1]: expected a list"),
        (MESSAGES[2], ("handle", "segments"), [[1, 2.5]], "KVReady.handle.segments[0][1]: expected an integer"),
        (MESSAGES[2], ("timings",), {"queue": "fast"}, "KVReady.timings.queue: expected a number"),
        (MESSAGES[2], ("timings",), [0.1], "KVReady.timings: expected an object"),
        (MESSAGES[3], ("usage",), "none", "TokenChunk.usage: expected an object"),
        (MESSAGES[3], ("logprobs",), [{"logprob": "x"}], "TokenChunk.logprobs[0].logprob: expected a number"),
        (MESSAGES[3], ("stop_reason",), 1.5, "TokenChunk.stop_reason"),
        (MESSAGES[3], ("stop_reason",), [1], "TokenChunk.stop_reason"),
    ],
)
def test_rejects_wrong_types(msg: Message, path: tuple[str, ...], value: Any, fragment: str) -> None:
    _expect_error(type(msg), _mutated(msg, path, value), fragment)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("max_new_tokens", 0, "max_new_tokens must be at least 1"),
        ("max_new_tokens", -5, "max_new_tokens must be at least 1"),
        ("top_p", 0, "top_p must be in (0, 1]"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("temperature", -0.1, "temperature must be between 0 and 100"),
        ("temperature", 101, "temperature must be between 0 and 100"),
        ("top_logprobs", 21, "top_logprobs must be between 0 and 20"),
        ("top_logprobs", -1, "top_logprobs must be between 0 and 20"),
        ("stop", ["ok", ""], "stop strings must not be empty"),
        ("stop", ["s"] * 17, "at most 16 stop strings"),
        ("min_p", 1.5, "min_p must be in [0, 1]"),
        ("frequency_penalty", 2.5, "frequency_penalty"),
        ("presence_penalty", -3, "presence_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("stop_token_ids", [3, -1], "stop_token_ids must be non-negative"),
        ("seed", -1, "seed must be a non-negative 64-bit integer"),
    ],
)
def test_rejects_invalid_sampling_values(key: str, value: Any, fragment: str) -> None:
    err = _expect_error(GenerateRequest, _mutated(_generate(), ("sampling", key), value), fragment)
    assert "GenerateRequest.sampling" in str(err)
    # the same values are rejected on construction
    with pytest.raises(ValueError, match=re.escape(fragment)):
        SamplingParams(**{key: tuple(value) if isinstance(value, list) else value})


def test_rejects_invalid_sampling_in_kv_ready() -> None:
    _expect_error(KVReady, _mutated(MESSAGES[2], ("sampling", "top_p"), 0.0), "KVReady.sampling", "top_p")


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("rid", "", "rid must not be empty"),
        ("prompt_ids", [], "prompt_ids must not be empty"),
        ("prompt_ids", [1, -2], "prompt_ids must be non-negative"),
        ("reply_to", "", "reply_to must not be empty"),
    ],
)
def test_rejects_invalid_generate_request_values(field: str, value: Any, fragment: str) -> None:
    _expect_error(GenerateRequest, _mutated(_generate(), (field,), value), fragment)


@pytest.mark.parametrize("segments", [[[1, 0]], [[1, 2, 3]], [[1]], [[1, -4096]]])
def test_rejects_invalid_kv_segments(segments: list[list[int]]) -> None:
    _expect_error(
        KVReady, _mutated(MESSAGES[2], ("handle", "segments"), segments), "segments must be (address, nbytes) pairs"
    )


def test_message_error_is_a_value_error() -> None:
    assert issubclass(MessageError, ValueError)


def test_sampling_params_properties() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    # boundaries that are valid
    SamplingParams(top_p=1.0, temperature=0.0, top_logprobs=20, min_p=1.0, seed=2**63 - 1, stop=("x",) * 16)


def test_minus_infinity_logprob_never_makes_an_undecodable_payload() -> None:
    """Whatever ``encode`` accepts, ``decode`` must read back (or ``encode`` must refuse).

    A ``-inf`` top logprob (a token of probability 0, e.g. a masked logit) is a legal
    value of ``TokenLogprob``; orjson writes it as ``null``.
    """
    try:
        chunk = TokenChunk(
            rid="r", seq=0, token_ids=(1,), logprobs=(TokenLogprob(-0.5, (1, 5), (-0.5, float("-inf"))),)
        )
        data = chunk.encode()
    except (ValueError, TypeError):
        return  # refusing to encode is acceptable
    back = TokenChunk.decode(data)
    assert back.logprobs is not None
    assert back.logprobs[0].top_logprobs[1] == float("-inf")


def test_a_payload_from_before_the_minor_additions_still_decodes() -> None:
    """A peer one minor version behind sends none of issue 8's fields: they take defaults."""
    old_chunk = {"v": 1, "rid": "r", "seq": 3, "token_ids": [1]}
    assert TokenChunk.decode(orjson.dumps(old_chunk)) == TokenChunk(rid="r", seq=3, token_ids=(1,))
    old_info = {
        "v": 1, "worker_id": "w", "role": "prefill", "model": "m", "host": "h", "pid": 1, "capacity": 1,
        "pages_total": 1, "pages_used": 0, "page_size": 16, "requests_in_flight": 0,
    }  # fmt: skip
    info = WorkerInfo.decode(orjson.dumps(old_info))
    assert info.counters == WorkerCounters() and info.kv_layout is None
    ready = orjson.loads(MESSAGES[2].encode())
    del ready["handle"]["generation"], ready["handle"]["protocol"], ready["attempt"]
    decoded = KVReady.decode(orjson.dumps(ready))
    assert decoded.handle.generation == 0 and decoded.handle.protocol == "" and decoded.attempt == 0


def test_a_chunk_state_must_be_known() -> None:
    with pytest.raises(MessageError, match="state"):
        TokenChunk.decode(orjson.dumps({"v": 1, "rid": "r", "seq": 0, "state": "zombie"}))
    with pytest.raises(ValueError, match="attempt"):
        GenerateRequest(rid="r", model="m", prompt_ids=(1,), reply_to="x", attempt=-1)
