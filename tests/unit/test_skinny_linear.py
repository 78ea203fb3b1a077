"""The decode-sized float32 matmul kernel against `F.linear` in float64: every row count it
serves, widths with and without a tail past the vector length, with and without bias; and a
row's result is bit-identical whatever else is in its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.common.models.linear import Linear
from pdserve.kernels import skinny_linear as skinny

pytestmark = pytest.mark.skipif(skinny.load() is None, reason="C++ extension unavailable")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (100, 37), (7, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(rows: int, k: int, n: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got = skinny.skinny_linear(x, w, b)
    assert got is not None and got.shape == (rows, n) and got.dtype == torch.float32
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4 * k**0.5)


def test_a_row_is_the_same_in_any_batch() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 576, generator=g)
    w = torch.randn(960, 576, generator=g)
    alone = torch.cat([skinny.skinny_linear(x[i : i + 1], w) for i in range(16)])
    for rows in (2, 3, 5, 16):
        together = skinny.skinny_linear(x[:rows], w)
        assert torch.equal(together, alone[:rows]), rows


def test_linear_uses_it_for_decode_sized_float32_batches(monkeypatch) -> None:
    """On the GEMM library's path (batch invariance off: the invariant kernel serves
    float32 otherwise)."""
    monkeypatch.setenv("PDSERVE_BATCH_INVARIANT", "0")
    w = torch.randn(64, 32)
    layer = Linear(w)
    x = torch.randn(3, 32)
    assert torch.equal(layer(x), skinny.skinny_linear(x, w))
    monkeypatch.setenv("PDSERVE_SKINNY_LINEAR", "0")
    torch.testing.assert_close(layer(x), F.linear(x, w))
    big = torch.randn(skinny.MAX_ROWS + 1, 32)
    assert not skinny.serves(big, w) and not skinny.serves(x.double(), w.double())


def test_refuses_mismatched_shapes() -> None:
    with pytest.raises(RuntimeError, match="columns"):
        skinny.skinny_linear(torch.randn(2, 8), torch.randn(4, 9))
