"""The determinism contract, op by op (docs/engine.md, Determinism): for one row, every op on
the serving path gives the same bits whatever the batch size M, the row's position, the
other rows and the chunking of a prompt, in float32 and bfloat16 (float16 for the dense
layers), on every instruction-set path this host can run. Each op is also checked against
its naive reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from invariance import assert_rows_invariant

from pdserve.common.models.linear import Linear
from pdserve.kernels import fused_ops as fused
from pdserve.kernels import invariant_gemm as gemm
from pdserve.kernels import moe as moe_kernels
from pdserve.kernels import reference

ROWS = [1, 2, 3, 5, 8, 15, 16, 17, 31, 64, 65, 255, 256, 1024]
SPLITS = [[1024], [1, 1023], [17, 300, 7, 700], [256, 256, 512], [3, 5, 1000, 16], [1000, 24]]
DTYPES = [torch.float32, torch.bfloat16]


def _runnable_paths(dtype: torch.dtype) -> list[str]:
    """Every path at or below this process's, that serves `dtype`."""
    host = gemm.host_path()
    if host is None:
        pytest.fail("no invariant GEMM path on this host (the extension did not build?)")
    paths = gemm.PATHS[: gemm.PATHS.index(host) + 1]
    return [p for p in paths if dtype == torch.bfloat16 or p not in gemm._BF16_ONLY]


def _assert_rows_invariant(op, x: torch.Tensor) -> None:
    assert_rows_invariant(op, x, ROWS, SPLITS)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("shape", [(576, 1536), (960, 576), (100, 75)])
def test_dense_layer_is_batch_and_chunk_invariant_on_every_path(dtype, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(1024, k, generator=gen).to(dtype)
    packed = gemm.pack(weight)
    assert torch.equal(gemm.unpack(packed, n, k), weight)
    expected = reference.linear(x, weight, bias)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for path in _runnable_paths(dtype):
        print(f"dense {dtype} {shape}: path {path}")

        def op(rows, path=path):
            return gemm.gemm(rows, packed, n, bias, path)

        _assert_rows_invariant(op, x)
        torch.testing.assert_close(op(x).float(), expected.float(), atol=tol, rtol=tol)

        def op32(rows, path=path):  # the LM head's unrounded float32 logits
            return gemm.gemm(rows, packed, n, bias, path, out_float32=True)

        _assert_rows_invariant(op32, x)
        assert op32(x).dtype == torch.float32
        if dtype != torch.float32:  # rounded once, the same way
            assert torch.equal(op32(x).to(dtype), op(x))
        want32 = reference.linear(x.double(), weight.double(), bias.double()).float()
        torch.testing.assert_close(op32(x), want32, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
def test_few_rows_match_a_larger_batch_at_every_block_count(dtype):
    """1 to 4 rows run as tiles over several column blocks (AVX2: 4, 3, 2 and 2; 3 and 4 rows
    with float32 weights only), each thread's last blocks as a narrower tile. Every count of
    16-column blocks from 1 to 8, a partial last block, one thread or two: each row keeps the
    bits it has in a 9-row batch."""
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(9)
    try:
        for n in (5, 16, 21, 32, 48, 57, 64, 80, 100, 112, 128):
            weight = (torch.randn(n, 40, generator=gen) / 40**0.5).to(dtype)
            bias = torch.randn(n, generator=gen)
            x = torch.randn(9, 40, generator=gen).to(dtype)
            packed = gemm.pack(weight)
            for path in _runnable_paths(dtype):
                for t in (1, 2):
                    torch.set_num_threads(t)
                    batch = gemm.gemm(x, packed, n, bias, path)
                    for m in (1, 2, 3, 4):
                        got = gemm.gemm(x[:m], packed, n, bias, path)
                        assert torch.equal(got, batch[:m]), (n, path, t, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_column_is_computed_once_whatever_the_thread_count(dtype):
    """The threads take runs of column blocks from both ends of their pair's share until
    they meet (an odd thread count leaves one thread alone on the last share). With 150
    blocks and a partial one, runs are several blocks long: every column must come out, each
    once, with the bits one thread gives, at 1 to 4 threads, on the few-row and tiled paths."""
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(11)
    n, k = 16 * 150 + 5, 72
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(19, k, generator=gen).to(dtype)
    packed = gemm.pack(weight)
    want = reference.linear(x.double(), weight.double(), bias.double()).float()
    try:
        for path in _runnable_paths(dtype):
            for m in (1, 2, 5, 19):
                torch.set_num_threads(1)
                alone = gemm.gemm(x[:m], packed, n, bias, path, out_float32=True)
                torch.testing.assert_close(alone, want[:m], atol=1e-2, rtol=1e-2)
                for t in (2, 3, 4):
                    torch.set_num_threads(t)
                    got = gemm.gemm(x[:m], packed, n, bias, path, out_float32=True)
                    assert torch.equal(got, alone), (path, m, t)
    finally:
        torch.set_num_threads(threads)


def test_fma_paths_agree_bit_for_bit():
    """AVX2 and AVX-512 accumulate in the same order: one answer for a dtype on either."""
    if "avx512" not in _runnable_paths(torch.float32):
        pytest.skip("this host has no AVX-512")
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        weight = torch.randn(200, 96, generator=gen).to(dtype)
        x = torch.randn(70, 96, generator=gen).to(dtype)
        packed = gemm.pack(weight)
        a = gemm.gemm(x, packed, 200, None, "avx2")
        assert torch.equal(a, gemm.gemm(x, packed, 200, None, "avx512")), dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_serves_every_row_through_the_invariant_kernel(dtype):
    gen = torch.Generator().manual_seed(2)
    layer = Linear(torch.randn(576, 576, generator=gen).to(dtype))
    assert layer.path == gemm.path_for(torch.empty(0, dtype=dtype)) is not None
    _assert_rows_invariant(layer, torch.randn(1024, 576, generator=gen).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_rotary_and_activation_are_row_invariant(dtype):
    gen = torch.Generator().manual_seed(3)
    hidden, heads, head_dim = 576, 12, 64
    x = torch.randn(1024, hidden, generator=gen).to(dtype)
    residual = torch.randn(1024, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    _assert_rows_invariant(lambda r: fused.rms_norm(r, weight, 1e-5), x)
    both = torch.cat([x, residual], dim=1)

    def add_norm(rows):
        out, res = fused.add_rms_norm(rows[:, :hidden], rows[:, hidden:].clone(), weight, 1e-5)
        return torch.cat([out, res], dim=1)

    _assert_rows_invariant(add_norm, both)
    _assert_rows_invariant(lambda r: fused.silu_and_mul(r), torch.cat([x, residual], dim=1))
    positions = torch.randint(0, 2048, (1024,), generator=gen)
    cos_sin = torch.randn(2048, 2, head_dim, generator=gen)
    qkv = torch.randn(1024, heads * head_dim, generator=gen).to(dtype)
    with_pos = torch.cat([qkv.float(), positions.unsqueeze(1).float()], dim=1)

    def rotary(rows):
        pos = rows[:, -1].long()
        qkv = rows[:, :-1].to(dtype, copy=True).contiguous()  # rotated in place: not x's rows
        return fused.rotary(qkv, pos, cos_sin, heads, head_dim)

    _assert_rows_invariant(rotary, with_pos)
    table = torch.randn(5000, hidden, generator=gen).to(dtype)
    ids = torch.randint(0, 5000, (1024, 1), generator=gen)
    _assert_rows_invariant(lambda r: F.embedding(r[:, 0], table), ids)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_are_token_invariant(dtype):
    gen = torch.Generator().manual_seed(4)
    experts, hidden, inter, top_k = 8, 64, 96, 2
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    path = gemm.path_for(w13)
    stacks = (
        (w13, w2)
        if path is None
        else (gemm.PackedStack.of(w13, path), gemm.PackedStack.of(w2, path))
    )
    x = torch.randn(1024, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(1024)])
    weights = torch.rand(1024, top_k, generator=gen).softmax(-1)
    rows = torch.cat([x.float(), ids.float(), weights], dim=1)

    def op(r):
        return moe_kernels.fused_experts(
            r[:, :hidden].to(dtype).contiguous(),
            *stacks,
            r[:, hidden + top_k :].contiguous(),
            r[:, hidden : hidden + top_k].long(),
        )

    _assert_rows_invariant(op, rows)
    want = reference.moe_experts(x[:64], w13, w2, weights[:64], ids[:64])
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(op(rows[:64]).float(), want, atol=tol, rtol=tol)
