"""A decode step's decoder layers in one C++ call (`csrc/dense_layers.cpp`), on CPU.

The model's forward (`common/models/llama.py`) hands a decode-only batch of a dense model
here (its layers as `DenseLayer`s) when every op of its layers would take the C++ kernels
anyway: the invariant GEMM for
every linear, the C++ add + RMSNorm, rotary and SiLU-and-multiply, and the C++ paged
attention. The call runs the very kernel functions the per-op path runs (the kernel
extensions export their entry points to this one), in the same order, so the result is the
same bits; it only leaves out the Python between them (~300 calls a step).

`PDSERVE_LAYER_LOOP=0` keeps every step on the per-op path (benchmarks compare the two; it is
read at each step). Like the other extensions it is built on first use, or ahead of time by
``python -m pdserve.kernels.dense_layers`` (the Makefile's install)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol

import torch

from pdserve.kernels import cpu_extension, fused_ops, invariant_gemm
from pdserve.kernels.attention import BACKEND_ENV
from pdserve.kernels.cpp_build import build_main, load_extension

EXTENSION_NAME = "pdserve_dense_layers"
SOURCE = Path(__file__).parent / "csrc" / "dense_layers.cpp"

LOOP_ENV = "PDSERVE_LAYER_LOOP"  # "0": the per-op Python path for every step


def load(verbose: bool = False) -> ModuleType | None:
    """The extension with the kernels' entry points bound, or None where any of the four
    extensions is unavailable."""
    ext = load_extension(EXTENSION_NAME, [SOURCE], verbose)
    if ext is None or ext.bound():
        return ext
    gemm, attention, ops = invariant_gemm.load(), cpu_extension.load(), fused_ops.load()
    if gemm is None or attention is None or ops is None:
        return None
    ext.bind(
        gemm.invariant_gemm_entry,
        attention.paged_attention_entry,
        attention.write_kv_entry,
        ops.add_rms_norm_entry,
        ops.rotary_entry,
        ops.silu_and_mul_entry,
    )
    return ext


class PackedLinear(Protocol):
    """A dense layer as the model holds it (`common/models/linear.Linear`)."""

    weight: torch.Tensor  # as `invariant_gemm.pack` laid it out
    bias: torch.Tensor | None
    out_features: int
    path: str | None  # the invariant GEMM's path (`invariant_gemm.PATHS`); None: not on it


class DecodeSlots(Protocol):
    """Where a decode-only batch's K/V goes and which blocks it reads
    (`common/models/attention.AttentionMetadata`)."""

    slot_mapping: torch.Tensor  # [T]
    decode_block_tables: torch.Tensor  # [T, max_blocks]
    decode_seq_lens: torch.Tensor  # [T]


@dataclass
class DenseLayer:
    """One decoder layer as the loop runs it: add + RMSNorm, qkv, rotary, paged attention,
    o_proj, add + RMSNorm, gate_up, SiLU-and-multiply, down."""

    input_norm: torch.Tensor
    qkv: PackedLinear
    o_proj: PackedLinear
    post_norm: torch.Tensor
    gate_up: PackedLinear
    down: PackedLinear


LINEARS = ("qkv", "o_proj", "gate_up", "down")


@dataclass
class LayerStack:
    """What the loop needs of a model's layers, gathered once at load time."""

    input_norms: list[torch.Tensor]
    qkv: object  # the extension's Dense
    o_proj: object
    post_norms: list[torch.Tensor]
    gate_up: object
    down: object
    isa: int


def switched_on(x: torch.Tensor) -> bool:
    """Whether this step may take the loop: no environment override sends any op of the
    layers elsewhere (the per-op path reads them at each call, so this reads them at each
    step)."""
    return (
        os.environ.get(LOOP_ENV, "1") != "0"
        and not os.environ.get(BACKEND_ENV)
        and fused_ops.extension_for(x) is not None
        and invariant_gemm.enabled()
    )


def stack_for(layers: list[DenseLayer], hidden: torch.Tensor) -> LayerStack | None:
    """A LayerStack for `layers` when the loop serves them: on CPU, every linear on one
    invariant-GEMM path with one width per kind, and the C++ norm and SiLU serving
    `hidden`'s dtype and widths (`hidden`: any rows of the model's activations). None
    otherwise (the per-op path)."""
    if not layers or hidden.device.type != "cpu":
        return None
    kinds = {kind: [getattr(layer, kind) for layer in layers] for kind in LINEARS}
    paths = {lin.path for group in kinds.values() for lin in group}
    if len(paths) != 1 or None in paths:
        return None
    widths = {kind: {lin.out_features for lin in group} for kind, group in kinds.items()}
    if any(len(w) != 1 for w in widths.values()):  # the loop takes one width per kind
        return None
    # The C++ norm takes rows of a multiple of 16, the SiLU of 32 (fused_ops._fast).
    inter2 = layers[0].gate_up.out_features
    if hidden.shape[-1] % 16 or inter2 % 32 or fused_ops.fast_kernels(hidden.dtype) is None:
        return None
    ext = load()
    if ext is None:
        return None

    def dense(kind: str) -> object:
        group = kinds[kind]
        weights, biases = [lin.weight for lin in group], [lin.bias for lin in group]
        return ext.Dense(weights, biases, next(iter(widths[kind])))

    return LayerStack(
        input_norms=[layer.input_norm for layer in layers],
        qkv=dense("qkv"),
        o_proj=dense("o_proj"),
        post_norms=[layer.post_norm for layer in layers],
        gate_up=dense("gate_up"),
        down=dense("down"),
        isa=invariant_gemm.PATHS.index(paths.pop()),
    )


def forward(
    stack: LayerStack,
    residual: torch.Tensor,
    final_norm: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: DecodeSlots,
    shape: tuple[int, int, int],
    scale: float,
    eps: float,
) -> torch.Tensor:
    """The final norm's output [T, hidden] for a decode-only batch whose embeddings are
    `residual`; `shape`: (heads, kv heads, head_dim)."""
    ext = load()
    assert ext is not None, "stack_for() returned a stack, so the extension is loaded"
    heads, kv_heads, head_dim = shape
    return ext.forward(
        residual, stack.input_norms, stack.qkv, stack.o_proj, stack.post_norms,
        stack.gate_up, stack.down, final_norm, stack.isa, positions, cos_sin, kv_cache,
        meta.slot_mapping.to(torch.long), meta.decode_block_tables.to(torch.int32),
        meta.decode_seq_lens.to(torch.int32), heads, kv_heads, head_dim, scale, eps,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(build_main(EXTENSION_NAME, [SOURCE]))
