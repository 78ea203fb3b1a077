"""The cuda kernels of the determinism contract (kernels/triton_invariant.py), run by
Triton's interpreter on CPU tensors here and natively on a GPU: the dense layer and RMSNorm
give one row the same bits whatever the batch and the chunking, and match the naive
references."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch
from invariance import assert_rows_invariant

from pdserve.kernels import reference

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 2, 3, 17, 64, 65, 130]
SPLITS = [[130], [1, 129], [17, 64, 49], [65, 65]]


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    language = pytest.importorskip("triton.language", reason="triton is not installed")
    if DEVICE == "cpu" and type(language.sum).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run this file alone")
    from pdserve.kernels import triton_invariant

    if DEVICE == "cpu" and type(triton_invariant._linear_kernel).__name__ != "InterpretedFunction":
        triton_invariant = importlib.reload(triton_invariant)
    return triton_invariant


def _assert_rows_invariant(op, x: torch.Tensor) -> None:
    assert_rows_invariant(op, x, ROWS, SPLITS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (100, 75)])
def test_triton_linear_is_invariant_and_matches_the_reference(kernels, dtype, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * k)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(130, k, generator=gen).to(dtype).to(DEVICE)
    _assert_rows_invariant(lambda r: kernels.linear(r, weight, bias), x)
    want = reference.linear(x.cpu(), weight.cpu(), bias.cpu())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = kernels.linear(x, weight, bias).cpu()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    logits = kernels.linear(x, weight, bias, float32_out=True).cpu()  # the LM head's form
    assert logits.dtype == torch.float32
    want32 = reference.linear(x.cpu().double(), weight.cpu().double(), bias.cpu().double())
    torch.testing.assert_close(logits, want32.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_count_tiles_serve_prepared_layers_only_with_the_base_tiles_bits(
    kernels, dtype, monkeypatch
):
    monkeypatch.setattr(kernels, "WIDE_MIN_ROWS", 130)  # the interpreter is slow
    monkeypatch.setattr(kernels, "_agrees", {})
    tiles = []
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda *a: tiles.append(a[-1]) or launch(*a))
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(200, 64, generator=gen) / 8).to(dtype).to(DEVICE)
    x = torch.randn(130, 64, generator=gen).to(dtype).to(DEVICE)

    base = kernels.linear(x, weight)
    assert tiles[-1] is None  # never prepared: the base tile at every M
    assert kernels.linear(x[:3], weight).equal(base[:3]) and tiles[-1] is None
    assert kernels.prepare(weight) == {"few_rows": True, "wide": True}
    wide = kernels.linear(x, weight)
    assert tiles[-1] == kernels.WIDE_TILE
    assert torch.equal(wide, base)
    for r in (0, 64, 129):  # one row: a decode batch's tile
        assert torch.equal(kernels.linear(x[r : r + 1], weight), wide[r : r + 1])
        assert tiles[-1] == kernels.FEW_ROWS_TILE
    assert torch.equal(kernels.linear(x[:100], weight), base[:100])  # between: the base
    assert tiles[-1] is None
    # Where a tile was seen to differ (or failed to build), the layer keeps the base tile.
    monkeypatch.setattr(kernels, "_agrees", dict.fromkeys(kernels._agrees, False))
    assert torch.equal(kernels.linear(x, weight), base) and tiles[-1] is None
    assert torch.equal(kernels.linear(x[:1], weight), base[:1]) and tiles[-1] is None


def test_a_tile_that_fails_to_build_is_not_used(kernels, monkeypatch):
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(kernels, "_agrees", {})
    launch = kernels._launch

    def no_wide_tile(*args):
        if args[-1] == kernels.WIDE_TILE:
            raise OutOfResources(262144, 232448, "shared memory")
        return launch(*args)

    monkeypatch.setattr(kernels, "_launch", no_wide_tile)
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert kernels.prepare(weight) == {"few_rows": True, "wide": False}
    x = torch.randn(600, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    assert torch.equal(kernels.linear(x, weight)[:2], kernels.linear(x[:2], weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rms_norm_is_invariant_and_matches_torch(kernels, dtype):
    gen = torch.Generator().manual_seed(7)
    hidden = 96
    x = torch.randn(130, hidden, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(130, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    _assert_rows_invariant(lambda r: kernels.rms_norm(r, weight, 1e-5)[0], x)
    both = torch.cat([x, residual], dim=1)

    def add_norm(rows):
        out, res = kernels.rms_norm(rows[:, :hidden], weight, 1e-5, rows[:, hidden:])
        return torch.cat([out, res], dim=1)

    _assert_rows_invariant(add_norm, both)
    summed = (x.float() + residual.float()).to(dtype)
    if dtype == torch.float32:
        want = torch.nn.functional.rms_norm(summed, (hidden,), weight, 1e-5)
    else:
        normed = torch.nn.functional.rms_norm(summed.float(), (hidden,), None, 1e-5)
        want = normed.to(dtype) * weight
    out, res = kernels.rms_norm(x, weight, 1e-5, residual)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(res, summed)
    else:  # the interpreter rounds float32 -> bf16 by truncation: at most one bf16 ulp off
        torch.testing.assert_close(res.float(), summed.float(), atol=0, rtol=2**-7)
    # bf16: two roundings, each one ulp (2^-8 relative) off where the interpreter truncates
    tol = 1e-5 if dtype == torch.float32 else (1e-2 if DEVICE == "cuda" else 3e-2)
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
