"""Dense layers of the model runner: `y = x Wᵀ + b`, with the weight prepared once at load
time in the layout its kernel streams.

On CPU every dense layer (q/k/v, o_proj, the MLPs, the router, lm_head) goes through
`kernels/invariant_gemm` by default: a row's result is bit-identical whatever the batch
size, the other rows, the row's place in a prefill chunk or a decode step, and the thread
count (docs/engine.md, "Determinism"). So a request's tokens, and a seeded request's
samples, are the same offline, colocated, disaggregated and after failover.

`PDSERVE_BATCH_INVARIANT=0` gives the GEMM library's fastest path instead (for
comparisons): in bfloat16/float16 the weight reordered once into oneDNN's blocked layout,
in float32 `kernels/skinny_linear` for up to 16 rows and `F.linear` past that. oneDNN picks
its kernel by the number of rows (with AMX, rows differ at the last bit between batch
sizes), so that path is not batch-invariant. On cuda the dense layers are the Triton kernel
of `kernels/triton_invariant.py` (the same bits for a row at every M), or `F.linear` (cuBLAS)
when invariance is turned off or triton is missing. An FP8 checkpoint's weights, where a GPU
keeps them in FP8 (`fp8.py`), go through `torch._scaled_mm` instead."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from pdserve.common.models import fp8
from pdserve.kernels import invariant_gemm
from pdserve.kernels import skinny_linear as skinny


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU (bf16 needs AVX-512 or AVX-NE-CONVERT;
    an AVX2-only CPU refuses)."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 2)
    except RuntimeError:
        return False
    return True


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        os.environ.get("PDSERVE_PACKED_LINEAR", "1") != "0"
        and weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float16)
        and packing_supported(weight.dtype)
    )


class Linear:
    # The batch size oneDNN tunes the blocked layout for; any batch size works with it.
    PACK_FOR_BATCH = 64

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, float32_out: bool = False
    ) -> None:
        """`float32_out`: return the float32 accumulators unrounded (the LM head: logits
        rounded to bf16 tie far more often, and argmax then picks by vocabulary order)."""
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.float32_out = float32_out
        # An FP8 weight kept for the device's FP8 matmul (`fp8.py`), else None.
        self.fp8 = fp8.Fp8Linear(weight) if isinstance(weight, fp8.Fp8Weight) else None
        if self.fp8 is not None:
            self.path, self.gpu, self.packed, self.weight = None, None, False, weight
            return
        # The invariant kernel's path ("amx", "avx512_bf16", "avx512", "avx2"), or None.
        self.path = invariant_gemm.path_for(weight)
        self.gpu = invariant_gemm.gpu_kernels(weight)  # cuda: the Triton kernel
        if self.gpu is not None:
            self.gpu.prepare(weight)  # which row-count tiles give its bits on this GPU
        if self.path is not None:
            self.packed = False
            self.weight = invariant_gemm.pack(weight)
            self.bias = None if bias is None else bias.float()
            return
        self.packed = _can_pack(weight)
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_FOR_BATCH)
            if self.packed
            else weight
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8(x, self.bias, self.float32_out)
        if self.path is not None:
            return invariant_gemm.gemm(
                x, self.weight, self.out_features, self.bias, self.path, self.float32_out
            )
        if self.gpu is not None:
            return self.gpu.linear(x, self.weight, self.bias, self.float32_out)
        if not self.packed and skinny.serves(x, self.weight):
            y = skinny.skinny_linear(x, self.weight, self.bias)
            if y is not None:
                return y
        if x.shape[0] == 1 and x.device.type == "cpu":
            return self._linear(x.expand(2, -1))[:1]
        return self._linear(x)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return self._packed(x)
        return F.linear(x, self.weight, self.bias)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
