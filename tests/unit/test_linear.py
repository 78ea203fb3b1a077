"""The model runner's dense layer: the batch-invariant kernel by default (on CPU), oneDNN's
packed layout or F.linear when turned off; both compute what the float64 product computes."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.models.linear import Linear, packing_supported
from pdserve.kernels import invariant_gemm, reference


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_the_reference(monkeypatch, invariant, dtype, rows, with_bias):
    monkeypatch.setenv(invariant_gemm.INVARIANT_ENV, "1" if invariant else "0")
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 80, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    layer = Linear(weight, bias)
    if invariant:
        assert layer.path is not None and not layer.packed
    else:
        assert layer.path is None
        assert layer.packed == (dtype == torch.bfloat16 and packing_supported(dtype))
    expected = reference.linear(x.float(), weight.float(), None if bias is None else bias.float())
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_packing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(invariant_gemm.INVARIANT_ENV, "0")
    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "0")
    layer = Linear(torch.randn(8, 8, dtype=torch.bfloat16))
    assert not layer.packed and layer.path is None


def test_rows_do_not_depend_on_batch_size():
    """A row's result is bit-identical whatever the batch size (what makes seeded sampling
    independent of the batch); 1536 inputs is a shape where oneDNN treats a lone row apart."""
    gen = torch.Generator().manual_seed(3)
    layer = Linear((torch.randn(576, 1536, generator=gen) * 0.05).to(torch.bfloat16))
    x = torch.randn(64, 1536, generator=gen).to(torch.bfloat16)
    alone = layer(x[:1])
    for rows in (2, 3, 17, 64):
        assert torch.equal(layer(x[:rows])[:1], alone), rows
