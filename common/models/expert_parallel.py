"""Expert parallelism: the routed experts of every MoE layer split over N ranks, each rank
running attention for its own tokens (data-parallel attention) and exchanging token rows
with the others at each MoE layer.

Each MoE layer has E+K physical expert slots, P = (E+K)/N per rank (`ExpertShard`); rank r
holds slots [r·P, (r+1)·P), and the layer's `SlotMap` (`eplb.py`) says which expert each slot
holds. Without redundant experts (K = 0) slot e is expert e: rank r holds experts
[r·E/N, (r+1)·E/N). With K > 0 the hottest experts have copies, and an expert's (token,
expert) pairs are spread over its copies (`SlotMap.route`). At each MoE layer `ep_experts`
sorts its tokens' (token, slot) pairs by slot — which also groups them by the rank that
holds the slot — and then:

1. exchanges the per-slot row counts (all-to-all of N×P integers);
2. **dispatch**: sends each rank the hidden states of the rows for its slots
   (all-to-all with uneven splits);
3. runs the received rows through its local experts, one matmul pair per slot
   (`pdserve.kernels.moe.expert_mlps`), after reordering them from source-major to
   slot-major;
4. **combine**: sends the results back the same way, and weights and sums each token's top-k
   rows locally (`pdserve.kernels.moe.combine`).

A copy holds the same weights as the original, so where a pair runs changes no number.
`move_experts` re-places a layer's slots between steps (every rank computes the same new
`SlotMap`; the weights of slots that change rank travel by one all-to-all per tensor).

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

from pdserve.common.models.eplb import SlotMap, initial_slot_expert
from pdserve.kernels.moe import combine, expert_mlps, sort_by_expert


@dataclass(frozen=True)
class ExpertShard:
    """This rank's place in the group: E experts (plus `redundant` = K copies) in E+K slots,
    (E+K)/N per rank."""

    rank: int
    world_size: int
    num_experts: int
    group: dist.ProcessGroup | None = None  # None: the default group
    redundant: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.num_experts % self.world_size:
            raise ValueError(
                f"expert_parallel: must divide the number of experts ({self.num_experts}), "
                f"got {self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: must be in [0, {self.world_size}), got {self.rank}")
        if self.redundant < 0 or self.redundant % self.world_size:
            raise ValueError(
                f"redundant_experts: must be a multiple of {self.world_size}, got {self.redundant}"
            )

    @property
    def slots_per_rank(self) -> int:
        return (self.num_experts + self.redundant) // self.world_size

    @property
    def num_slots(self) -> int:
        return self.num_experts + self.redundant

    def initial_slots(self) -> SlotMap:
        """The placement at load (`eplb.initial_slot_expert`)."""
        slots = initial_slot_expert(self.num_experts, self.world_size, self.redundant)
        return SlotMap.of(slots, self.num_experts)

    def local_experts(self, slots: SlotMap | None = None) -> Tensor:
        """The expert in each of this rank's slots (default: the placement at load): [P]."""
        slots = slots or self.initial_slots()
        p = self.slots_per_rank
        return slots.slot_expert[self.rank * p : (self.rank + 1) * p]

    def local(self, stacked: Tensor, slots: SlotMap | None = None) -> Tensor:
        """The experts in this rank's slots of a stacked [E, ...] weight, as its own copy
        (so the full tensor can be freed): [P, ...]."""
        return stacked.index_select(0, self.local_experts(slots).to(stacked.device))


@dataclass
class TrafficCounter:
    """Rows this rank sent to other ranks (dispatch; combine sends as many back), kept,
    and ran through its own experts; bytes that left the rank (dispatch and combine)."""

    rows_sent: int = 0
    rows_kept: int = 0
    rows_computed: int = 0
    bytes_sent: int = 0


def _expert_major(recv_counts: Tensor) -> Tensor:
    """Received rows arrive source-major (all of rank 0's rows, slot by slot, then rank
    1's, ...); the index that reorders them slot-major. recv_counts [N, P]."""
    num_sources, num_local = recv_counts.shape
    flat = recv_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where each (source, slot) block starts
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
    slots: SlotMap | None = None,
) -> Tensor:
    """This rank's tokens x [T, H] (T may be 0) through their top-k experts wherever they
    live: [T, H]. local_w13 [P, 2I, H], local_w2 [P, H, I] are this rank's slots' experts
    under `slots` (None: slot e is expert e, only without redundant experts)."""
    num_tokens, hidden = x.shape
    n, per_rank = shard.world_size, shard.slots_per_rank
    device = x.device
    if slots is None and shard.redundant:
        raise ValueError("ep_experts: redundant experts need the layer's SlotMap")
    slot_ids = topk_ids if slots is None else slots.route(topk_ids, shard.rank)
    sorted_ = sort_by_expert(slot_ids, shard.num_slots)
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
        traffic.rows_computed += sum(recv_splits)
        off_rank = sum(send_splits) + sum(recv_splits) - 2 * kept
        traffic.bytes_sent += off_rank * hidden * x.element_size()
    return combine(returned, sorted_, topk_weights, num_tokens)


def move_experts(
    w13: Tensor, w2: Tensor, old: SlotMap, new: SlotMap, shard: ExpertShard
) -> tuple[Tensor, Tensor, int]:
    """Re-place one layer's slots from `old` to `new` between steps: every rank calls it
    with the same maps. A slot whose expert this rank already holds is copied locally; any
    other comes from the lowest rank that held it, all of them in one all-to-all per weight
    tensor (none when nothing crosses ranks). Returns this rank's new local w13 and w2 and
    the number of expert copies that crossed ranks in the whole group."""
    n, p, me = shard.world_size, shard.slots_per_rank, shard.rank
    before = old.slot_expert.view(n, p).tolist()
    after = new.slot_expert.view(n, p).tolist()
    if before == after:
        return w13, w2, 0
    plan: list[list[tuple[int, int]]] = []  # per rank, per new slot: (source rank, its slot)
    for d in range(n):
        sources = []
        for e in after[d]:
            src = d if e in before[d] else min(r for r in range(n) if e in before[r])
            sources.append((src, before[src].index(e)))
        plan.append(sources)
    moved = sum(src != d for d in range(n) for src, _ in plan[d])
    send_index: list[int] = []
    send_splits: list[int] = []
    for d in range(n):
        rows = [i for src, i in plan[d] if src == me] if d != me else []
        send_index += rows
        send_splits.append(len(rows))
    recv_splits = [sum(src == s for src, _ in plan[me]) if s != me else 0 for s in range(n)]
    offsets = [sum(recv_splits[:s]) for s in range(n)]
    out = []
    for w in (w13, w2):
        recv = w.new_empty((sum(recv_splits), *w.shape[1:]))
        if moved:
            send = w.index_select(0, torch.tensor(send_index, dtype=torch.int64, device=w.device))
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=shard.group)
        fresh = torch.empty_like(w)
        seen = [0] * n
        for i, (src, j) in enumerate(plan[me]):
            if src == me:
                fresh[i] = w[j]
            else:
                fresh[i] = recv[offsets[src] + seen[src]]
                seen[src] += 1
        out.append(fresh)
    return out[0], out[1], moved


def master_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on a loopback port the bind itself picks
    (`.port`): a port chosen first and bound later can be taken by another process in
    between (seen in CI: EADDRINUSE while two groups started side by side)."""
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
    )  # fmt: skip


def init_group(
    rank: int,
    world_size: int,
    address: str,
    device: str,
    timeout_s: float,
    store: dist.TCPStore | None = None,
) -> None:
    """Join the group whose store is at `address` (host:port; rank 0 passes the `store` it
    opened with `master_store`, or hosts one at `address` itself): gloo for CPU, NCCL for
    CUDA. A collective that waits longer than `timeout_s` (a rank died or hangs) raises
    instead of waiting forever."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL's object collectives use the current device
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(
            host, int(port), world_size, is_master=rank == 0, timeout=timeout,
            wait_for_workers=False,
        )  # fmt: skip
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def lockstep_busy(busy: bool, device: torch.device) -> bool:
    """Whether any rank of the group has work this step (every rank calls it once per
    step; all get the same answer)."""
    flag = torch.tensor([1 if busy else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
