"""Expert placement for expert parallelism with redundant experts, after DeepSeek's EPLB:
from the tokens each expert of each MoE layer received, which experts get the K extra
copies and which rank holds each of the E+K physical expert slots.

Slots are rank-major: rank r holds slots [r·P, (r+1)·P), P = (E+K)/N. Every rank runs this
same deterministic code (Python floats, fixed tie-breaks) on the same all-reduced counts and
gets the same placement, so no placement is ever sent.

- `replicate`: one copy per expert, then each extra copy to the expert with the highest load
  per copy (an expert already on every rank gets no more);
- `pack`: the copies, heaviest (load / copies) first, each to the least loaded rank with a
  free slot that does not yet hold that expert; the packs are then matched to the ranks and
  slots that held the same experts before, so that as few weights as possible move;
- `rebalance`: both, per layer, keeping the previous placement of a layer unless the new one
  lowers its busiest rank's load by more than a margin;
- `SlotMap`: one layer's placement as the dispatch uses it (slot → expert, expert → its
  slots), and `route`, which spreads an expert's (token, expert) pairs over its copies."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def initial_slot_expert(num_experts: int, num_ranks: int, redundant: int) -> Tensor:
    """The placement at load, [E+K]: rank r holds experts [r·E/N, (r+1)·E/N) (the placement
    without copies) and, in its K/N extra slots, copies of the first experts of rank r+1."""
    per_rank, extra = num_experts // num_ranks, redundant // num_ranks
    slots: list[int] = []
    for r in range(num_ranks):
        slots += range(r * per_rank, (r + 1) * per_rank)
        nxt = (r + 1) % num_ranks * per_rank
        slots += [(nxt + j) % num_experts for j in range(extra)]
    return torch.tensor(slots, dtype=torch.int64)


def replicate(loads: Tensor, num_slots: int, max_copies: int) -> Tensor:
    """Copies of each expert, [E] int64 summing to num_slots: every expert one, then each
    extra slot to the expert with the most load per copy (ties: lowest id) among those with
    fewer than max_copies. loads [E]."""
    load = loads.double().tolist()
    copies = [1] * len(load)
    for _ in range(num_slots - len(load)):
        best, best_value = -1, -1.0
        for e, (w, c) in enumerate(zip(load, copies, strict=True)):
            if c < max_copies and w / c > best_value:
                best, best_value = e, w / c
        copies[best] += 1
    return torch.tensor(copies, dtype=torch.int64)


def pack(loads: Tensor, copies: Tensor, num_ranks: int, previous: Tensor | None) -> Tensor:
    """Place every copy in a slot: slot → expert [N·P], rank-major. Heaviest copy first, to
    the least loaded rank (ties: lowest rank) with a free slot, preferring ranks that do not
    hold the expert yet. Then each pack goes to the rank whose `previous` slots share most of
    its experts, and within a rank an expert keeps its previous slot."""
    load, count = loads.double().tolist(), copies.tolist()
    per_rank = sum(count) // num_ranks
    items = sorted(
        ((load[e] / count[e], e) for e in range(len(load)) for _ in range(count[e])),
        key=lambda item: (-item[0], item[1]),
    )
    packs: list[list[int]] = [[] for _ in range(num_ranks)]
    pack_load = [0.0] * num_ranks
    for w, e in items:
        free = [r for r in range(num_ranks) if len(packs[r]) < per_rank]
        fresh = [r for r in free if e not in packs[r]] or free
        r = min(fresh, key=lambda r: (pack_load[r], r))
        packs[r].append(e)
        pack_load[r] += w
    if previous is None:
        return torch.tensor([e for p in packs for e in sorted(p)], dtype=torch.int64)
    old = previous.view(num_ranks, per_rank).tolist()
    rank_of = _match_packs(packs, old)
    slots = [0] * (num_ranks * per_rank)
    for i, experts in enumerate(packs):
        r = rank_of[i]
        slots[r * per_rank : (r + 1) * per_rank] = _keep_positions(experts, old[r])
    return torch.tensor(slots, dtype=torch.int64)


def _match_packs(packs: list[list[int]], old: list[list[int]]) -> list[int]:
    """Greedy matching of packs to ranks by the number of experts they share (ties: lowest
    pack, then lowest rank): pack i → rank."""
    n = len(packs)
    overlap = [[_shared(packs[i], old[r]) for r in range(n)] for i in range(n)]
    pairs = sorted((-overlap[i][r], i, r) for i in range(n) for r in range(n))
    rank_of, taken = [-1] * n, set()
    for _, i, r in pairs:
        if rank_of[i] < 0 and r not in taken:
            rank_of[i] = r
            taken.add(r)
    return rank_of


def _shared(a: list[int], b: list[int]) -> int:
    rest = list(b)
    n = 0
    for e in a:
        if e in rest:
            rest.remove(e)
            n += 1
    return n


def _keep_positions(experts: list[int], old: list[int]) -> list[int]:
    """Order a rank's experts so that each one found in `old` keeps its slot there."""
    placed: list[int | None] = [None] * len(old)
    rest = sorted(experts)
    for pos, e in enumerate(old):
        if e in rest:
            placed[pos] = e
            rest.remove(e)
    it = iter(rest)
    return [e if e is not None else next(it) for e in placed]


def rank_loads(loads: Tensor, slot_expert: Tensor, num_ranks: int) -> Tensor:
    """Tokens each rank runs through its experts under a placement, an expert's load split
    evenly over its copies: loads [..., E], slot_expert [..., S] → [..., N] float64."""
    loads = loads.double()
    copies = torch.zeros_like(loads).scatter_add_(
        -1, slot_expert, torch.ones_like(slot_expert, dtype=torch.float64)
    )
    per_slot = loads.gather(-1, slot_expert) / copies.gather(-1, slot_expert)
    return per_slot.reshape(*per_slot.shape[:-1], num_ranks, -1).sum(dim=-1)


def imbalance(loads: Tensor, slot_expert: Tensor, num_ranks: int) -> Tensor:
    """Busiest rank's load over the mean under a placement (1.0 for no load): [...]."""
    per_rank = rank_loads(loads, slot_expert, num_ranks)
    mean = per_rank.mean(dim=-1)
    ratio = per_rank.amax(dim=-1) / mean.clamp(min=1e-30)
    return torch.where(mean > 0, ratio, torch.ones_like(ratio))


def rebalance(loads: Tensor, num_ranks: int, previous: Tensor, min_gain: float = 0.0) -> Tensor:
    """A new placement per layer: loads [L, E], previous [L, S] → [L, S]. A layer keeps its
    previous placement when it saw no tokens or the new one would not lower its busiest
    rank's load by more than `min_gain` of the mean rank load (moving weights costs)."""
    num_slots = previous.shape[-1]
    out = previous.clone()
    for layer in range(loads.shape[0]):
        load, old = loads[layer], previous[layer]
        if float(load.sum()) <= 0:
            continue
        copies = replicate(load, num_slots, max_copies=num_ranks)
        new = pack(load, copies, num_ranks, old)
        gain = rank_loads(load, old, num_ranks).max() - rank_loads(load, new, num_ranks).max()
        if gain > max(0.0, min_gain * float(load.double().sum()) / num_ranks):
            out[layer] = new
    return out


@dataclass(frozen=True)
class SlotMap:
    """One MoE layer's placement: `slot_expert` [S] is the expert in each slot; an expert's
    copies are `copy_slots[e, :copies[e]]` (ascending)."""

    slot_expert: Tensor  # [S] int64
    copies: Tensor  # [E] int64
    copy_slots: Tensor  # [E, max copies] int64, padded with the expert's first slot

    @classmethod
    def of(cls, slot_expert: Tensor, num_experts: int) -> SlotMap:
        slot_expert = slot_expert.to("cpu", torch.int64)
        copies = torch.bincount(slot_expert, minlength=num_experts)
        if copies.numel() != num_experts or int(copies.min()) < 1:
            raise ValueError("placement: every expert needs at least one slot")
        order = torch.argsort(slot_expert, stable=True)  # slots grouped by expert, ascending
        first = torch.cumsum(copies, 0) - copies
        width = int(copies.max())
        j = torch.arange(width)
        index = first.unsqueeze(1) + torch.minimum(j, copies.unsqueeze(1) - 1)
        return cls(slot_expert, copies, order[index])

    @property
    def num_slots(self) -> int:
        return self.slot_expert.numel()

    def route(self, topk_ids: Tensor, offset: int) -> Tensor:
        """The slot of every (token, expert) pair, shaped like topk_ids: an expert's pairs in
        batch order go to its copies round robin, starting at copy `offset` (the rank, so
        that ranks with one pair each do not all pick the same copy)."""
        device = topk_ids.device
        copy_slots = self.copy_slots.to(device)
        if copy_slots.shape[1] == 1:
            return copy_slots[topk_ids, 0]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.copies.numel())
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.empty_like(flat)
        rank_in_expert[order] = torch.arange(flat.numel(), device=device) - starts[flat[order]]
        copy = (rank_in_expert + offset) % self.copies.to(device)[flat]
        return copy_slots[flat, copy].view_as(topk_ids)
