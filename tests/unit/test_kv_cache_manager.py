"""KV cache manager: prefix-cache hits (full blocks only, never the last prompt token),
registration once a block's KV is computed, all-or-nothing allocation, freeing."""

from __future__ import annotations

import random

import pytest

from pdserve.common.block_hashing import block_hashes
from pdserve.common.block_pool import KVCacheBlock
from pdserve.common.kv_cache_manager import KVCacheManager
from pdserve.common.request import Request
from pdserve.common.sampling_params import SamplingParams

BS = 4


def _request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens),
    )


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(n)]


def _prefill(kv: KVCacheManager, request: Request) -> list[KVCacheBlock]:
    """Admit a request the way the scheduler does (prefix lookup, allocation), compute its
    whole prompt in one step and register its full blocks. Returns the prefix hit."""
    cached = kv.find_cached_prefix(request)
    num_cached = len(cached) * BS
    assert kv.allocate_slots(request, request.num_tokens - num_cached, cached)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return cached


def _refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_blocks_needed_rounds_up() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_second_request_with_the_same_prompt_hits_the_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = _tokens(2 * BS + 2, seed=0)
    a = _request("a", prompt)
    assert _prefill(kv, a) == []
    assert len(a.blocks) == 3

    b = _request("b", prompt)
    hit = kv.find_cached_prefix(b)
    assert hit == a.blocks[:2]  # the partial third block is never shared
    assert [blk.ref_cnt for blk in hit] == [1, 1]  # a lookup takes no reference
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, b.num_tokens - 2 * BS, hit)
    assert b.blocks[:2] == a.blocks[:2]
    assert b.blocks[2] is not a.blocks[2]
    assert [blk.ref_cnt for blk in b.blocks] == [2, 2, 1]
    assert kv.num_free_blocks == free_before - 1
    assert b.num_registered_blocks == 2


def test_hit_stops_at_the_first_differing_block() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = _tokens(3 * BS + 1, seed=1)
    a = _request("a", prompt)
    _prefill(kv, a)

    changed = list(prompt)
    changed[BS + 1] += 1  # second block differs; the third is identical but its parent is not
    assert kv.find_cached_prefix(_request("b", changed)) == a.blocks[:1]
    changed[0] += 1
    assert kv.find_cached_prefix(_request("c", changed)) == []


@pytest.mark.parametrize(
    ("prompt_len", "expected_hit_blocks"),
    [(BS, 0), (BS + 1, 1), (2 * BS - 1, 1), (2 * BS, 1), (2 * BS + 1, 2), (3 * BS, 2)],
)
def test_hit_never_covers_the_last_prompt_token(prompt_len: int, expected_hit_blocks: int) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = _tokens(3 * BS, seed=2)
    _prefill(kv, _request("a", prompt))  # all three blocks cached

    b = _request("b", prompt[:prompt_len])
    hit = kv.find_cached_prefix(b)
    assert len(hit) == expected_hit_blocks
    assert len(hit) * BS < prompt_len


def test_blocks_are_registered_only_once_computed() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = _tokens(2 * BS + 2, seed=3)
    a = _request("a", prompt)
    assert kv.allocate_slots(a, a.num_tokens)

    def hits() -> int:
        return len(kv.find_cached_prefix(_request("probe", prompt)))

    kv.cache_full_blocks(a)  # allocated, nothing computed yet
    assert kv.pool.cached == {} and hits() == 0
    a.num_computed_tokens = BS - 1
    kv.cache_full_blocks(a)
    assert kv.pool.cached == {} and hits() == 0
    a.num_computed_tokens = BS
    kv.cache_full_blocks(a)
    assert len(kv.pool.cached) == 1 and hits() == 1
    assert a.num_registered_blocks == 1
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    assert len(kv.pool.cached) == 2 and hits() == 2
    assert [blk.block_hash for blk in a.blocks[:2]] == block_hashes(prompt, BS)
    assert a.blocks[2].block_hash is None


def test_block_completed_by_an_output_token_is_registered_after_its_decode() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = _request("a", _tokens(2 * BS - 1, seed=4))
    _prefill(kv, a)
    assert a.num_registered_blocks == 1

    a.append_output_token(77)  # fills block 1, but its KV is not written yet
    kv.cache_full_blocks(a)
    assert a.num_registered_blocks == 1
    assert a.blocks[1].block_hash is None
    assert len(a.block_hashes) == 2  # the hash may be known already

    assert kv.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    kv.cache_full_blocks(a)
    assert a.num_registered_blocks == 2
    assert a.blocks[1].block_hash == block_hashes(a.all_token_ids, BS)[1]
    assert kv.find_cached_prefix(_request("b", [*a.all_token_ids, 5])) == a.blocks[:2]


def test_allocate_slots_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = _request("a", _tokens(3 * BS, seed=5))
    assert kv.allocate_slots(a, 2 * BS)
    a.num_computed_tokens = 2 * BS
    assert kv.num_free_blocks == 2

    b = _request("b", _tokens(3 * BS, seed=6))
    refs = _refs(kv)
    assert not kv.allocate_slots(b, 3 * BS)  # needs 3, 2 free
    assert b.blocks == [] and kv.num_free_blocks == 2 and _refs(kv) == refs

    assert not kv.allocate_slots(a, 3 * BS)  # 5 blocks in total
    assert len(a.blocks) == 2 and kv.num_free_blocks == 2 and _refs(kv) == refs

    assert kv.allocate_slots(a, BS)  # exactly one more block
    assert len(a.blocks) == 3 and kv.num_free_blocks == 1
    assert kv.allocate_slots(a, 0)  # nothing new: no block taken
    assert kv.num_free_blocks == 1


def test_allocate_slots_reuses_a_partly_filled_last_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = _request("a", _tokens(BS + 1, seed=7))
    assert kv.allocate_slots(a, BS + 1)
    a.num_computed_tokens = BS + 1
    for _ in range(BS - 1):  # the rest of block 1 needs no new block
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        assert len(a.blocks) == 2
    assert kv.allocate_slots(a, 1)
    assert len(a.blocks) == 3


def test_cache_hits_in_the_free_list_count_against_free_capacity() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = _tokens(3 * BS, seed=8)
    a = _request("a", prompt)
    _prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4 and len(kv.pool.cached) == 3

    # 3 hits that sit in the free list + 2 new blocks: only 1 block is really available.
    b = _request("b", [*prompt, *_tokens(2 * BS, seed=9)])
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 3
    refs = _refs(kv)
    free_ids = [blk.block_id for blk in kv.pool.free_queue]
    assert not kv.allocate_slots(b, b.num_tokens - 3 * BS, hit)
    assert b.blocks == [] and _refs(kv) == refs
    assert [blk.block_id for blk in kv.pool.free_queue] == free_ids
    assert len(kv.pool.cached) == 3

    c = _request("c", [*prompt, *_tokens(BS, seed=10)])
    hit = kv.find_cached_prefix(c)
    assert len(hit) == 3
    assert kv.allocate_slots(c, c.num_tokens - 3 * BS, hit)
    assert c.blocks[:3] == hit and kv.num_free_blocks == 0
    assert [blk.ref_cnt for blk in c.blocks] == [1, 1, 1, 1]


def test_free_returns_everything_and_evicts_the_tail_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    free_before = kv.num_free_blocks
    prompt = _tokens(3 * BS, seed=11)
    a = _request("a", prompt)
    _prefill(kv, a)
    b = _request("b", [*prompt, 1])
    assert len(_prefill(kv, b)) == 3
    chain = list(a.blocks)
    b_own = b.blocks[3]

    kv.free(a)
    assert a.blocks == [] and a.num_registered_blocks == 0
    assert [blk.ref_cnt for blk in b.blocks] == [1, 1, 1, 1]
    kv.free(b)
    assert kv.num_free_blocks == free_before
    assert all(r == 0 for r in _refs(kv))

    # b's own block went first, then the shared chain from its tail to its head.
    freed = [blk.block_id for blk in kv.pool.free_queue][-4:]
    assert freed == [b_own.block_id, *(blk.block_id for blk in reversed(chain))]


def test_chain_tail_is_evicted_before_its_head() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = _tokens(3 * BS, seed=12)
    a = _request("a", prompt)
    _prefill(kv, a)
    chain = list(a.blocks)
    kv.free(a)

    # Two new blocks: the one that was already free, then a's tail.
    other = _request("other", _tokens(2 * BS, seed=13))
    _prefill(kv, other)
    assert chain[2] in other.blocks and chain[0] not in other.blocks
    hit = kv.find_cached_prefix(_request("b", [*prompt, 1]))
    assert hit == chain[:2]


def test_forged_collision_is_a_miss() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = _tokens(2 * BS, seed=14)
    victim = kv.pool.get_new_blocks(1)[0]
    key = block_hashes(prompt, BS)[0]
    kv.pool.cache_block(victim, key, [t + 1 for t in prompt[:BS]])
    assert kv.find_cached_prefix(_request("b", prompt)) == []


def test_free_returns_the_exact_free_count_over_a_random_workload() -> None:
    rng = random.Random(15)
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prefixes = [_tokens(2 * BS, seed=100 + i) for i in range(3)]
    live: list[Request] = []
    for i in range(200):
        if live and (rng.random() < 0.4 or kv.num_free_blocks < 6):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(prefixes)[: rng.randint(1, 2 * BS)] + _tokens(
                rng.randint(0, 2 * BS), seed=i
            )
            if not prompt:
                continue
            r = _request(f"r{i}", prompt)
            _prefill(kv, r)
            live.append(r)
        held = {blk.block_id for r in live for blk in r.blocks}
        assert kv.num_free_blocks == kv.pool.num_blocks - len(held)
        for blk in kv.pool.blocks:
            assert blk.ref_cnt == sum(r.blocks.count(blk) for r in live)
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(r == 0 for r in _refs(kv))


def test_prefix_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = _tokens(2 * BS + 1, seed=16)
    a = _request("a", prompt)
    _prefill(kv, a)
    assert kv.pool.cached == {}
    assert kv.find_cached_prefix(_request("b", prompt)) == []
    kv.free(a)
    assert kv.num_free_blocks == 8
