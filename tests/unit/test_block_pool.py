"""Block pool (reference counts, the O(1) LRU free list, the prefix-cache hash index) and the
prefix-cache block hashes every process of a deployment must agree on."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from pdserve.common.block_hashing import (
    HASH_VERSION,
    ROOT_HASH,
    block_hashes,
    hash_block_tokens,
)
from pdserve.common.block_pool import BlockPool, KVCacheBlock

BS = 4


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def _free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def _check_free_list(pool: BlockPool) -> None:
    """The free list holds exactly the unreferenced blocks, each once, and its count agrees."""
    free = _free_ids(pool)
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash and block.token_ids is not None


# ---- block pool ----------------------------------------------------------------------------


def test_new_pool_is_all_free_in_id_order() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    assert _free_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.usage() == 0.0
    with pytest.raises(ValueError):
        BlockPool(0)


def test_get_new_blocks_takes_from_head_with_one_reference() -> None:
    pool = BlockPool(5)
    taken = pool.get_new_blocks(2)
    assert _ids(taken) == [0, 1]
    assert [b.ref_cnt for b in taken] == [1, 1]
    assert _free_ids(pool) == [2, 3, 4]
    assert pool.usage() == pytest.approx(2 / 5)
    assert pool.get_new_blocks(0) == []
    _check_free_list(pool)


def test_touch_and_free_count_references() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 3
    pool.free_blocks([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert block.block_id not in _free_ids(pool)
    assert pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert _free_ids(pool) == [1, 2, 0]  # back at the tail
    _check_free_list(pool)


def test_blocks_come_back_in_the_order_freed() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(6)
    order = [3, 0, 5, 1, 4, 2]
    for i in order:
        pool.free_blocks([blocks[i]])
    assert _free_ids(pool) == order
    assert _ids(pool.get_new_blocks(6)) == order


def test_chain_freed_tail_first_is_evicted_tail_first() -> None:
    pool = BlockPool(4)
    chain = pool.get_new_blocks(3)
    parent = ROOT_HASH
    for i, block in enumerate(chain):
        tokens = [10 * i + j for j in range(BS)]
        parent = hash_block_tokens(parent, tokens)
        pool.cache_block(block, parent, tokens)
    hashes = [b.block_hash for b in chain]
    pool.free_blocks(reversed(chain))  # how a request gives its blocks back

    # Block 3 was free before; after it, the chain's tail goes first and its head last.
    assert _free_ids(pool) == [3, 2, 1, 0]
    pool.get_new_blocks(2)
    assert hashes[2] not in pool.cached
    assert pool.cached[hashes[0]] is chain[0] and pool.cached[hashes[1]] is chain[1]


def test_touch_removes_a_cache_hit_from_the_middle_of_the_free_list() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks(blocks)
    assert _free_ids(pool) == [0, 1, 2, 3, 4]

    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 1
    assert _free_ids(pool) == [0, 1, 3, 4]
    assert pool.num_free_blocks == 4
    _check_free_list(pool)

    # The neighbours stay linked: popping skips the touched block.
    assert _ids(pool.get_new_blocks(2)) == [0, 1]
    pool.free_blocks([blocks[2]])
    assert _free_ids(pool) == [3, 4, 2]
    _check_free_list(pool)


def test_touch_ends_of_the_free_list() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(blocks)
    pool.touch([blocks[0], blocks[3]])
    assert _free_ids(pool) == [1, 2]
    pool.touch([blocks[1], blocks[2]])
    assert _free_ids(pool) == []
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.free_blocks([blocks[2], blocks[0]])
    assert _free_ids(pool) == [2, 0]
    _check_free_list(pool)


def test_cached_block_is_found_until_reused_then_hash_index_is_cleared() -> None:
    pool = BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    tokens = [7, 8, 9, 10]
    h = hash_block_tokens(ROOT_HASH, tokens)
    pool.cache_block(block, h, tokens)
    assert pool.lookup(h, tokens) is block

    pool.free_blocks([block])  # free but still cached: a later hit may revive it
    assert pool.lookup(h, tokens) is block
    assert _free_ids(pool) == [1, 2, 0]

    reused = pool.get_new_blocks(3)
    assert reused[-1] is block
    assert h not in pool.cached
    assert block.block_hash is None and block.token_ids is None
    assert pool.lookup(h, tokens) is None


def test_lookup_compares_token_ids_on_a_forged_hash_collision() -> None:
    pool = BlockPool(2)
    block = pool.get_new_blocks(1)[0]
    tokens = [1, 2, 3, 4]
    forged_key = 12345
    pool.cache_block(block, forged_key, tokens)
    assert pool.lookup(forged_key, tokens) is block
    assert pool.lookup(forged_key, [1, 2, 3, 5]) is None
    assert pool.lookup(forged_key, [1, 2, 3]) is None
    assert pool.lookup(forged_key + 1, tokens) is None


def test_cache_block_keeps_the_first_holder_of_a_hash() -> None:
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    tokens = [4, 4, 4, 4]
    h = hash_block_tokens(ROOT_HASH, tokens)
    pool.cache_block(first, h, tokens)
    pool.cache_block(second, h, tokens)
    assert pool.cached[h] is first
    assert second.block_hash is None

    # Evicting the block that is not indexed must not drop the other one's entry.
    pool.free_blocks([second])
    pool.get_new_blocks(2)
    assert pool.lookup(h, tokens) is first


def test_cache_block_is_a_no_op_without_prefix_caching() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, 99, [1, 2, 3, 4])
    assert pool.cached == {}
    assert block.block_hash is None
    assert pool.lookup(99, [1, 2, 3, 4]) is None


def test_reset_prefix_cache_clears_every_hash() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    for i, block in enumerate(blocks):
        pool.cache_block(block, 100 + i, [i] * BS)
    pool.free_blocks(blocks[:1])
    pool.reset_prefix_cache()
    assert pool.cached == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.lookup(100, [0] * BS) is None


def test_double_free_asserts() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_get_new_blocks_beyond_the_free_count_raises_and_takes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.get_new_blocks(1)
    pool.cache_block(held[0], 5, [0] * BS)
    pool.free_blocks(held)
    before = _free_ids(pool)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(5)
    assert _free_ids(pool) == before
    assert pool.num_free_blocks == 4
    assert pool.lookup(5, [0] * BS) is held[0]  # nothing was evicted either
    _check_free_list(pool)


def test_random_workload_leaks_nothing() -> None:
    rng = random.Random(0)
    pool = BlockPool(16)
    holders: list[list[KVCacheBlock]] = []
    next_key = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            blocks = pool.get_new_blocks(rng.randint(1, min(4, pool.num_free_blocks)))
            for block in blocks:
                if rng.random() < 0.5:
                    pool.cache_block(block, next_key, [next_key] * BS)
                    next_key += 1
            holders.append(blocks)
        elif op < 0.6 and pool.cached:
            hit = rng.choice(list(pool.cached.values()))
            assert pool.lookup(hit.block_hash, hit.token_ids) is hit
            pool.touch([hit])
            holders.append([hit])
        elif holders:
            blocks = holders.pop(rng.randrange(len(holders)))
            pool.free_blocks(reversed(blocks))
        _check_free_list(pool)
        assert pool.num_free_blocks == pool.num_blocks - len(
            {b.block_id for blocks in holders for b in blocks}
        )

    for blocks in holders:
        pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sorted(_free_ids(pool)) == list(range(pool.num_blocks))
    _check_free_list(pool)


# ---- block hashing -------------------------------------------------------------------------


def _reference_hash(parent: int, tokens: list[int]) -> int:
    """The documented wire format, written out independently: the coordinator relies on it."""
    data = parent.to_bytes(8, "little") + b"".join(t.to_bytes(8, "little") for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def test_hash_matches_the_documented_format() -> None:
    assert int.from_bytes(hashlib.sha256(HASH_VERSION).digest()[:8], "little") == ROOT_HASH
    tokens = [0, 1, 151_643, 2**31 + 7, 5, 6, 7, 8]
    expected = []
    parent = ROOT_HASH
    for i in range(0, len(tokens), BS):
        parent = _reference_hash(parent, tokens[i : i + BS])
        expected.append(parent)
    assert block_hashes(tokens, BS) == expected
    assert all(0 <= h < 2**64 for h in expected)


def test_hashes_are_chained() -> None:
    shared = [9, 9, 9, 9]
    a = block_hashes([1, 2, 3, 4, *shared], BS)
    b = block_hashes([5, 6, 7, 8, *shared], BS)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens, different parent
    assert hash_block_tokens(ROOT_HASH, shared) not in (a[1], b[1])
    # Equal prefixes give equal hashes, and a change in one block changes every later hash.
    c = block_hashes([1, 2, 3, 4, *shared, 1, 1, 1, 1], BS)
    d = block_hashes([1, 2, 3, 0, *shared, 1, 1, 1, 1], BS)
    assert c[:2] == a
    assert all(x != y for x, y in zip(c, d, strict=True))


def test_hashes_only_cover_full_blocks() -> None:
    tokens = list(range(100, 111))  # 2 full blocks of 4 and 3 left over
    hashes = block_hashes(tokens, BS)
    assert len(hashes) == 2
    assert hashes == block_hashes(tokens[:8], BS)
    assert block_hashes(tokens[:3], BS) == []
    assert block_hashes([], BS) == []


@pytest.mark.parametrize("start", [0, 1, 3, 5])
def test_hashes_from_a_start_block_equal_the_tail(start: int) -> None:
    rng = random.Random(start)
    tokens = [rng.randrange(50_000) for _ in range(5 * BS + 2)]
    full = block_hashes(tokens, BS)
    parent = full[start - 1] if start else ROOT_HASH
    assert block_hashes(tokens, BS, start, parent) == full[start:]
    # numpy ints and tuples hash like the same Python ints
    assert block_hashes(tuple(np.asarray(tokens, dtype=np.int64)), BS) == full


_CHILD = (
    "import json, sys\n"
    "from pdserve.common.block_hashing import block_hashes\n"
    "print(json.dumps(block_hashes(json.loads(sys.argv[1]), int(sys.argv[2]))))\n"
)


def test_hashes_are_deterministic_across_processes() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(128_000) for _ in range(6 * BS + 1)]
    here = block_hashes(tokens, BS)
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(tokens), str(BS)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert json.loads(out.stdout) == here


def test_event_log_follows_the_prefix_cache() -> None:
    pool = BlockPool(3)
    [a, b] = pool.get_new_blocks(2)
    pool.cache_block(a, 11, [1])
    assert pool.drain_events() == []  # not recording yet
    pool.record_events()
    pool.cache_block(b, 22, [2])
    pool.cache_block(b, 22, [2])  # already cached: no event
    pool.free_blocks([a, b])
    assert pool.drain_events() == [(True, 22)]
    pool.get_new_blocks(3)  # the free one, then a and b, whose hashes go
    assert pool.drain_events() == [(False, 11), (False, 22)]
    assert pool.drain_events() == []
