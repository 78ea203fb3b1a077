"""What Gemma 3's decoder layer computes differently from the Llama layer, for the one forward
pass in `llama.py` (which calls these where `families.ModelFamily.gemma` is set): RMSNorm
that scales by (1 + weight) in float32 and rounds once, the gated MLP with GELU (tanh
form), and a rotary table per layer kind (local sliding-window layers have their own base,
`rope_local_base_freq`; global ones `rope_theta` and any scaling).

Arithmetic follows transformers' `modeling_gemma3.py`, the oracle the tests compare against.
Every op here gives a row the same bits whatever the other rows of the batch (the engine's
determinism contract, docs/engine.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.common.models.linear import Linear
from pdserve.common.models.moe import DenseMlp
from pdserve.common.models.tensor_parallel import RowParallel
from pdserve.kernels import fused_ops as fused

# torch's elementwise kernels split a call of more elements than this over threads, at
# points that depend on the call's size; an element at a split (or in a call's tail) is
# then computed by the scalar tanh instead of the vector one: other bits. Below it a call
# runs on one thread, and a row's elements take the same path whatever the row count.
_ONE_THREAD_ELEMENTS = 32768


def norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """A Gemma RMSNorm's checkpoint weight w as the float32 factor (1 + w) it scales by."""
    return 1.0 + weight.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight in float32, rounded once to x's dtype; weight: `norm_weight`."""
    if x.dtype == torch.float32:
        return fused.rms_norm(x, weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum in x's dtype."""
    if x.dtype == torch.float32:
        return fused.add_rms_norm(x, residual, weight, eps)
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] → gelu_tanh(gate) * up, in x's dtype (transformers'
    `gelu_pytorch_tanh`). On CPU by the C++ kernel (libm's tanh for every element), else in
    row groups of one thread's size, so that a row's bits do not depend on how many rows
    share the call."""
    gate, up = x.chunk(2, dim=-1)
    if x.device.type != "cpu" or x.dim() != 2:
        return F.gelu(gate, approximate="tanh").mul_(up)
    ext = fused.extension_for(x)
    if ext is not None and hasattr(ext, "gelu_tanh_and_mul"):
        return ext.gelu_tanh_and_mul(x.contiguous())
    out = torch.empty_like(up)
    rows = max(1, _ONE_THREAD_ELEMENTS // max(1, gate.shape[1]))
    for start in range(0, x.shape[0], rows):
        end = start + rows
        torch.mul(F.gelu(gate[start:end], approximate="tanh"), up[start:end], out=out[start:end])
    return out


@dataclass
class GeluMlp:
    """The gated MLP with GELU (tanh form): down(gelu_tanh(gate(x)) * up(x))."""

    gate_up: Linear
    down: Linear | RowParallel

    @classmethod
    def of(cls, mlp: DenseMlp) -> GeluMlp:
        """The same weights (this rank's, under tensor parallelism) with Gemma's activation."""
        return cls(mlp.gate_up, mlp.down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gelu_tanh_and_mul(self.gate_up(x)))


def rope_tables(config: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """cos and sin for every position, [max_pos, 2, head_dim] float32, per layer kind
    ("sliding_attention", "full_attention"); the inverse frequencies and scaling come from
    transformers' own Gemma 3 rotary module."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    rotary = Gemma3RotaryEmbedding(config=config)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    tables = {}
    for kind in rotary.layer_types:
        inv_freq = getattr(rotary, f"{kind}_inv_freq").float()
        scaling = float(getattr(rotary, f"{kind}_attention_scaling"))
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        tables[kind] = torch.stack([emb.cos() * scaling, emb.sin() * scaling], dim=1).to(device)
    return tables
