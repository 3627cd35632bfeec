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
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin

import orjson

T = TypeVar("T")
M = TypeVar("M", bound="Message")


class MessageError(ValueError):
    """A payload that is not a valid message of the expected type and version."""

    code = "malformed_message"  # ErrorInfo.code of the error a receiver answers with


class UnsupportedVersion(MessageError):
    """A payload whose major version ``v`` this receiver does not speak."""

    code = "unsupported_version"


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
            raise UnsupportedVersion(f"{cls.__name__}: unsupported version {version!r} (expected {cls.VERSION})")
        return _build(cls, raw, cls.__name__)

    @classmethod
    def from_dict(cls: type[M], raw: dict[str, Any]) -> M:
        return _build(cls, raw, cls.__name__)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type[T], raw: Any, where: str) -> T:
    return _checker(cls)(raw, where)  # type: ignore[no-any-return,arg-type]  # classes are hashable


# A checker takes a decoded JSON value and the path to it (for error messages) and returns
# the field's value or raises MessageError. Checkers are made once per type: a message is
# checked without looking at type hints again, and a list of integers (a prompt) in one
# pass that builds no per-item path unless an item is wrong.
Checker = Callable[[Any, str], Any]


@functools.cache
def _checker(hint: Any) -> Checker:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return _union_checker(hint)
    if origin is list or origin is tuple:
        return _list_checker(get_args(hint)[0])
    if origin is dict:
        return _dict_checker(get_args(hint)[1])
    if origin is typing.Literal:
        allowed = get_args(hint)

        def literal(value: Any, where: str) -> Any:
            if value not in allowed:
                raise MessageError(f"{where}: {value!r} is not one of {allowed}")
            return value

        return literal
    if hint is Any:
        return lambda value, where: value
    if hint in _SCALARS:
        return _SCALARS[hint]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass_checker(hint)
    raise TypeError(f"unsupported field type {hint!r}")


def _check_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise MessageError(f"{where}: expected a boolean")
    return value


def _check_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MessageError(f"{where}: expected an integer")
    return value


def _check_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MessageError(f"{where}: expected a number")
    return float(value)


def _check_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise MessageError(f"{where}: expected a string")
    return value


_SCALARS: dict[Any, Checker] = {bool: _check_bool, int: _check_int, float: _check_float, str: _check_str}


def _union_checker(hint: Any) -> Checker:
    args = get_args(hint)
    nullable = type(None) in args
    variants = [_checker(arg) for arg in args if arg is not type(None)]

    def union(value: Any, where: str) -> Any:
        if value is None and nullable:
            return None
        errors = []
        for variant in variants:
            try:
                return variant(value, where)
            except MessageError as exc:
                errors.append(str(exc))
        raise MessageError(errors[0] if len(errors) == 1 else f"{where}: no variant matched")

    return union


def _list_checker(item: Any) -> Checker:
    check = _checker(item)
    exact = item if item in (int, str) else None  # JSON gives these types exactly (bool is not int here)

    def items(value: Any, where: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list")
        if exact is not None and set(map(type, value)) <= {exact}:
            return tuple(value)
        return tuple(check(v, f"{where}[{i}]") for i, v in enumerate(value))

    return items


def _dict_checker(item: Any) -> Checker:
    check = _checker(item)

    def mapping(value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected an object")
        return {str(k): check(v, f"{where}.{k}") for k, v in value.items()}

    return mapping


def _dataclass_checker(cls: type) -> Checker:
    hints = _hints(cls)
    fields = [
        (
            f.name,
            _checker(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    ]

    def build(raw: Any, where: str) -> Any:
        if not isinstance(raw, dict):
            raise MessageError(f"{where}: expected an object")
        kwargs: dict[str, Any] = {}
        for name, check, required in fields:
            if name in raw:
                kwargs[name] = check(raw[name], f"{where}.{name}")
            elif required:
                raise MessageError(f"{where}: missing field {name!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise MessageError(f"{where}: {exc}") from None

    return build
