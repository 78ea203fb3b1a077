"""Keeping an expert-parallel group's ranks evenly loaded, between steps.

Every rank calls `ExpertBalancer.after_step` once per lockstep iteration (the model runner's
`rebalance_experts_if_due`). Every `eplb_interval` forwards — a count equal on all ranks —
the ranks all-reduce the tokens their routers sent to each expert since the last time. With
redundant experts (`--redundant-experts K`) they then all compute the same new placement
of the E+K expert slots (`eplb.rebalance`, on a smoothed load and only for a clear gain)
and move the weights of the slots that change rank (`SparseMoeBlock.replace_experts`). No
request or KV block is touched: it happens between two steps.

`imbalance` reads the group-wide loads of the last window under the current placement
without any collective, so the metrics thread may call it at any time. `traffic` counts
the rows and bytes this rank's MoE layers exchanged."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pdserve.common.models import eplb
from pdserve.common.models.expert_parallel import TrafficCounter

if TYPE_CHECKING:
    from pdserve.common.config import EngineConfig
    from pdserve.common.models.moe import SparseMoeBlock

logger = logging.getLogger(__name__)

# Weight of a window's counts in the next one's load estimate (about the last four windows
# count), and the least drop of the busiest rank's load, as a fraction of the mean, worth
# moving weights for: a noisy window of a few steps must not move gigabytes back and forth.
LOAD_DECAY = 0.75
MIN_PLACEMENT_GAIN = 0.05


class ExpertBalancer:
    def __init__(self, blocks: list[SparseMoeBlock], config: EngineConfig) -> None:
        self.blocks = blocks
        self.layers = [b.layer for b in blocks]
        self.ranks = config.expert_parallel
        self.redundant = config.redundant_experts
        self.interval = config.eplb_interval
        self.next_due = config.eplb_interval
        self.traffic = TrafficCounter()
        for block in blocks:
            block.traffic = self.traffic
        self.rebalances = 0
        self.experts_moved = 0
        self._counted: torch.Tensor | None = None  # the counts at the last all-reduce
        self._load_estimate: torch.Tensor | None = None  # [MoE layers, E] float64, smoothed
        # What `imbalance` reads: the last window's group-wide loads and the placement then,
        # replaced in one assignment so a reader sees the old pair or the new one.
        self._view: tuple[torch.Tensor, torch.Tensor] | None = None

    def after_step(self, num_forwards: int, counts: torch.Tensor) -> None:
        """`counts`: this rank's running [num_layers, E] expert token counts. A collective
        every `interval` forwards (all ranks call it with the same `num_forwards`)."""
        if num_forwards < self.next_due:
            return
        self.next_due = num_forwards + self.interval
        import torch.distributed as dist

        counts = counts.clone()
        window = counts - self._counted if self._counted is not None else counts.clone()
        self._counted = counts
        dist.all_reduce(window)
        loads = window.cpu()[self.layers]
        if self.redundant > 0:
            self._replace(loads, num_forwards)
        self._view = (loads, self._placement())

    def _replace(self, loads: torch.Tensor, num_forwards: int) -> None:
        smooth = loads.double()
        if self._load_estimate is not None:
            smooth += LOAD_DECAY * self._load_estimate
        self._load_estimate = smooth
        previous = self._placement()
        placement = eplb.rebalance(smooth, self.ranks, previous, min_gain=MIN_PLACEMENT_GAIN)
        moved = sum(
            b.replace_experts(eplb.SlotMap.of(placement[i], b.num_experts))
            for i, b in enumerate(self.blocks)
        )
        self.rebalances += 1
        self.experts_moved += moved
        logger.info(
            "expert placement %d at forward %d: %d expert copies moved between ranks; "
            "imbalance on the last %d forwards' load %.3f -> %.3f (mean of MoE layers)",
            self.rebalances, num_forwards, moved, self.interval,
            float(eplb.imbalance(loads, previous, self.ranks).mean()),
            float(eplb.imbalance(loads, placement, self.ranks).mean()),
        )  # fmt: skip

    def _placement(self) -> torch.Tensor:
        """Each MoE layer's slot → expert map [MoE layers, slots]."""
        return torch.stack([
            b.slots.slot_expert if b.slots is not None else torch.arange(b.num_experts)
            for b in self.blocks
        ])  # fmt: skip

    def imbalance(self, counts: torch.Tensor) -> torch.Tensor:
        """Per layer of `counts` [num_layers, E] ([num_layers] float64, 1.0 for dense
        layers): the busiest rank's tokens over the mean rank's under the current placement.
        Under expert parallelism, the whole group's over the last window as of the last
        all-reduce; `counts` (this process's own) until then."""
        out = torch.ones(counts.shape[0], dtype=torch.float64)
        if not self.layers:
            return out
        if self._view is not None:
            loads, placement = self._view
        else:
            loads, placement = counts[self.layers], self._placement()
        out[self.layers] = eplb.imbalance(loads, placement, self.ranks)
        return out
