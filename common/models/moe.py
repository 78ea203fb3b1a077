"""The feed-forward part of a decoder layer: a dense gated MLP, or a sparse
mixture-of-experts block (router, routed experts, optional shared expert).

The forward pass (`llama.py`) calls a layer's `mlp(x)` once per step on the flattened batch
after the post-attention norm. In an MoE block the router picks each token's top-k experts
and their weights with the family's own normalisation (`families.MoeSpec`), the routed
experts run through `pdserve.kernels.moe` (grouped by expert), and Qwen2-MoE's shared expert
adds `sigmoid(shared_gate(x)) * shared_expert(x)`. When expert counting is on, each block
adds its routing to an `ExpertTokenCounter` (one bincount per layer and step).

Under expert parallelism a block keeps only its rank's expert slots and its own `SlotMap`
(each layer is placed on its own); `replace_experts` re-places them between steps.

Weights come from the Hugging Face state dict in either layout: one tensor per expert and
projection (how checkpoints are published), or stacked `experts.gate_up_proj` [E, 2I, H] /
`experts.down_proj` [E, H, I]."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.common.errors import ModelLoadError
from pdserve.common.models.eplb import SlotMap
from pdserve.common.models.expert_parallel import (
    ExpertShard,
    TrafficCounter,
    ep_experts,
    move_experts,
)
from pdserve.common.models.expert_stats import ExpertTokenCounter
from pdserve.common.models.families import ModelFamily, MoeSpec, is_sparse_layer
from pdserve.common.models.linear import Linear
from pdserve.common.models.tensor_parallel import (
    RowParallel,
    TensorShard,
    all_gather,
    sum_in_rank_order,
)
from pdserve.kernels import fused_ops as fused
from pdserve.kernels import invariant_gemm
from pdserve.kernels import moe as moe_kernels
from pdserve.kernels.invariant_gemm import PackedStack
from pdserve.kernels.moe import Experts


class Take(Protocol):
    """A checkpoint tensor by name, on the model's device and dtype; `rows` / `cols`: only
    these rows of its first dimension / columns of its second (the rest never leave the
    memory-mapped checkpoint)."""

    def __call__(
        self, name: str, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None
    ) -> torch.Tensor: ...


@dataclass
class DenseMlp:
    gate_up: Linear  # gate and up fused: [2I, H] (tensor parallel: this rank's I/N of each)
    down: Linear | RowParallel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(fused.silu_and_mul(self.gate_up(x)))


@dataclass
class Router:
    """Router logits → top-k expert ids and weights, as the family computes them: softmax in
    float32 over all experts, top-k, optionally renormalised to sum to one, optionally cast
    back to the activation dtype."""

    weight: Linear  # [E, H]
    top_k: int
    renormalize: bool
    cast_weights: bool

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.weight(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.cast_weights:
            weights = weights.to(logits.dtype)
        return weights, ids


@dataclass
class SparseMoeBlock:
    layer: int
    router: Router
    w13: Experts  # [E, 2I, H]: each expert's gate then up projection
    w2: Experts  # [E, H, I]: each expert's down projection
    shared: DenseMlp | None = None
    shared_gate: Linear | None = None  # [1, H]
    counter: ExpertTokenCounter | None = None
    # Expert parallelism: w13 / w2 hold only this rank's slots of `slots` (loaded so).
    shard: ExpertShard | None = None
    slots: SlotMap | None = None
    traffic: TrafficCounter | None = None
    # Tensor parallelism: w13 / w2 hold experts `local` of the group's split; every rank
    # routes every token and runs the pairs of its experts, and the ranks' partial sums are
    # added in rank order (expert parallelism inside the tensor-parallel group, as vLLM's
    # --enable-expert-parallel).
    tp: TensorShard | None = None
    local: range | None = None

    @property
    def num_experts(self) -> int:
        return self.router.weight.out_features

    def replace_experts(self, slots: SlotMap) -> int:
        """Move to placement `slots` (all ranks together, between steps); returns the expert
        copies that crossed ranks."""
        assert self.shard is not None and self.slots is not None
        w13, w2, moved = move_experts(
            _data(self.w13), _data(self.w2), self.slots, slots, self.shard
        )
        self.w13, self.w2 = _rewrap(self.w13, w13), _rewrap(self.w2, w2)
        self.slots = slots
        return moved

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        if self.counter is not None:
            self.counter.add(self.layer, ids)
        if self.shard is not None:
            out = ep_experts(
                x, weights, ids, self.w13, self.w2, self.shard, self.traffic, self.slots
            )
        elif self.tp is not None:
            out = self._tp_experts(x, weights, ids)
        else:
            out = moe_kernels.experts(x, self.w13, self.w2, weights, ids)
        if self.shared is not None:
            assert self.shared_gate is not None
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out

    def _tp_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's experts' share of Σ_k weight · expert_k(x) for every token, summed
        over the ranks (float32, rank order, one rounding)."""
        assert self.tp is not None and self.local is not None
        num_tokens = x.shape[0]
        sorted_ = moe_kernels.sort_by_expert(ids, self.num_experts)
        rows = x.index_select(0, sorted_.tokens)
        first = sum(sorted_.counts[: self.local.start])
        last = first + sum(sorted_.counts[self.local.start : self.local.stop])
        out = torch.zeros_like(rows)
        if last > first:
            out[first:last] = moe_kernels.expert_mlps(
                rows[first:last], sorted_.counts[self.local.start : self.local.stop],
                self.w13, self.w2,
            )  # fmt: skip
        partial = moe_kernels.combine(out, sorted_, weights, num_tokens).float()
        return sum_in_rank_order(all_gather(partial, self.tp)).to(x.dtype)


Mlp = DenseMlp | SparseMoeBlock


def _pack_experts(weights: torch.Tensor) -> Experts:
    """On CPU the experts are packed for the batch-invariant kernel, like every Linear."""
    path = invariant_gemm.path_for(weights)
    return weights if path is None else PackedStack.of(weights, path)


def _data(w: Experts) -> torch.Tensor:
    return w.data if isinstance(w, PackedStack) else w


def _rewrap(old: Experts, data: torch.Tensor) -> Experts:
    return old.with_data(data) if isinstance(old, PackedStack) else data


def load_dense_mlp(take: Take, prefix: str, tp: TensorShard | None = None) -> DenseMlp:
    """gate_proj / up_proj / down_proj under `prefix` (e.g. "model.layers.3.mlp."); with
    tensor parallelism (`tp`) this rank's rows of gate and up, and down's matching columns."""
    if tp is None:
        gate_up = torch.cat([take(prefix + "gate_proj.weight"), take(prefix + "up_proj.weight")])
        return DenseMlp(gate_up=Linear(gate_up), down=Linear(take(prefix + "down_proj.weight")))
    down_name = prefix + "down_proj.weight"
    rows = tp.split(_columns(take, down_name))
    index = torch.arange(rows.start, rows.stop)
    gate_up = torch.cat(
        [take(prefix + "gate_proj.weight", index), take(prefix + "up_proj.weight", index)]
    )
    return DenseMlp(
        gate_up=Linear(gate_up), down=RowParallel(take(down_name, cols=index), None, tp)
    )


def _columns(take: Take, name: str) -> int:
    return take(name, rows=torch.arange(1)).shape[1]


def load_mlp(
    config: Any,
    family: ModelFamily,
    layer: int,
    take: Take,
    names: Mapping[str, object],
    shard: ExpertShard | None = None,
    tp: TensorShard | None = None,
) -> Mlp:
    """The feed-forward part of decoder layer `layer`; `names` is the state dict (for which
    keys exist). With expert parallelism (`shard`) an MoE block loads only the experts of
    this rank's slots: a rank never holds the whole expert set, not even while loading."""
    p = f"model.layers.{layer}."
    if not is_sparse_layer(config, family, layer):
        return load_dense_mlp(take, p + "mlp.", tp)
    spec = family.moe
    assert spec is not None
    block = p + spec.block + "."
    renormalize = spec.always_renormalize or bool(getattr(config, "norm_topk_prob", False))
    slots = shard.initial_slots() if shard is not None else None
    experts = shard.local_experts(slots) if shard is not None else None
    local = None
    if tp is not None:
        local = tp.split(getattr(config, spec.num_experts_attr))
        experts = torch.arange(local.start, local.stop)
    w13, w2 = _load_experts(config, spec, block, take, names, experts)
    moe = SparseMoeBlock(
        layer=layer,
        router=Router(
            Linear(take(block + "gate.weight")),
            top_k=config.num_experts_per_tok,
            renormalize=renormalize,
            cast_weights=spec.cast_weights,
        ),
        w13=_pack_experts(w13),
        w2=_pack_experts(w2),
        shard=shard,
        slots=slots,
        tp=tp,
        local=local,
    )
    if spec.shared_expert:
        moe.shared = load_dense_mlp(take, block + "shared_expert.", tp)
        moe.shared_gate = Linear(take(block + "shared_expert_gate.weight"))
    return moe


def _load_experts(
    config: Any,
    spec: MoeSpec,
    block: str,
    take: Take,
    names: Mapping[str, object],
    experts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[X, 2I, H] and [X, H, I] for the experts `experts` (in that order; None: all E)."""
    num_experts = getattr(config, spec.num_experts_attr)
    stacked = block + "experts.gate_up_proj"
    if stacked in names:
        down = block + "experts.down_proj"
        if experts is None:
            w13, w2 = take(stacked), take(down)
        else:
            w13, w2 = take(stacked, experts), take(down, experts)
    else:
        e = block + "experts.{}."
        missing = e.format(0) + spec.gate_name + ".weight"
        if missing not in names:
            raise ModelLoadError(f"model: weights of {block}experts not found (no {missing})")
        ids = range(num_experts) if experts is None else experts.tolist()
        w13 = torch.stack([
            torch.cat([take(e.format(i) + f"{spec.gate_name}.weight"),
                       take(e.format(i) + f"{spec.up_name}.weight")])
            for i in ids
        ])  # fmt: skip
        w2 = torch.stack([take(e.format(i) + f"{spec.down_name}.weight") for i in ids])
    inter = getattr(config, spec.intermediate_attr)
    count = num_experts if experts is None else len(experts)
    expected = (count, 2 * inter, config.hidden_size)
    if tuple(w13.shape) != expected or tuple(w2.shape) != (count, config.hidden_size, inter):
        raise ModelLoadError(
            f"model: {block}experts has shape {tuple(w13.shape)} / {tuple(w2.shape)}, "
            f"expected {expected} / {(count, config.hidden_size, inter)} from the config"
        )
    return w13.contiguous(), w2.contiguous()
