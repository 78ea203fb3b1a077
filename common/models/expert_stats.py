"""Tokens routed to each expert of each MoE layer, counted as the engine runs.

When `EngineConfig.count_expert_tokens` is on, every MoE block adds one bincount of its
step's top-k expert ids to this counter (on the model's device, no synchronisation), so the
metrics endpoint can later export `pdserve_moe_expert_tokens_total{layer, expert}` and an
imbalance gauge, and expert placement can be rebalanced from what was seen. Off by default:
the MoE blocks then skip it entirely."""

from __future__ import annotations

import torch


class ExpertTokenCounter:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device) -> None:
        # Rows of dense layers stay zero: rows are indexed by the decoder layer's own index.
        self.counts = torch.zeros((num_layers, num_experts), dtype=torch.int64, device=device)

    def add(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count one step's routing of layer `layer`: topk_ids [T, K]."""
        self.counts[layer] += torch.bincount(topk_ids.reshape(-1), minlength=self.counts.shape[1])

    def snapshot(self) -> torch.Tensor:
        """A copy of the counts so far on the CPU, [num_layers, num_experts] int64."""
        return self.counts.detach().to("cpu", copy=True)

    def reset(self) -> None:
        self.counts.zero_()


def rank_loads(expert_counts: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Tokens each rank would process if the experts were split over `num_ranks` ranks in
    contiguous equal shares (rank r holds experts [r·E/N, (r+1)·E/N)): [..., num_ranks]."""
    num_experts = expert_counts.shape[-1]
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"num_ranks: must divide the {num_experts} experts, got {num_ranks}")
    return expert_counts.reshape(*expert_counts.shape[:-1], num_ranks, -1).sum(dim=-1)


def imbalance(expert_counts: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Per layer, the busiest rank's load over the mean rank load (1.0 is perfect balance;
    also 1.0 for a layer with no tokens). expert_counts [E] or [L, E] → [] or [L] float64.
    `num_ranks=num_experts` measures the experts themselves."""
    loads = rank_loads(expert_counts, num_ranks).double()
    mean = loads.mean(dim=-1)
    ratio = loads.amax(dim=-1) / mean.clamp(min=1e-30)
    return torch.where(mean > 0, ratio, torch.ones_like(ratio))
