"""Per-token operations between the matmuls of each layer: residual add + RMSNorm, rotary
embedding (rotate-half form) and SiLU-and-multiply, in the reference model's order and
rounding; and the sampler's greedy argmax over the logits.

The model runner calls these for every layer of every step. On CPU the C++ extension
(`csrc/fused_ops.cpp`) serves rotary in every dtype (bit for bit torch's formulation in
float32), and residual add + RMSNorm and SiLU-and-multiply in float32 (AVX2 + FMA: every host
class; one pass each, a fixed reduction order, so the same bits on every host) and in
bfloat16 (AVX-512 BF16 builds); everything else uses torch's own kernels.
`PDSERVE_FUSED_OPS=0` forces the torch path. On cuda RMSNorm (with the residual add) is
the Triton kernel of `kernels/triton_invariant.py` (one program per row: batch-invariant)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from pdserve.kernels import invariant_gemm
from pdserve.kernels.cpp_build import build_main, load_extension

EXTENSION_NAME = "pdserve_fused_ops"
FUSED_ENV = "PDSERVE_FUSED_OPS"  # "0": torch's kernels for every per-token op
SOURCE = Path(__file__).parent / "csrc" / "fused_ops.cpp"
# A product is rounded before it is added (torch's rotary bits in float32): the compiler may
# not fuse a multiply and an add into one FMA behind the source's back.
CFLAGS = ["-ffp-contract=off"]


def load(verbose: bool = False) -> ModuleType | None:
    return load_extension(EXTENSION_NAME, [SOURCE], verbose, CFLAGS)


def extension_for(x: torch.Tensor) -> ModuleType | None:
    """The C++ ops when they serve `x` (CPU, float32 or 16-bit float), else None (torch)."""
    if (
        x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
        or os.environ.get(FUSED_ENV, "1") == "0"
    ):
        return None
    return load()


def fast_kernels(dtype: torch.dtype) -> ModuleType | None:
    """The extension when its add + RMSNorm and SiLU-and-multiply serve `dtype` on this CPU:
    float32 (AVX2 + FMA) or bfloat16 (AVX-512 BF16 builds); else None."""
    ext = load()
    if ext is None:
        return None
    if (dtype == torch.float32 and ext.fast_f32) or (dtype == torch.bfloat16 and ext.fast_bf16):
        return ext
    return None


def _fast(x: torch.Tensor, multiple: int) -> ModuleType | None:
    """The C++ add + RMSNorm and SiLU-and-multiply when they serve `x`: rows of a dtype
    `fast_kernels` serves whose width is a multiple of `multiple`; else None."""
    if extension_for(x) is None or x.shape[-1] % multiple != 0:
        return None
    return fast_kernels(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x); normalised in float32 and rounded before scaling."""
    gpu = invariant_gemm.gpu_kernels(x)
    if gpu is not None and x.dim() == 2:
        return gpu.rms_norm(x, weight, eps)[0]
    ext = _fast(x, 16)
    if ext is not None:
        return ext.add_rms_norm(None, x.contiguous(), weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual). May update `residual` in place."""
    gpu = invariant_gemm.gpu_kernels(x)
    if gpu is not None and x.dim() == 2:
        out, res = gpu.rms_norm(x, weight, eps, residual)
        assert res is not None
        return out, res
    ext = _fast(x, 16)
    if ext is not None:
        residual = residual.contiguous()
        return ext.add_rms_norm(x.contiguous(), residual, weight, eps), residual
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] → silu(gate) * up."""
    ext = _fast(x, 32)
    if ext is not None and x.dim() == 2:
        return ext.silu_and_mul(x.contiguous())
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [N] int64 for logits [N, V]: `logits.argmax(dim=-1)`'s answer (the
    first index on ties, the first NaN where a row has one), by the C++ kernel for float32 CPU
    rows."""
    ext = extension_for(logits)
    served = logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0
    if ext is not None and ext.fast_f32 and served:
        return ext.argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def rotary(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, heads: int, head_dim: int
) -> torch.Tensor:
    """Rotate the first `heads` heads (q then k) of each row of qkv [T, (H + 2 KVH) * D];
    cos_sin [max_pos, 2, D] float32. Returns qkv with those heads rotated (in place on the
    C++ path)."""
    ext = extension_for(qkv)
    if ext is not None and qkv.is_contiguous():
        ext.rotary_(qkv, positions, cos_sin, heads, head_dim)
        return qkv
    num_tokens = qkv.shape[0]
    cos, sin = cos_sin[positions].to(qkv.dtype).unsqueeze(2).unbind(1)  # [T, 1, D] each
    qk = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    half = head_dim // 2
    rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
    qk = qk * cos + rotated * sin
    return torch.cat([qk.reshape(num_tokens, -1), qkv[:, heads * head_dim :]], dim=1)


if __name__ == "__main__":
    sys.exit(build_main(EXTENSION_NAME, [SOURCE], CFLAGS))
