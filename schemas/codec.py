"""Encoding and strict decoding of wire messages.

Every message that crosses a process boundary is a frozen dataclass with an integer
major version ``v``. Encoding is ``orjson`` of the dataclass. Decoding checks the major
version and the type of every field, ignores unknown fields (so a newer minor version
with extra optional fields still decodes) and raises :class:`MessageError` with a
readable reason for anything else. Nothing else in pdserve builds a payload by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin

import orjson

T = TypeVar("T")
M = TypeVar("M", bound="Message")


class MessageError(ValueError):
    """A payload that is not a valid message of the expected type and version."""


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """Base of every wire message; subclasses set ``VERSION`` and their fields."""

    VERSION: ClassVar[int] = 1

    def encode(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def decode(cls: type[M], data: bytes | str) -> M:
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise MessageError(f"{cls.__name__}: not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise MessageError(f"{cls.__name__}: expected a JSON object")
        version = raw.get("v")
        if version != cls.VERSION:
            raise MessageError(f"{cls.__name__}: unsupported version {version!r} (expected {cls.VERSION})")
        return _build(cls, raw, cls.__name__)

    @classmethod
    def from_dict(cls: type[M], raw: dict[str, Any]) -> M:
        return _build(cls, raw, cls.__name__)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type[T], raw: Any, where: str) -> T:
    if not isinstance(raw, dict):
        raise MessageError(f"{where}: expected an object")
    hints = _hints(cls)  # type: ignore[arg-type]  # classes are hashable
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]  # a dataclass by construction
        if field.name in raw:
            kwargs[field.name] = _check(raw[field.name], hints[field.name], f"{where}.{field.name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise MessageError(f"{where}: missing field {field.name!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise MessageError(f"{where}: {exc}") from None


def _check(value: Any, hint: Any, where: str) -> Any:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        args = get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg, where)
            except MessageError as exc:
                errors.append(str(exc))
        raise MessageError(errors[0] if len(errors) == 1 else f"{where}: no variant matched")
    if origin is list or origin is tuple:
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list")
        (item,) = get_args(hint)[:1]
        return tuple(_check(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected an object")
        _, item = get_args(hint)
        return {str(k): _check(v, item, f"{where}.{k}") for k, v in value.items()}
    if origin is typing.Literal:
        if value not in get_args(hint):
            raise MessageError(f"{where}: {value!r} is not one of {get_args(hint)}")
        return value
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise MessageError(f"{where}: expected a boolean")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MessageError(f"{where}: expected an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MessageError(f"{where}: expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise MessageError(f"{where}: expected a string")
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    raise TypeError(f"unsupported field type {hint!r} at {where}")
