"""The per-token ops (C++ rotary, add + RMSNorm and SiLU-and-multiply; torch where the C++ path
does not serve) against plain float32 maths, and the float32 ops against torch's bits."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import fused_ops

pytestmark = pytest.mark.skipif(fused_ops.load() is None, reason="C++ extension did not build")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_add_rms_norm(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    res = torch.randn(rows, 576, generator=gen).to(dtype)
    w = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    expected_res = (x.float() + res.float()).to(dtype)
    expected = _ref_rms(expected_res, w, 1e-5)
    out, new_res = fused_ops.add_rms_norm(x, res.clone(), w, 1e-5)
    assert torch.equal(new_res, expected_res)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    out = fused_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(
        out.float(), _ref_rms(x, w, 1e-5), atol=TOL[dtype] * 4, rtol=TOL[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = (torch.randn(33, 2 * 96, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(
        fused_ops.silu_and_mul(x).float(), F.silu(gate) * up, atol=TOL[dtype] * 4, rtol=TOL[dtype]
    )


def test_fast_silu_and_mul_is_torchs_within_one_ulp_and_per_row():
    """The C++ bf16 path: torch's two roundings with another exp, so at most one bf16 ulp
    from torch's result anywhere (inputs over silu's whole range, incl. saturation), and a
    row's bits do not depend on the rows beside it."""
    ext = fused_ops.load()
    if ext is None or not ext.fast_bf16:
        pytest.skip("no AVX-512 BF16 on this CPU: torch's kernel serves")
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(257, 2 * 1536, generator=gen) * 6).to(torch.bfloat16)
    x[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30, 88.0, -90.0])
    out = ext.silu_and_mul(x)
    if os.environ.get(fused_ops.FUSED_ENV, "1") != "0":
        assert torch.equal(fused_ops.silu_and_mul(x), out)  # the engine's calls take it
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate).mul_(up)
    ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp_min(1e-30)
    assert ((out.float() - expected.float()).abs() <= ulp).all()
    assert (out == expected).float().mean() > 0.99
    rows = torch.cat([ext.silu_and_mul(x[i : i + 1]) for i in (0, 5, 256)])
    assert torch.equal(rows, out[[0, 5, 256]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_rotate_half(dtype):
    heads, kv_heads, d = 9, 3, 64
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(17, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 100, (17,), generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.outer(torch.arange(100).float(), inv).repeat(1, 2)
    cos_sin = torch.stack([emb.cos(), emb.sin()], dim=1).contiguous()
    expected = qkv.float().clone()
    qk = expected[:, : (heads + kv_heads) * d].view(17, -1, d)
    cos, sin = cos_sin[positions, 0].unsqueeze(1), cos_sin[positions, 1].unsqueeze(1)
    rot = torch.cat([-qk[..., d // 2 :], qk[..., : d // 2]], dim=-1)
    expected[:, : (heads + kv_heads) * d] = (qk * cos + rot * sin).reshape(17, -1)
    got = fused_ops.rotary(qkv.clone(), positions, cos_sin, heads + kv_heads, d)
    torch.testing.assert_close(got.float(), expected, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    # v is untouched
    assert torch.equal(got[:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :])


def test_rotary_rejects_positions_outside_table():
    qkv = torch.zeros(2, 128, dtype=torch.bfloat16)
    cos_sin = torch.zeros(4, 2, 64)
    with pytest.raises(RuntimeError, match="rotary table"):
        fused_ops.rotary(qkv, torch.tensor([0, 9]), cos_sin, 2, 64)


def _f32_ext():
    ext = fused_ops.load()
    if ext is None or not ext.fast_f32:
        pytest.skip("no AVX2 + FMA on this CPU: torch's kernels serve float32")
    return ext


def _fixed_order_add_rms_norm(x, res, w, eps):
    """The float32 kernel's documented order, one IEEE float32 op at a time in numpy: the
    squares summed per lane of 8 by FMA (emulated exactly in float64: a float32 product is
    exact there), the lanes added as ((0+4)+(2+6)) + ((1+5)+(3+7)), the mean, 1/sqrt, and
    two rounded products. What every host must produce, whatever its vector width."""
    f32 = np.float32
    r = (x.numpy() + res.numpy()).astype(f32)
    lanes = np.zeros((r.shape[0], 8), dtype=f32)
    for i in range(0, r.shape[1], 8):
        block = r[:, i : i + 8].astype(np.float64)
        lanes = (block * block + lanes.astype(np.float64)).astype(f32)
    half = (lanes[:, :4] + lanes[:, 4:]).astype(f32)
    pair = (half[:, :2] + half[:, 2:]).astype(f32)
    total = (pair[:, 0] + pair[:, 1]).astype(f32)
    var = (total / f32(r.shape[1])).astype(f32)
    inv = (f32(1) / np.sqrt((var + f32(eps)).astype(f32))).astype(f32)
    return torch.from_numpy((r * inv[:, None]).astype(f32) * w.numpy()), torch.from_numpy(r)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_float32_add_rms_norm_has_its_fixed_order_bits(rows):
    """Bit for bit the order written down above (so the same bits on every host class,
    where torch's own reduction follows ATen's vector width), and within a few ulps of
    torch's; the engine's calls take the C++ path."""
    ext = _f32_ext()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen) * 3
    res = torch.randn(rows, 576, generator=gen)
    w = torch.rand(576, generator=gen) + 0.5
    expected, expected_res = _fixed_order_add_rms_norm(x, res, w, 1e-5)
    new_res = res.clone()
    out = ext.add_rms_norm(x, new_res, w, 1e-5)
    assert torch.equal(new_res, expected_res) and torch.equal(out, expected)
    if os.environ.get(fused_ops.FUSED_ENV, "1") != "0":
        engine_out, _ = fused_ops.add_rms_norm(x, res.clone(), w, 1e-5)
        assert torch.equal(engine_out, out)
    torch_out = F.rms_norm(expected_res, (576,), w, 1e-5)
    ulps = (out - torch_out).abs() / torch.finfo(torch.float32).eps / torch_out.abs()
    assert ulps.max() <= 4


def test_float32_silu_and_mul_is_torchs_within_ulps_and_per_row():
    """torch's two roundings with the attention kernels' exp: within a few float32 ulps of
    torch's result over silu's whole range (saturation included), a row's bits independent
    of the rows beside it."""
    ext = _f32_ext()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(257, 2 * 1536, generator=gen) * 6
    x[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30, 88.0, -90.0])
    out = ext.silu_and_mul(x)
    if os.environ.get(fused_ops.FUSED_ENV, "1") != "0":
        assert torch.equal(fused_ops.silu_and_mul(x), out)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate).mul_(up)
    # Below exp's clamp at -87 both results are under 1e-35 in size (torch's is 0).
    ulp = torch.finfo(torch.float32).eps * expected.abs().clamp_min(1e-28)
    assert ((out - expected).abs() <= 4 * ulp).all()
    rows = torch.cat([ext.silu_and_mul(x[i : i + 1]) for i in (0, 5, 256)])
    assert torch.equal(rows, out[[0, 5, 256]])


def test_float32_rotary_is_torchs_bit_for_bit(monkeypatch):
    """Both products rounded before the add, as torch's rotate-half formulation does: the
    C++ path and the torch path give the same bits."""
    _f32_ext()
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(33, 15 * 64, generator=gen)
    positions = torch.randint(0, 512, (33,), generator=gen)
    cos_sin = torch.randn(512, 2, 64, generator=gen)
    fused = fused_ops.rotary(qkv.clone(), positions, cos_sin, 12, 64)
    monkeypatch.setenv(fused_ops.FUSED_ENV, "0")
    assert fused_ops.extension_for(qkv) is None
    assert torch.equal(fused_ops.rotary(qkv.clone(), positions, cos_sin, 12, 64), fused)


def _first_argmax(row: list[float]) -> int:
    """The naive answer: the first NaN if the row has one, else the first largest value."""
    nans = [i for i, v in enumerate(row) if v != v]
    if nans:
        return nans[0]
    best = max(row)
    return row.index(best)


@pytest.mark.parametrize("width", [1, 7, 31, 32, 33, 100, 1000, 49152])
def test_argmax_is_the_first_largest_index(width):
    _f32_ext()
    gen = torch.Generator().manual_seed(width)
    rows = torch.randn(16, width, generator=gen)
    # Rows 1-7: the maximum twice or more, at places that land in different chains and lanes,
    # the vector part and the scalar tail; the first must win.
    top = rows.max() + 1
    for r, places in enumerate([[0, -1], [-1, 0], [5, 3], [40, 8], [9, 41, 73], [-2, -1], [1, 2]]):
        for p in places:
            rows[1 + r, p % width] = top
    rows[8] = float("-inf")  # no finite value: index 0
    rows[9, width // 2] = float("nan")  # a NaN wins, as in torch
    rows[10, width - 1] = float("nan")
    rows[10, 0] = float("inf")
    got = fused_ops.argmax(rows)
    assert got.dtype == torch.long
    assert got.tolist() == [_first_argmax(row) for row in rows.tolist()]
    assert torch.equal(got, rows.argmax(dim=-1))
    # A row's answer does not depend on the rows beside it.
    assert [fused_ops.argmax(rows[i : i + 1]).item() for i in range(16)] == got.tolist()
