"""The per-token ops (C++ rotary, torch norm and activation) against plain float32 maths."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import fused_ops

pytestmark = pytest.mark.skipif(fused_ops.load() is None, reason="C++ extension did not build")
DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


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
    if os.environ.get("PDSERVE_FUSED_OPS", "1") != "0":
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


def test_float32_stays_on_the_reference_path():
    assert fused_ops.extension_for(torch.zeros(1)) is None
