"""Two forward passes over one model (a co-located process's two engines) hold its fused
projections once."""

from __future__ import annotations

import torch

from pdserve.engine.models.llama_weights import _fuse


def test_fusing_modules_again_returns_the_fused_tensor_they_already_slice() -> None:
    torch.manual_seed(0)
    q, k, v = torch.nn.Linear(16, 8), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)
    expected = torch.cat([q.weight.data, k.weight.data, v.weight.data])
    first = _fuse([q, k, v], "weight")
    again = _fuse([q, k, v], "weight")
    assert first is not None and again is not None
    assert torch.equal(first, expected) and torch.equal(again, expected)
    assert again.data_ptr() == first.data_ptr()  # the same memory, not a second copy
    assert again.shape == first.shape and again.stride() == first.stride()
    bias = _fuse([q, k, v], "bias")
    assert bias is not None and _fuse([q, k, v], "bias").data_ptr() == bias.data_ptr()  # type: ignore[union-attr]


def test_slices_of_different_tensors_are_fused_into_a_new_one() -> None:
    a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    fused = _fuse([a, b], "weight")
    assert fused is not None
    c = torch.nn.Linear(4, 2)
    mixed = _fuse([a, c], "weight")  # a is a slice of ``fused``, c is not: a new tensor
    assert mixed is not None and mixed.data_ptr() != fused.data_ptr()
    assert torch.equal(mixed, torch.cat([a.weight.data, c.weight.data]))
