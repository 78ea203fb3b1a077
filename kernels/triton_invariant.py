"""Batch-invariant kernels for GPUs, in Triton: the dense layer `y = x Wᵀ + b` and RMSNorm
(with the residual add), which the model runner uses for every layer of every step on cuda
(`common/models/linear.py`, `kernels/fused_ops.py`, `kernels/moe.py`).

cuBLAS and torch's reductions choose their kernels, tiles and split-K by shape, so a row's
bits change with the batch. Here a program computes one BLOCK_M x BLOCK_N tile, walking K
from 0 in BLOCK_K steps into one float32 accumulator (no split-K, no atomics), rows past M
masked to zero; M is not a specialisation key. Decode batches and prefill steps may take
other tiles, each only where it was seen to give the base tile's very bits (see
FEW_ROWS_TILE). RMSNorm is one program per row. Checked on
the CPU under `TRITON_INTERPRET=1` against the naive references
(tests/unit/test_triton_invariant.py).

Imported only when a cuda tensor needs it (importing triton first decides whether its
interpreter is on)."""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.errors import TritonError

logger = logging.getLogger(__name__)

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
# The base tile's software-pipeline depth by layer shape: a layer of at most this many output
# columns has fewer column tiles than a large GPU has SMs, and each program must keep more
# weight loads in flight to stream at the memory's rate. Measured on an H200
# (benchmarks/gpu_linear_tiles.py), one row: 4096x4096 38.6 -> 25.5 us, 4096x14336 114 -> 70
# us, 6144x4096 40.8 -> 29.9 us. Wider layers (gate/up, the LM head) are best at 3.
DEEP_PIPELINE_MAX_N, DEEP_STAGES, STAGES = 8192, 5, 3

# Other row counts run faster on other tiles, (BLOCK_M, BLOCK_N, num_warps, num_stages):
# decode batches on narrower column tiles with deeper pipelines (more programs streaming the
# weights), prefill chunks on wider ones (the tensor cores fed). Every tile walks K in the
# same BLOCK_K steps into one float32 accumulator, but whether the GPU's matrix instructions
# for two tile shapes round alike is the hardware's business, so a tile serves a layer only
# once `prepare` saw it give the base tile's very bits for that layer's shape on this device
# (once per shape, when the layer is built; a tile that fails to compile or run there is not
# used either). On an H200 every candidate of benchmarks/gpu_linear_tiles.py did.
FEW_ROWS_MAX = 64  # decode batches of up to this many rows, on layers up to 8192 columns:
FEW_ROWS_TILE = (64, 32, 4, 8)  # one row 4096x4096 25.5 -> 19.9 us, 4096x14336 70 -> 52
WIDE_MIN_ROWS = 512  # prefill steps of at least this many rows:
WIDE_TILE = (128, 128, 8, 3)  # 8192 rows at 520-586 TFLOP/s, 300-340 on the base tile
_agrees: dict[tuple, bool] = {}  # (device, dtype, N, K, tile) -> same bits as the base tile
# Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) `invariant_dot` does not call
# tl.dot: see there.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def invariant_dot(a, b, acc, IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + a @ b in float32, each output element from its own row of `a` and column of
    `b` alone: an element's bits never depend on the rows or columns beside it. Compiled,
    that is tl.dot (tensor cores; exact float32 FMAs with `IEEE`). The interpreter's tl.dot
    is numpy's BLAS, whose result for a row depends on where the row sits in the tile on some
    CPUs (seen on AMD EPYC), and which multiplies bf16 tiles as raw integers: interpreted,
    the products are widened to float32 (exact) and summed over K in order instead."""
    if INTERPRETED:
        acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:  # constexpr branches, compiled away
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )
        acc = invariant_dot(a, b, acc, IEEE, INTERPRETED)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def _launch(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    float32_out: bool,
    tile: tuple[int, int, int, int] | None,
) -> Tensor:
    """The kernel over x [M, K] on the base tile (`tile` None) or on `tile`."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=torch.float32 if float32_out else x.dtype, device=x.device)
    if m == 0:
        return y
    if tile is None:
        block_m, block_n, warps = BLOCK_M, BLOCK_N, 4
        stages = DEEP_STAGES if n <= DEEP_PIPELINE_MAX_N else STAGES
    else:
        block_m, block_n, warps, stages = tile
        if x.element_size() > 2:  # float32 tiles take twice the shared memory per stage
            stages = min(stages, 4 if block_m * block_n <= 64 * 64 else 2)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _linear_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        INTERPRETED=INTERPRETED,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return y


def _tile_for(m: int, n: int) -> tuple[str, tuple[int, int, int, int]] | None:
    """The candidate tile for m rows of a layer of n columns, or None (the base tile)."""
    if m >= WIDE_MIN_ROWS:
        return "wide", WIDE_TILE
    if m <= FEW_ROWS_MAX and n <= DEEP_PIPELINE_MAX_N:
        return "few_rows", FEW_ROWS_TILE
    return None


def _key(weight: Tensor, tile: tuple[int, int, int, int]) -> tuple:
    return (weight.device, weight.dtype, *weight.shape, tile)


def prepare(weight: Tensor) -> dict[str, bool]:
    """Which candidate tiles serve `weight`'s shape here: each decided once per shape by
    comparing its float32 accumulators with the base tile's over random rows (the layer's
    builder calls this; a shape never prepared runs the base tile alone)."""
    n, k = weight.shape
    found = {}
    for rows in (1, WIDE_MIN_ROWS):
        candidate = _tile_for(rows, n)
        if candidate is None:
            continue
        name, tile = candidate
        key = _key(weight, tile)
        if key not in _agrees:
            # One row tile of random rows: the kernel does not specialise on M, so more
            # rows would only repeat it (and an LM head's float32 output is large).
            gen = torch.Generator(device=weight.device).manual_seed(0)
            x = torch.randn(tile[0], k, generator=gen, device=weight.device).to(weight.dtype)
            base = _launch(x, weight, None, True, None).view(torch.int32)  # bits, not values
            try:
                same = torch.equal(_launch(x, weight, None, True, tile).view(torch.int32), base)
            except TritonError as e:  # e.g. more shared memory than this GPU has
                logger.warning("dense tile %s unavailable for %s: %s", tile, key[:4], e)
                same = False
            _agrees[key] = same
        found[name] = _agrees[key]
    return found


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, float32_out: bool = False
) -> Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias) -> [M, N] in x's dtype (float32 with `float32_out`);
    float32 inputs without TF32."""
    candidate = _tile_for(x.shape[0], weight.shape[0])
    tile = candidate[1] if candidate and _agrees.get(_key(weight, candidate[1])) else None
    return _launch(x, weight, bias, float32_out, tile)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, N, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, FLOAT32: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's add
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if FLOAT32:  # noqa: SIM108
        y = xf * rstd * w
    else:  # normalised in float32, rounded, then scaled (the reference model's order)
        y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """(RMSNorm(x [+ residual]) * weight, x + residual or None) for x [T, N]."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if rows:
        res = residual if residual is not None else x
        ro = res_out if res_out is not None else out
        _rms_norm_kernel[(rows,)](
            x, res, weight, out, ro, n, eps,
            x.stride(0), res.stride(0), out.stride(0), ro.stride(0),
            HAS_RESIDUAL=residual is not None, FLOAT32=x.dtype == torch.float32,
            BLOCK=triton.next_power_of_2(n),
        )  # fmt: skip
    return out, res_out
