"""KV transfer backends: a small registry and a factory that imports lazily."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.workers.transfer.base import TransferBackend, TransferError, advertised_host, plan_reads

_BACKENDS: dict[str, Callable[..., TransferBackend]] = {}


def _mooncake(**kwargs: object) -> TransferBackend:
    from pdserve.workers.transfer.mooncake import MooncakeTransfer

    return MooncakeTransfer(**kwargs)  # type: ignore[arg-type]


_BACKENDS["mooncake"] = _mooncake


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_transfer(name: str, **kwargs: object) -> TransferBackend:
    """A started backend by name (``mooncake``); raises ``ValueError`` for unknown names."""
    try:
        factory = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown transfer backend {name!r}; available: {', '.join(available_backends())}") from None
    return factory(**kwargs)


__all__ = ["TransferBackend", "TransferError", "advertised_host", "available_backends", "create_transfer", "plan_reads"]
