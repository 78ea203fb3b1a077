"""The routed experts of a mixture-of-experts layer: every token's hidden state through its
top-k experts' gated MLPs, weighted by its router weights and summed.

Each MoE layer of the model calls `experts` once per step with the whole flattened batch.
The fused path groups the (token, expert) assignments by expert with one stable sort, runs
one gate/up matmul and one down matmul per expert that has tokens (no Python loop over
tokens), then weights the results and scatters them back to their tokens. The same three
pieces (`sort_by_expert`, `expert_mlps`, `combine`) are what expert parallelism splits
between a dispatch and a combine across ranks. `pdserve.kernels.reference.moe_experts` is
the per-token loop it is tested against; ``PDSERVE_MOE_BACKEND=reference`` forces that loop
(debugging only: it is slow).

Device and dtype are the tensors' own: the same code runs on CPU and GPU in float32,
bfloat16 and float16."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from pdserve.kernels import invariant_gemm, reference
from pdserve.kernels.fused_ops import silu_and_mul
from pdserve.kernels.invariant_gemm import PackedStack

# A layer's expert weights: the stacked tensor [E, N, K], or the same packed for the
# batch-invariant CPU kernel (what the model runner loads on CPU).
Experts = Tensor | PackedStack

BACKEND_ENV = "PDSERVE_MOE_BACKEND"


class ExpertOrder(NamedTuple):
    """The batch's (token, expert) assignments sorted by expert."""

    order: Tensor  # [T * K] int64: flat assignment index (token * K + k) of each sorted row
    tokens: Tensor  # [T * K] int64: the token of each sorted row
    counts: list[int]  # [E]: rows per expert, in expert order


def sort_by_expert(topk_ids: Tensor, num_experts: int) -> ExpertOrder:
    """Group assignments by expert; within an expert, tokens keep their batch order."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertOrder(order, order // topk_ids.shape[1], counts)


def _expert_linear(x: Tensor, w: Experts, e: int) -> Tensor:
    if isinstance(w, PackedStack):
        return w.linear(e, x)
    gpu = invariant_gemm.gpu_kernels(x)
    return F.linear(x, w[e]) if gpu is None else gpu.linear(x, w[e])


def expert_mlps(
    rows: Tensor, counts: list[int], w13: Experts, w2: Experts, first_expert: int = 0
) -> Tensor:
    """Run rows [N, H], grouped by expert (`counts[i]` rows for expert `first_expert + i`),
    through their expert's gated MLP: down(silu(gate(x)) * up(x)). w13 [E, 2I, H] holds
    gate then up; w2 [E, H, I]. One pair of matmuls per expert with rows."""
    out = torch.empty_like(rows)
    start = 0
    for i, n in enumerate(counts):
        if n == 0:
            continue
        end = start + n
        e = first_expert + i
        gate_up = _expert_linear(rows[start:end], w13, e)
        out[start:end] = _expert_linear(silu_and_mul(gate_up), w2, e)
        start = end
    return out


def combine(
    expert_out: Tensor, sorted_: ExpertOrder, topk_weights: Tensor, num_tokens: int
) -> Tensor:
    """Weight each sorted row by its router weight and sum each token's K rows: [T, H]."""
    top_k = topk_weights.shape[1]
    weights = topk_weights.reshape(-1)[sorted_.order].unsqueeze(1)
    # Weighted in the weights' dtype (float32 for families that keep it), rounded once.
    weighted = (expert_out * weights).to(expert_out.dtype)
    unsorted = torch.empty_like(weighted)
    unsorted[sorted_.order] = weighted
    # Summed k = 0, 1, ... in that order for every token, whatever the batch.
    per_token = unsorted.view(num_tokens, top_k, expert_out.shape[-1])
    out = per_token[:, 0].clone()
    for k in range(1, top_k):
        out += per_token[:, k]
    return out


def fused_experts(
    x: Tensor, w13: Experts, w2: Experts, topk_weights: Tensor, topk_ids: Tensor
) -> Tensor:
    """x [T, H]; topk_weights / topk_ids [T, K] → Σ_k weight · expert_k(x), [T, H]."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return torch.empty_like(x)
    sorted_ = sort_by_expert(topk_ids, w13.shape[0])
    rows = x.index_select(0, sorted_.tokens)
    return combine(expert_mlps(rows, sorted_.counts, w13, w2), sorted_, topk_weights, num_tokens)


def experts(x: Tensor, w13: Experts, w2: Experts, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """The entry point the model calls: the fused path unless the reference is forced."""
    if os.environ.get(BACKEND_ENV, "fused") == "reference":
        return reference.moe_experts(x, w13, w2, topk_weights, topk_ids).to(x.dtype)
    return fused_experts(x, w13, w2, topk_weights, topk_ids)
