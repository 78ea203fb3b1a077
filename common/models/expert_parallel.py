"""Expert parallelism: the routed experts of every MoE layer split over N ranks, each rank
running attention for its own tokens (data-parallel attention) and exchanging token rows
with the others at each MoE layer.

A rank holds experts [rank·E/N, (rank+1)·E/N) (`ExpertShard`). At each MoE layer
`ep_experts` sorts its tokens' (token, expert) pairs by expert — which also groups them by
the rank that holds the expert — and then:

1. exchanges the per-expert row counts (all-to-all of N×E/N integers);
2. **dispatch**: sends each rank the hidden states of the rows for its experts
   (all-to-all with uneven splits);
3. runs the received rows through its local experts, one matmul pair per expert
   (`pdserve.kernels.moe.expert_mlps`), after reordering them from source-major to
   expert-major;
4. **combine**: sends the results back the same way, and weights and sums each token's top-k
   rows locally (`pdserve.kernels.moe.combine`).

Every rank must call it for every MoE layer of every step, in the same order, also with no
tokens (an idle rank joins with an empty batch), or the others wait. The collectives are
`torch.distributed`'s: gloo for CPU tensors, NCCL for CUDA tensors, the same code.
`init_group` joins a rank to its group; `lockstep_busy` is the once-per-step agreement on
whether any rank still has work (an idle rank then runs `idle_forward`)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from pdserve.kernels.moe import combine, expert_mlps, sort_by_expert


@dataclass(frozen=True)
class ExpertShard:
    rank: int
    world_size: int
    num_experts: int
    group: dist.ProcessGroup | None = None  # None: the default group

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.num_experts % self.world_size:
            raise ValueError(
                f"expert_parallel: must divide the number of experts ({self.num_experts}), "
                f"got {self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: must be in [0, {self.world_size}), got {self.rank}")

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def first_expert(self) -> int:
        return self.rank * self.experts_per_rank

    def local(self, stacked: Tensor) -> Tensor:
        """This rank's experts of a stacked [E, ...] weight, as its own contiguous copy (so
        the full tensor can be freed)."""
        start = self.first_expert
        return stacked[start : start + self.experts_per_rank].clone()


@dataclass
class TrafficCounter:
    """Rows this rank sent to other ranks (dispatch; combine sends as many back)."""

    rows_sent: int = 0
    rows_kept: int = 0


def _expert_major(recv_counts: Tensor) -> Tensor:
    """Received rows arrive source-major (all of rank 0's rows, expert by expert, then rank
    1's, ...); the index that reorders them expert-major. recv_counts [N, L]."""
    num_sources, num_local = recv_counts.shape
    flat = recv_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where each (source, expert) block starts
    blocks = torch.arange(num_sources * num_local).view(num_sources, num_local).t().reshape(-1)
    sizes = flat[blocks]
    first = torch.repeat_interleave(starts[blocks], sizes)
    within = torch.arange(int(sizes.sum())) - torch.repeat_interleave(
        torch.cumsum(sizes, 0) - sizes, sizes
    )
    return first + within


def ep_experts(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    local_w13: Tensor,
    local_w2: Tensor,
    shard: ExpertShard,
    traffic: TrafficCounter | None = None,
) -> Tensor:
    """This rank's tokens x [T, H] (T may be 0) through their top-k experts wherever they
    live: [T, H]. local_w13 [E/N, 2I, H], local_w2 [E/N, H, I] are this rank's experts."""
    num_tokens, hidden = x.shape
    n, per_rank = shard.world_size, shard.experts_per_rank
    device = x.device
    sorted_ = sort_by_expert(topk_ids, shard.num_experts)
    send_rows = x.index_select(0, sorted_.tokens)
    send_counts = torch.tensor(sorted_.counts, dtype=torch.int64, device=device).view(n, per_rank)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=shard.group)
    send_splits = send_counts.sum(dim=1).tolist()
    recv_counts = recv_counts.cpu()
    recv_splits = recv_counts.sum(dim=1).tolist()

    recv_rows = x.new_empty((sum(recv_splits), hidden))
    dist.all_to_all_single(recv_rows, send_rows, recv_splits, send_splits, group=shard.group)
    order = _expert_major(recv_counts).to(device)
    local_out = expert_mlps(
        recv_rows.index_select(0, order), recv_counts.sum(dim=0).tolist(), local_w13, local_w2
    )
    back = torch.empty_like(local_out)
    back[order] = local_out
    returned = x.new_empty((send_rows.shape[0], hidden))
    dist.all_to_all_single(returned, back, send_splits, recv_splits, group=shard.group)
    if traffic is not None:
        kept = send_splits[shard.rank]
        traffic.rows_kept += kept
        traffic.rows_sent += sum(send_splits) - kept
    return combine(returned, sorted_, topk_weights, num_tokens)


def init_group(rank: int, world_size: int, address: str, device: str, timeout_s: float) -> None:
    """Join the expert-parallel group at `address` (host:port of rank 0's store): gloo for
    CPU, NCCL for CUDA. A collective that waits longer than `timeout_s` (a rank died or
    hangs) raises instead of waiting forever."""
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def lockstep_busy(busy: bool, device: torch.device) -> bool:
    """Whether any rank of the group has work this step (every rank calls it once per
    step; all get the same answer)."""
    flag = torch.tensor([1 if busy else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
