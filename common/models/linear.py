"""Dense layers of the model runner: `y = x Wᵀ + b`, with the weight prepared once at load
time in the fastest layout for its device.

On CPU in bfloat16/float16 the weight is reordered once into oneDNN's blocked layout: the
same arithmetic (bit-identical results) at 20–30% more GFLOP/s for decode-sized batches than
`F.linear` on a plain weight, which re-packs on every call. On CPU in float32, decode-sized
batches (up to 16 rows) go to `kernels/skinny_linear` (weights read once at near the memory
bandwidth: 2-3x `F.linear` for 1-4 rows here); larger ones, GPUs and CPUs without oneDNN's
bf16 support (AVX2-only) use `F.linear`. `PDSERVE_PACKED_LINEAR=0` turns packing off
(for comparisons).

Batch invariance: every row is computed the same way whatever the batch size, except that
oneDNN reduces a lone row differently; on CPU a one-row input is therefore padded to two.
So a request's numbers, and a seeded request's samples, do not depend on what else is in its
batch."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = _can_pack(weight)
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_FOR_BATCH)
            if self.packed
            else weight
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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
