"""Expert placement with redundant experts (common/models/eplb.py): the placement at load,
which experts get copies, how slots are packed onto ranks (balanced better than the
contiguous split on a skewed load, every expert at least once, deterministic, moving few
weights when the load barely changes), and how a layer's (token, expert) pairs are spread
over an expert's copies."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.models import eplb
from pdserve.common.models.expert_stats import imbalance as contiguous_imbalance


def _skewed_loads(layers: int, experts: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(10, 100, (layers, experts), generator=gen)
    base[:, :3] *= 20  # three hot experts, all on rank 0 under the contiguous split
    return base


def test_initial_placement_is_contiguous_plus_copies_of_the_next_rank():
    slots = eplb.initial_slot_expert(8, 2, 2)
    assert slots.tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 7, 0]
    assert eplb.initial_slot_expert(8, 4, 0).tolist() == list(range(8))


def test_replicate_gives_copies_to_the_most_loaded_per_copy():
    copies = eplb.replicate(torch.tensor([100, 10, 40, 10]), num_slots=7, max_copies=4)
    # 100 → 2 copies (50 each) → 3 copies (33) ; 40 then beats 33 → 2 copies.
    assert copies.tolist() == [3, 1, 2, 1]
    capped = eplb.replicate(torch.tensor([100, 1, 1, 1]), num_slots=8, max_copies=2)
    assert capped.tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize(("experts", "ranks", "redundant"), [(8, 2, 2), (16, 4, 4), (16, 4, 8)])
def test_rebalance_balances_a_skewed_load(experts, ranks, redundant):
    loads = _skewed_loads(3, experts)
    previous = eplb.initial_slot_expert(experts, ranks, redundant).expand(3, -1)
    placement = eplb.rebalance(loads, ranks, previous)
    assert placement.shape == (3, experts + redundant)
    for layer in range(3):
        copies = torch.bincount(placement[layer], minlength=experts)
        assert copies.numel() == experts and int(copies.min()) >= 1  # every expert placed
        hot_on = {s // ((experts + redundant) // ranks)
                  for s in range(experts + redundant) if placement[layer, s] == 0}  # fmt: skip
        assert len(hot_on) == int(copies[0])  # copies of one expert on distinct ranks
    new = eplb.imbalance(loads, placement, ranks)
    before = contiguous_imbalance(loads, ranks)
    assert (new < before).all() and (new < 1.25).all(), (before, new)
    assert (new <= eplb.imbalance(loads, previous, ranks)).all()


def test_rebalance_is_deterministic_and_stable():
    loads = _skewed_loads(4, 16, seed=3)
    previous = eplb.initial_slot_expert(16, 4, 4).expand(4, -1)
    first = eplb.rebalance(loads, 4, previous)
    assert torch.equal(first, eplb.rebalance(loads.clone(), 4, previous.clone()))
    # The same load again: nothing would improve, nothing moves.
    assert torch.equal(eplb.rebalance(loads, 4, first), first)
    # A slightly different load: most slots keep their expert.
    again = eplb.rebalance(loads + torch.randint(0, 3, loads.shape), 4, first)
    assert (again == first).float().mean() > 0.7


def test_a_layer_without_tokens_keeps_its_placement():
    previous = eplb.initial_slot_expert(8, 2, 2).expand(2, -1)
    loads = torch.zeros(2, 8, dtype=torch.int64)
    loads[1, 5] = 100
    out = eplb.rebalance(loads, 2, previous)
    assert torch.equal(out[0], previous[0])
    assert int((out[1] == 5).sum()) == 2  # the hot expert got the copy


def test_rank_loads_split_an_expert_evenly_over_its_copies():
    slot_expert = torch.tensor([0, 1, 0, 2])  # ranks: {0, 1}, {0, 2}
    loads = torch.tensor([10.0, 4.0, 6.0])
    assert eplb.rank_loads(loads, slot_expert, 2).tolist() == [9.0, 11.0]
    assert eplb.imbalance(loads, slot_expert, 2).item() == pytest.approx(11 / 10)
    assert eplb.imbalance(torch.zeros(3), slot_expert, 2).item() == 1.0


def test_slot_map_and_route():
    slots = eplb.SlotMap.of(torch.tensor([0, 1, 2, 0, 3, 0]), 4)
    assert slots.copies.tolist() == [3, 1, 1, 1]
    assert slots.copy_slots[0].tolist() == [0, 3, 5] and slots.copy_slots[3, 0] == 4
    ids = torch.tensor([[0, 1], [2, 0], [0, 3], [0, 1]])
    routed = slots.route(ids, offset=0)
    assert routed.tolist() == [[0, 1], [2, 3], [5, 4], [0, 1]]  # expert 0: copies in turn
    assert slots.slot_expert[routed].tolist() == ids.tolist()
    assert slots.route(ids, offset=1)[:, 0].tolist() == [3, 2, 0, 3]
    plain = eplb.SlotMap.of(torch.arange(4), 4)
    assert torch.equal(plain.route(ids, offset=1), ids)
    with pytest.raises(ValueError, match="at least one slot"):
        eplb.SlotMap.of(torch.tensor([0, 1, 1, 3]), 4)


def test_a_small_gain_does_not_move_weights():
    loads = torch.tensor([[12, 10, 10, 10, 10, 10, 10, 10]])
    previous = torch.tensor([[0, 1, 2, 3, 5, 4, 5, 6, 7, 6]])  # ranks: 47 and 35 tokens
    better = eplb.rebalance(loads, 2, previous)
    assert eplb.rank_loads(loads, better, 2).max() < 47 - 0.1 * 41  # gains > 10% of the mean
    assert torch.equal(eplb.rebalance(loads, 2, previous, min_gain=0.2), previous)
