"""How tensor parallelism splits a model over N ranks (`common/models/tensor_parallel.py`):
every query head is computed by exactly one rank, and only from KV heads that rank keeps;
KV heads are split as evenly as possible (N need not divide them) or, when there are fewer
than N, each is replicated on N/KVH ranks; MLP rows and the vocabulary are covered once;
pairs that cannot be split are refused with the numbers named."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from pdserve.common.models.tensor_parallel import TensorShard, check_model

# (query heads, KV heads, ranks): SmolLM2-135M's 9/3 over 2 and 3, even and uneven
# splits, replication of a single KV head (multi-query) and of 2 KV heads over 4 ranks.
SPLITS = [(9, 3, 2), (9, 3, 3), (4, 2, 2), (6, 3, 2), (4, 1, 2), (8, 2, 4), (32, 8, 4), (4, 4, 1)]


@pytest.mark.parametrize(("heads", "kv_heads", "world"), SPLITS)
def test_every_query_head_once_reading_only_its_ranks_kv_heads(heads, kv_heads, world) -> None:
    group = heads // kv_heads
    seen: list[int] = []
    kept: set[int] = set()
    for rank in range(world):
        shard = TensorShard(rank, world)
        q = shard.q_heads(heads, kv_heads)
        kv = shard.kv_heads(kv_heads)
        assert len(q) > 0 and len(kv) > 0
        assert {h // group for h in q} <= set(kv)  # grouped-query attention stays local
        assert len(kv) <= shard.max_kv_heads(kv_heads)
        seen += list(q)
        kept |= set(kv)
    assert sorted(seen) == list(range(heads))
    assert kept == set(range(kv_heads))


def test_uneven_and_replicated_ranges() -> None:
    assert [TensorShard(r, 2).kv_heads(3) for r in range(2)] == [range(0, 2), range(2, 3)]
    assert [TensorShard(r, 2).q_heads(9, 3) for r in range(2)] == [range(0, 6), range(6, 9)]
    # 2 KV heads on 4 ranks: ranks 0, 1 keep head 0 and split its 4 query heads.
    assert [TensorShard(r, 4).kv_heads(2) for r in range(4)] == [range(0, 1)] * 2 + [
        range(1, 2)
    ] * 2
    assert [TensorShard(r, 4).q_heads(8, 2) for r in range(4)] == [
        range(0, 2), range(2, 4), range(4, 6), range(6, 8)
    ]  # fmt: skip


@pytest.mark.parametrize(("size", "world"), [(1536, 2), (10, 3), (7, 4), (49152, 3)])
def test_splits_cover_every_row_once(size, world) -> None:
    rows = [i for r in range(world) for i in TensorShard(r, world).split(size)]
    assert rows == list(range(size))
    vocab = [i for r in range(world) for i in TensorShard(r, world).vocab_range(size)]
    assert vocab == list(range(size))
    width = TensorShard(0, world).vocab_width(size)
    assert all(len(TensorShard(r, world).vocab_range(size)) <= width for r in range(world))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world", "named"),
    [(9, 3, 4, "fewer key/value heads (3) than ranks (4)"), (6, 2, 4, "query heads must split")],
)
def test_unsplittable_models_are_refused_naming_the_numbers(heads, kv_heads, world, named):
    config = LlamaConfig(
        hidden_size=8 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads
    )
    with pytest.raises(ValueError, match="tensor_parallel") as refused:
        check_model(config, "llama", False, "none", world)
    assert named in str(refused.value)


def test_too_few_experts_and_whole_projection_norms_are_refused() -> None:
    from transformers import MixtralConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="over all heads"):
        check_model(config, "olmoe", False, "whole", 2)
    check_model(config, "llama", False, "none", 2)  # a dense Llama splits
    moe = MixtralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=2)  # fmt: skip
    check_model(moe, "mixtral", True, "none", 2)  # one expert per rank
    with pytest.raises(ValueError, match="2 experts cannot give each of 4 ranks one"):
        check_model(moe, "mixtral", True, "none", 4)
