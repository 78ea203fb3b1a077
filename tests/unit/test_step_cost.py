"""The step-cost model and the TPOT-bounded prefill chunk (no timing: steps' seconds are
given, from a known cost function), and the scheduler cutting prompt chunks by it."""

from __future__ import annotations

import random

import pytest

from pdserve.common.kv_cache_manager import KVCacheManager
from pdserve.common.request import Request, RequestStatus
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.scheduler import Scheduler
from pdserve.common.step_cost import StepCostModel, StepPlan, attention_pairs

BASE, PER_DECODE, PER_TOKEN, PER_ATTENTION = 0.010, 0.002, 0.0003, 0.004
TARGET = 0.050
CHUNKS = {"min_chunk": 16, "warmup_chunk": 128}


def true_cost(decodes: int, prefill: int, attention: float) -> float:
    return BASE + PER_DECODE * decodes + PER_TOKEN * prefill + PER_ATTENTION * attention


def fitted(per_attention: float = PER_ATTENTION, seed: int = 0) -> StepCostModel:
    rng = random.Random(seed)
    model = StepCostModel()
    for _ in range(64):
        decodes, prefill = rng.randrange(0, 32), rng.choice([0, 0, rng.randrange(1, 512)])
        attention = sum(attention_pairs(rng.randrange(0, 2000), 1) for _ in range(decodes))
        attention += attention_pairs(rng.randrange(0, 1000), prefill) if prefill else 0.0
        seconds = BASE + PER_DECODE * decodes + PER_TOKEN * prefill + per_attention * attention
        model.record(decodes, prefill, attention, seconds)
    return model


def test_the_fit_recovers_the_step_costs():
    model = fitted()
    assert model.coefficients is not None
    assert model.coefficients == pytest.approx([BASE, PER_DECODE, PER_TOKEN, PER_ATTENTION])
    assert model.predict(3, 100, 0.5) == pytest.approx(true_cost(3, 100, 0.5))


def test_nothing_is_predicted_before_both_kinds_of_step_were_seen():
    model = StepCostModel(min_samples=8)
    for _ in range(20):
        model.record(4, 0, 0.01, 0.02)  # decodes only: the prefill cost is unknown
    assert model.predict(4, 100, 0.0) is None
    plan = StepPlan(model, TARGET, 4, 0.01, **CHUNKS)
    # Unmeasured: a fixed budget of prompt tokens per step, shared by its chunks.
    assert plan.prefill_tokens(0, 100) == 100
    assert plan.prefill_tokens(0, 500) == 28
    assert plan.prefill_tokens(0, 500) == 0
    without_decodes = StepPlan(model, TARGET, 0, 0.0, **CHUNKS)
    assert without_decodes.prefill_tokens(0, 500) == 500


def test_steps_of_one_stream_leave_its_cost_to_the_base():
    # A decode worker's first streams, one at a time: one more stream must not be predicted
    # at 1.5x the step (the TPOT target's admission would then never let a second join).
    model = StepCostModel()
    for i in range(16):
        model.record(1, 0, attention_pairs(300 + i, 1), 0.035)
    assert model.predict(2, 0, 2 * attention_pairs(310, 1)) == pytest.approx(0.035, rel=0.02)
    for i in range(16):  # then steps of two: the stream's own cost is told apart
        model.record(2, 0, 2 * attention_pairs(300 + i, 1), 0.040)
    assert model.predict(3, 0, 3 * attention_pairs(310, 1)) == pytest.approx(0.045, rel=0.05)


def test_a_negative_weight_is_dropped_not_kept():
    # Steps whose time falls with attention (noise, another tenant): a least-squares weight
    # below zero would let chunks grow without bound; it is dropped and the rest refitted.
    model = fitted(per_attention=-0.002)
    assert model.coefficients is not None
    assert (model.coefficients >= 0).all()
    assert model.coefficients[2] > 0


@pytest.mark.parametrize("start", [0, 300, 3000])
def test_a_chunk_is_the_most_tokens_within_the_target(start):
    model = fitted()
    decodes = 6
    decode_attention = sum(attention_pairs(500 + 40 * i, 1) for i in range(decodes))
    plan = StepPlan(model, TARGET, decodes, decode_attention, **CHUNKS)
    n = plan.prefill_tokens(start, 5000)
    assert 16 < n < 5000

    def step(tokens: int) -> float:
        return true_cost(decodes, tokens, decode_attention + attention_pairs(start, tokens))

    assert step(n) <= TARGET + 1e-9 < step(n + 1)


def test_later_chunks_share_what_is_left():
    model = fitted()
    plan = StepPlan(model, TARGET, 2, 0.0, **CHUNKS)
    first = plan.prefill_tokens(0, 40)  # a short prompt, all of it
    second = plan.prefill_tokens(0, 5000)
    assert first == 40
    used = true_cost(2, first + second, attention_pairs(0, first) + attention_pairs(0, second))
    assert used <= TARGET + 1e-9
    assert plan.prefill_tokens(0, 5000) == 0  # nothing left for a third


def test_prefill_moves_even_when_decodes_alone_miss_the_target():
    model = fitted()
    plan = StepPlan(model, TARGET, 40, 0.0, **CHUNKS)  # 40 decodes: 90 ms alone
    assert plan.prefill_tokens(0, 5000) == 16
    assert plan.prefill_tokens(0, 5000) == 0


def test_no_limit_without_decodes_or_without_a_target():
    model = fitted()
    assert StepPlan(model, TARGET, 0, 0.0, **CHUNKS).prefill_tokens(0, 2048) == 2048
    assert StepPlan(model, 0.0, 8, 0.0, **CHUNKS).prefill_tokens(0, 2048) == 2048


def _request(rid: str, n: int, max_tokens: int) -> Request:
    rng = random.Random(rid)
    return Request(
        request_id=rid,
        prompt_token_ids=[rng.randrange(32_000) for _ in range(n)],
        sampling_params=SamplingParams(max_tokens=max_tokens),
    )


def test_the_scheduler_cuts_prompt_chunks_while_streams_decode():
    """A stream decodes while a long prompt arrives: every step that carries it stays in
    the target by the model, the prompt is chunked meanwhile, and both finish. Alone, a
    prompt takes the whole token budget."""
    kv = KVCacheManager(num_blocks=512, block_size=16, enable_prefix_caching=True)
    sched = Scheduler(kv, 8, 2048, step_cost=fitted(), tpot_target_s=TARGET)
    alone = _request("alone", 1500, 1)
    sched.add_request(alone)
    assert sched.schedule().num_new_tokens == [1500]

    kv = KVCacheManager(num_blocks=512, block_size=16, enable_prefix_caching=True)
    free = kv.pool.num_free_blocks
    sched = Scheduler(kv, 8, 2048, step_cost=fitted(), tpot_target_s=TARGET)
    stream, prompt = _request("stream", 20, 400), _request("prompt", 1500, 4)
    sched.add_request(stream)
    chunks = []
    for step in range(600):
        if step == 3:
            sched.add_request(prompt)
        batch = sched.schedule()
        if not batch.requests:
            break
        attention = sum(
            attention_pairs(r.num_computed_tokens, n)
            for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)
        )
        predicted = true_cost(batch.num_decodes, batch.num_tokens - batch.num_decodes, attention)
        if stream in batch.requests and prompt in batch.requests:
            assert predicted <= TARGET + 1e-9, (step, batch.num_new_tokens)
            chunks.append(batch.num_new_tokens[batch.requests.index(prompt)])
        sched.on_step_computed(batch)
        for r in list(batch.requests):
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token(7)
                if r.num_output_tokens >= r.sampling_params.max_tokens:
                    sched.finish(r, RequestStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished()
    assert sum(chunks) >= 1500 - 16 and len(chunks) > 1  # it was chunked beside the stream
    assert kv.pool.num_free_blocks == free
