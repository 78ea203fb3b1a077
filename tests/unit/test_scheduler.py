"""Continuous-batching scheduler, driven without a model: each step is scheduled, marked
computed, and every request whose tokens are all computed gets a fake sampled token."""

from __future__ import annotations

import random

import pytest

from pdserve.common.kv_cache_manager import KVCacheManager
from pdserve.common.request import Request, RequestStatus
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.scheduler import ScheduledBatch, Scheduler

BS = 4
VOCAB = 32_000


def _scheduler(
    num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64, caching: bool = True
) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens),
    )


def _check_invariants(sched: Scheduler, batch: ScheduledBatch) -> None:
    kv = sched.kv_cache
    pool = kv.pool
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(batch) <= sched.max_num_seqs
    assert sched.num_running <= sched.max_num_seqs
    assert all(n >= 1 for n in batch.num_new_tokens)
    nd = batch.num_decodes
    assert all(n == 1 for n in batch.num_new_tokens[:nd])
    assert all(n != 1 for n in batch.num_new_tokens[nd:])
    assert len({id(r) for r in batch.requests}) == len(batch)

    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.blocks == [] and r.num_computed_tokens == 0
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert len(r.blocks) == kv.blocks_needed(r.num_computed_tokens)
    assert set(sched.requests.values()) == {*sched.waiting, *sched.running}

    # Every reference is held by a running request; unreferenced blocks are exactly the free.
    for block in pool.blocks:
        assert block.ref_cnt == sum(r.blocks.count(block) for r in sched.running)
    free = [b.block_id for b in pool.free_queue]
    assert len(free) == pool.num_free_blocks
    assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}


def _step(sched: Scheduler, rng: random.Random) -> ScheduledBatch:
    """One engine step without a model."""
    batch = sched.schedule()
    sched.on_step_computed(batch)
    for request in batch.requests:
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(rng.randrange(VOCAB))
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                sched.finish(request, RequestStatus.FINISHED_LENGTH)
    _check_invariants(sched, batch)
    return batch


def _run(sched: Scheduler, rng: random.Random, max_steps: int = 2000) -> list[ScheduledBatch]:
    batches = []
    while sched.has_unfinished():
        assert len(batches) < max_steps, "no progress"
        batch = _step(sched, rng)
        assert len(batch) > 0 or batch.preempted, "idle step with work left"
        batches.append(batch)
    return batches


def _assert_drained(sched: Scheduler, requests: list[Request]) -> None:
    assert not sched.has_unfinished() and not sched.waiting and not sched.running
    for r in requests:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.sampling_params.max_tokens
        assert r.blocks == []
    pool = sched.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


@pytest.mark.parametrize("num_blocks", [16, 256])
def test_budget_and_max_num_seqs_under_a_random_load(num_blocks: int) -> None:
    rng = random.Random(num_blocks)
    sched = _scheduler(num_blocks=num_blocks, max_num_seqs=4, budget=32)
    prefixes = [_tokens(3 * BS, seed=100 + i) for i in range(3)]
    requests = []
    for i in range(16):
        prompt = rng.choice(prefixes)[: rng.randint(0, 3 * BS)]
        prompt += _tokens(rng.randint(1, 28), seed=i)
        requests.append(_request(f"r{i}", prompt, max_tokens=rng.randint(1, 8)))
    for r in requests[:10]:
        sched.add_request(r)
    batches = [_step(sched, rng) for _ in range(3)]
    for r in requests[10:]:  # arrivals while others run
        sched.add_request(r)
    batches += _run(sched, rng)

    assert max(b.num_tokens for b in batches) == 32  # the limits are reached, never passed
    _assert_drained(sched, requests)
    total_prompt = sum(r.num_prompt_tokens for r in requests)
    assert sched.stats.prefix_cache_queries == total_prompt
    assert sched.stats.prefix_cache_hits == sum(r.num_cached_tokens for r in requests)
    assert sched.stats.num_preemptions == sum(r.num_preemptions for r in requests)
    if num_blocks == 16:
        assert sched.stats.num_preemptions > 0  # the small pool must have been exercised
    else:
        assert sched.stats.num_preemptions == 0
        assert max(len(b) for b in batches) == 4


def test_chunked_prefill() -> None:
    rng = random.Random(0)
    sched = _scheduler(num_blocks=64, budget=32)
    r = _request("r", _tokens(100, seed=1), max_tokens=3)
    sched.add_request(r)

    chunks, computed, outputs = [], [], []
    for _ in range(6):
        batch = _step(sched, rng)
        chunks.append(batch.num_new_tokens)
        computed.append(r.num_computed_tokens)
        outputs.append(r.num_output_tokens)
    assert chunks == [[32], [32], [32], [4], [1], [1]]
    assert computed == [32, 64, 96, 100, 101, 102]
    assert outputs == [0, 0, 0, 1, 2, 3]
    assert r.finished and not sched.has_unfinished()
    assert sched.kv_cache.num_free_blocks == 64


def test_decodes_come_first_in_a_mixed_batch() -> None:
    rng = random.Random(0)
    sched = _scheduler(budget=8)
    a = _request("a", _tokens(3, seed=1), max_tokens=5)
    b = _request("b", _tokens(11, seed=2), max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    first = _step(sched, rng)
    assert first.requests == [a, b] and first.num_new_tokens == [3, 5]
    assert first.num_decodes == 0

    c = _request("c", _tokens(6, seed=3), max_tokens=2)
    sched.add_request(c)
    # Scheduled as a (decode), b (last prefill chunk: 6), c (1 token of budget left):
    # the two single-token entries go first.
    second = _step(sched, rng)
    assert second.requests == [a, c, b]
    assert second.num_new_tokens == [1, 1, 6]
    assert second.num_decodes == 2

    third = _step(sched, rng)  # a and b decode, c continues its prompt
    assert third.requests == [a, b, c] and third.num_new_tokens == [1, 1, 5]
    assert third.num_decodes == 2
    _run(sched, rng)
    _assert_drained(sched, [a, b, c])


def test_max_num_seqs_limits_admission() -> None:
    rng = random.Random(0)
    sched = _scheduler(max_num_seqs=2, budget=256)
    requests = [_request(f"r{i}", _tokens(5, seed=i), max_tokens=3) for i in range(5)]
    for r in requests:
        sched.add_request(r)
    batch = _step(sched, rng)
    assert batch.requests == requests[:2]
    assert sched.num_running == 2 and list(sched.waiting) == requests[2:]
    batches = [batch, *_run(sched, rng)]
    assert all(len(b) <= 2 for b in batches)
    _assert_drained(sched, requests)


def test_newest_running_request_is_preempted() -> None:
    rng = random.Random(0)
    sched = _scheduler(num_blocks=6, budget=64)
    a, b, c = (_request(n, _tokens(2 * BS, seed=i), max_tokens=4) for i, n in enumerate("abc"))
    for r in (a, b, c):
        sched.add_request(r)
    first = _step(sched, rng)
    assert first.requests == [a, b, c] and sched.kv_cache.num_free_blocks == 0

    # Each decode now needs a third block: a's request evicts c, whose blocks then serve a and b.
    second = _step(sched, rng)
    assert second.preempted == [c]
    assert second.requests == [a, b]
    assert c.status == RequestStatus.PREEMPTED and c.num_preemptions == 1
    assert c.num_computed_tokens == 0 and c.blocks == []
    assert list(sched.waiting) == [c] and sched.running == [a, b]
    _run(sched, rng)
    _assert_drained(sched, [a, b, c])


def test_preemption_goes_to_the_front_and_blocks_admission_that_step() -> None:
    rng = random.Random(0)
    # No prefix cache and a small budget: right after the preemption b could be readmitted
    # with a one-block chunk, and c would fit too.
    sched = _scheduler(num_blocks=4, budget=5, caching=False)
    a = _request("a", _tokens(6, seed=1), max_tokens=8)
    b = _request("b", _tokens(6, seed=2), max_tokens=8)
    c = _request("c", _tokens(2, seed=3), max_tokens=2)
    for r in (a, b, c):
        sched.add_request(r)

    for _ in range(10):
        batch = _step(sched, rng)
        if batch.preempted:
            break
    else:
        pytest.fail("no preemption with 4 blocks for two 14-token requests")
    assert batch.preempted == [b]
    assert batch.requests == [a]
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.blocks == []
    assert list(sched.waiting) == [b, c]
    assert c.status == RequestStatus.WAITING
    # Room was left for a chunk of b (or for c), but nothing is admitted after a preemption.
    assert sched.kv_cache.num_free_blocks >= 1
    assert sched.max_num_batched_tokens - batch.num_tokens >= BS

    _run(sched, rng)
    _assert_drained(sched, [a, b, c])
    assert b.num_preemptions >= 1
    assert sched.stats.num_preemptions == a.num_preemptions + b.num_preemptions
    # Resuming a preempted request is not a new prefix-cache query.
    assert sched.stats.prefix_cache_queries == 6 + 6 + 2


def test_request_that_cannot_grow_preempts_itself_when_it_is_the_newest() -> None:
    rng = random.Random(0)
    sched = _scheduler(num_blocks=4, budget=64)
    a = _request("a", _tokens(2 * BS - 1, seed=1), max_tokens=3)
    b = _request("b", _tokens(2 * BS, seed=2), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched, rng)
    assert sched.kv_cache.num_free_blocks == 0

    batch = _step(sched, rng)  # a's decode fits in its last block; b's needs a new one
    assert batch.requests == [a] and batch.preempted == [b]
    assert sched.running == [a] and list(sched.waiting) == [b]

    # A preempted request can be aborted from the queue.
    assert sched.abort("b") is b
    assert b.status == RequestStatus.FINISHED_ABORTED and not sched.waiting
    _run(sched, rng)
    _assert_drained(sched, [a])


def test_prefix_cache_stats_are_counted_once_per_request() -> None:
    rng = random.Random(0)
    sched = _scheduler(budget=64)
    prompt = _tokens(2 * BS + 2, seed=1)
    a = _request("a", prompt, max_tokens=3)
    sched.add_request(a)
    _step(sched, rng)  # a's two full prompt blocks are now cached

    b = _request("b", prompt, max_tokens=3)
    c = _request("c", _tokens(7, seed=2), max_tokens=3)
    sched.add_request(b)
    sched.add_request(c)
    batch = _step(sched, rng)
    assert batch.requests == [a, b, c]
    assert batch.num_new_tokens == [1, 2, 7]  # b only computes what the cache did not cover
    assert b.num_cached_tokens == 2 * BS and c.num_cached_tokens == 0
    assert b.blocks[:2] == a.blocks[:2]
    _run(sched, rng)

    assert sched.stats.prefix_cache_queries == 10 + 10 + 7
    assert sched.stats.prefix_cache_hits == 2 * BS
    assert a.num_cached_tokens == 0
    _assert_drained(sched, [a, b, c])


def test_abort_waiting_and_running_requests_frees_their_blocks() -> None:
    rng = random.Random(0)
    sched = _scheduler(num_blocks=8, max_num_seqs=1, budget=64)
    a = _request("a", _tokens(10, seed=1), max_tokens=5)
    b = _request("b", _tokens(10, seed=2), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched, rng)
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert sched.kv_cache.num_free_blocks == 5

    assert sched.abort("b") is b
    assert b.status == RequestStatus.FINISHED_ABORTED and b.finished
    assert not sched.waiting and sched.kv_cache.num_free_blocks == 5

    assert sched.abort("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.blocks == [] and not sched.running
    assert sched.kv_cache.num_free_blocks == 8
    assert all(blk.ref_cnt == 0 for blk in sched.kv_cache.pool.blocks)

    assert sched.abort("a") is None
    assert sched.abort("missing") is None
    assert not sched.has_unfinished()
    assert len(sched.schedule()) == 0


def test_finishing_twice_frees_once() -> None:
    rng = random.Random(0)
    sched = _scheduler(num_blocks=8)
    a = _request("a", _tokens(6, seed=1), max_tokens=4)
    b = _request("b", _tokens(6, seed=2), max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched, rng)
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    free = sched.kv_cache.num_free_blocks
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert sched.kv_cache.num_free_blocks == free
    assert sched.running == [b]


def test_duplicate_request_id_is_rejected() -> None:
    sched = _scheduler()
    first = _request("same", _tokens(4, seed=1), max_tokens=1)
    sched.add_request(first)
    with pytest.raises(ValueError, match="same"):
        sched.add_request(_request("same", _tokens(5, seed=2), max_tokens=1))
    assert list(sched.waiting) == [first] and sched.requests == {"same": first}
