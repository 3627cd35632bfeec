"""The KV page pool: one tensor per worker, registered whole with the transfer engine.

Layout ``[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]``: a page holds
all layers' K and V for ``page_size`` tokens, so a request's KV is a few contiguous
runs of pages — few, large transfer segments (Mooncake over tcp costs about 16 µs a segment).
Inside a page each (layer, K|V, head) is one ``[page_size, head_dim]`` row block, so
attention gathers a sequence's pages straight into ``[batch, heads, tokens, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.schemas import KVLayout

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}") from None


class KVPool:
    """Owns the pool tensor; knows page addresses. No allocation policy here."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        pin = device.type == "cpu" and torch.cuda.is_available()
        self.tensor = torch.zeros(
            (num_pages, layout.num_layers, 2, layout.num_kv_heads, layout.page_size, layout.head_dim),
            dtype=dtype_from_name(layout.dtype),
            device=device,
            pin_memory=pin,
        )

    @property
    def page_bytes(self) -> int:
        return self.layout.page_numel * self.tensor.element_size()

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def page_address(self, page: int) -> int:
        return self.data_ptr + page * self.page_bytes

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page ``src``'s KV (every layer) into page ``dst`` (queued on the device's stream)."""
        self.tensor[dst].copy_(self.tensor[src], non_blocking=True)

    def segments(self, pages: Sequence[int]) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each maximal run of consecutive page ids, in order."""
        return [(self.page_address(start), n * self.page_bytes) for start, n in page_runs(pages)]


def page_runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first_page, count), ...]`` of consecutive ids, preserving order."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def bytes_per_token(layout: KVLayout, element_size: int) -> int:
    return layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * element_size
