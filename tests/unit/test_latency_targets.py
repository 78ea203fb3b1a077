"""Admission by the latency targets (no timing: step costs are recorded from a known cost
function): a prompt whose first token is predicted past `--ttft-target-ms` is refused
before it holds anything, and a decode worker admits a stream only while a step with it
stays within the TPOT target. The prediction of the queue ahead is checked against the
steps the scheduler's own plan would run. A TPOT target that the decodes alone miss is
named in a warning while prompts wait."""

from __future__ import annotations

import logging
import math

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine import RELEARN_AFTER_S, LLMEngine
from pdserve.common.errors import WorkerBusyError
from pdserve.common.handoff.remote_queue import RemoteKvQueue
from pdserve.common.request import Resume
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.step_cost import StepCostModel, StepPlan, attention_pairs

BASE, PER_DECODE, PER_TOKEN, PER_ATTENTION = 0.010, 0.002, 0.0003, 0.004
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def remote_queue(engine: LLMEngine, **kw) -> RemoteKvQueue:
    """The decode engine's line of requests waiting for remote KV, set up as a worker would."""
    engine.scheduler.remote = RemoteKvQueue(engine.scheduler, **kw)
    return engine.scheduler.remote


def true_cost(decodes: int, prefill: int, attention: float) -> float:
    return BASE + PER_DECODE * decodes + PER_TOKEN * prefill + PER_ATTENTION * attention


def record(model: StepCostModel, prefill_steps: int, decode_steps: int) -> None:
    for i in range(prefill_steps):
        tokens = 64 + 37 * i
        model.record(
            0, tokens, attention_pairs(0, tokens), true_cost(0, tokens, attention_pairs(0, tokens))
        )
    for i in range(decode_steps):
        decodes = 1 + i % 7
        attention = decodes * attention_pairs(200 + 50 * i, 1)
        model.record(decodes, 0, attention, true_cost(decodes, 0, attention))


def test_a_prefill_worker_learns_prefill_costs_and_predicts_no_decodes():
    model = StepCostModel()
    record(model, prefill_steps=16, decode_steps=0)
    assert model.prefill_measured and not model.decodes_measured
    assert model.predict(0, 300, attention_pairs(0, 300)) == pytest.approx(
        true_cost(0, 300, attention_pairs(0, 300))
    )
    assert model.predict(2, 0, 0.001) is None


def test_a_decode_worker_learns_decode_costs_only():
    model = StepCostModel()
    record(model, prefill_steps=0, decode_steps=16)
    assert model.decodes_measured and not model.prefill_measured
    assert model.predict(5, 0, 0.01) == pytest.approx(true_cost(5, 0, 0.01))
    assert model.predict(0, 10, 0.0) is None
    assert model.prefill_wait_s([(0, 100, 0)], [], 0.05, 16, 2048) is None


def simulated_wait(
    prompts: list[tuple[int, int, int]],
    streams: list[tuple[int, int]],
    target_s: float,
    min_chunk: int,
    model: StepCostModel,
) -> float:
    """Seconds of the steps the scheduler's plan runs until every prompt is prefilled: the
    streams decode one token a step and leave when their steps run out; a prompt, once
    prefilled, decodes from the next step on for its own steps."""
    left = [list(p) for p in prompts]
    live = [list(s) for s in streams]
    seconds = 0.0
    while left:
        decode_attention = sum(attention_pairs(c, 1) for c, _ in live)
        plan = StepPlan(model, target_s, len(live), decode_attention, min_chunk, warmup_chunk=0)
        tokens, attention = 0, decode_attention
        for prompt in left:
            n = plan.prefill_tokens(prompt[0], prompt[1])
            if n == 0:
                break
            tokens += n
            attention += attention_pairs(prompt[0], n)
            prompt[0] += n
            prompt[1] -= n
        seconds += true_cost(len(live), tokens, attention)
        live = [[c + 1, n - 1] for c, n in live if n > 1]
        live += [[p[0], p[2]] for p in left if p[1] == 0 and p[2] > 0]
        left = [p for p in left if p[1] > 0]
    return seconds


@pytest.mark.parametrize("decodes", [0, 4, 12])
def test_the_queue_ahead_is_predicted_as_the_plan_would_run_it(decodes):
    model = StepCostModel()
    record(model, prefill_steps=16, decode_steps=16)
    target = 0.050
    prompts = [(0, 700, 0), (128, 300, 0), (0, 1500, 0), (0, 40, 0)]  # handed off, say
    streams = [(600, 10_000)] * decodes
    predicted = model.prefill_wait_s(prompts, streams, target, 16, 100_000)
    simulated = simulated_wait(prompts, streams, target, 16, model)
    # The prediction counts steps of room; the plan cuts whole tokens: a step apart.
    step = true_cost(decodes, 0, decodes * attention_pairs(600, 1)) if decodes else BASE
    assert predicted is not None and abs(predicted - simulated) <= 2 * step + 1e-9
    # More queued ahead is never predicted sooner.
    longer = model.prefill_wait_s([*prompts, (0, 500, 0)], streams, target, 16, 100_000)
    assert longer is not None and longer > predicted


@pytest.mark.parametrize("decodes", [1, 2, 4, 5])
def test_prompts_ahead_join_the_decodes_and_streams_leave_as_predicted(decodes):
    """Colocated: each prompt ahead decodes once prefilled, so the prompts behind it get
    less of each step, and streams whose outputs end leave (one stream leaving after 5
    steps frees the whole budget for the queue). The prediction follows the plan through
    both, where counting only the streams there now would promise first tokens early."""
    model = StepCostModel()
    record(model, prefill_steps=16, decode_steps=16)
    target = true_cost(6, 0, 6 * attention_pairs(300, 1))  # six streams fill it
    prompts = [(0, 300, 200), (0, 250, 150), (0, 400, 100), (0, 120, 50)]
    streams = [(300 + 20 * i, 5 + 30 * i) for i in range(decodes)]  # leaving one by one
    predicted = model.prefill_wait_s(prompts, streams, target, 16, 2048)
    simulated = simulated_wait(prompts, streams, target, 16, model)
    assert predicted is not None
    assert abs(predicted - simulated) <= 0.05 * simulated
    if decodes > 1:  # (one stream is gone before the first prompt ends: nothing to join)
        handed_off = [(s, n, 0) for s, n, _ in prompts]
        assert simulated > 1.15 * simulated_wait(handed_off, streams, target, 16, model)
        optimistic = model.prefill_wait_s(handed_off, streams, target, 16, 2048)
        assert optimistic is not None and optimistic < 0.85 * simulated


def test_without_decodes_the_prompts_run_in_steps_of_the_token_budget():
    model = StepCostModel()
    record(model, prefill_steps=16, decode_steps=16)
    prompts = [(0, 1000, 0), (0, 1000, 0)]
    work = sum(PER_TOKEN * n + PER_ATTENTION * attention_pairs(s, n) for s, n, _ in prompts)
    wait = model.prefill_wait_s(prompts, [], 0.05, 16, 512)
    assert wait == pytest.approx(work + math.ceil(2000 / 512) * BASE)


def _engine(model_dir, **config) -> LLMEngine:
    """A real engine whose step costs are the known function's (its own steps, timed on
    this machine, would make the figures below depend on the host)."""
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", threads=1, kv_cache_tokens=4096,
                     **config)
    )  # fmt: skip
    engine.step_cost = engine.scheduler.step_cost = StepCostModel()
    record(engine.step_cost, prefill_steps=16, decode_steps=16)
    return engine


def _prompt(i: int) -> list[int]:
    return list(range(1000 + 100 * i, 1100 + 100 * i))  # 100 tokens of its own


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


ONE = PER_TOKEN * 100 + PER_ATTENTION * attention_pairs(0, 100)  # a 100-token prompt's compute
TARGET = 2.5 * ONE + BASE  # two prompts' first tokens are within it, a third's is not


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_a_prompt_past_the_ttft_target_is_refused_before_it_holds_anything(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    total = engine.kv_cache.num_free_blocks
    for i in range(2):
        engine.add_request(_prompt(i), GREEDY, f"r{i}", ttft_target_s=TARGET)
    with pytest.raises(WorkerBusyError, match=r"past its TTFT target \(--ttft-target-ms") as e:
        engine.add_request(_prompt(2), GREEDY, "r2", ttft_target_s=TARGET)
    assert e.value.reason == "ttft_target"
    # Predicted at three prompts' compute and one step's base: retry once half a prompt ran.
    assert e.value.retry_after_s == pytest.approx(3 * ONE + BASE - TARGET)
    assert "r2" not in engine.scheduler.requests and len(engine.scheduler.waiting) == 2
    # Without a target (offline) and for a resumed leg (its stream is open): never refused.
    engine.add_request(_prompt(3), GREEDY, "offline")
    resume = Resume(output_tokens=3, sent_chars=0)
    engine.add_request(_prompt(4), GREEDY, "resumed", resume=resume, ttft_target_s=TARGET)
    assert len(engine.scheduler.waiting) == 4
    _run(engine)
    assert engine.kv_cache.num_free_blocks == total


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_a_cached_prefix_counts_only_what_is_left_to_compute(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    engine.add_request(_prompt(0), GREEDY, "first")
    _run(engine)  # its 6 full blocks stay cached
    engine.step_cost = engine.scheduler.step_cost = StepCostModel()
    record(engine.step_cost, prefill_steps=16, decode_steps=16)
    for i in (1, 2):
        engine.add_request(_prompt(i), GREEDY, f"r{i}", ttft_target_s=TARGET)
    # 96 of its 100 tokens are cached: it fits where a fresh prompt does not.
    engine.add_request(_prompt(0), GREEDY, "again", ttft_target_s=TARGET)
    with pytest.raises(WorkerBusyError):
        engine.add_request(_prompt(3), GREEDY, "fresh", ttft_target_s=TARGET)
    _run(engine)
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_a_decode_worker_batches_to_the_tpot_target(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    prompts = [list(range(200 + 100 * i, 240 + 100 * i)) for i in range(4)]  # 40 tokens each
    requests = [engine.new_prefilled_request(p, 5, GREEDY, f"d{i}") for i, p in enumerate(prompts)]
    # A step of three streams (their 41-token contexts) is within the target, four are not.
    engine.scheduler.tpot_target_s = true_cost(3, 0, 3 * attention_pairs(40, 1)) + 1e-6
    admission = remote_queue(engine, max_pending=4)
    admitted = [admission.submit(r) for r in requests]
    assert [f.done() for f in admitted] == [True, True, True, False]
    admission.start(requests[0])
    admission.admit()
    assert not admitted[3].done()  # still three in the batch
    admission.withdraw(requests[0])  # a stream ends: room for the fourth
    admission.admit()
    assert admitted[3].result(0) == 0
    for r in requests[1:]:
        admission.withdraw(r)
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_a_target_no_batch_meets_leaves_decode_batches_to_their_slots(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    engine.scheduler.tpot_target_s = true_cost(1, 0, 0.0) / 2  # one stream alone misses it
    admission = remote_queue(engine, max_pending=4)
    requests = [
        engine.new_prefilled_request(list(range(200 + 100 * i, 240 + 100 * i)), 5, GREEDY, f"d{i}")
        for i in range(4)
    ]
    assert all(admission.submit(r).done() for r in requests)
    for r in requests:
        admission.withdraw(r)
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks


def test_a_target_the_decodes_alone_miss_gives_prompts_their_minimum_chunk():
    model = StepCostModel()
    record(model, prefill_steps=16, decode_steps=16)
    attention = 4 * attention_pairs(300, 1)
    decode_s = true_cost(4, 0, attention)
    missed = StepPlan(model, decode_s / 2, 4, attention, min_chunk=16, warmup_chunk=0)
    assert missed.prefill_tokens(0, 500) == 16 and missed.prefill_tokens(0, 500) == 0
    reason = missed.unmet_target()
    assert reason is not None and f"{decode_s * 1e3:.0f} ms" in reason
    assert "--tpot-target-ms" in reason and "16 tokens a step" in reason
    met = StepPlan(model, decode_s * 2, 4, attention, min_chunk=16, warmup_chunk=0)
    assert met.unmet_target() is None and met.prefill_tokens(0, 500) > 16


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_the_scheduler_names_an_unmet_tpot_target_while_prompts_wait(tiny_model_dir, caplog):
    engine = _engine(tiny_model_dir)
    streams = [
        engine.new_prefilled_request(list(range(200 + 100 * i, 240 + 100 * i)), 5, GREEDY, f"d{i}")
        for i in range(2)
    ]
    for r in streams:
        assert engine.scheduler.remote.submit(r).result(0) is not None
        engine.scheduler.remote.start(r)  # two streams decoding, as a pull leaves them
    engine.scheduler.tpot_target_s = true_cost(2, 0, 2 * attention_pairs(40, 1)) / 2
    with caplog.at_level(logging.WARNING, logger="pdserve.common.scheduler"):
        engine.scheduler.schedule()  # only decodes: nothing waits on the target
        assert not caplog.records
        engine.add_request(_prompt(0), GREEDY, "waiting")
        batch = engine.scheduler.schedule()
        engine.scheduler.schedule()  # logged once a minute, not every step
    assert len(caplog.records) == 1 and "past the TPOT target" in caplog.records[0].message
    assert batch.num_new_tokens[batch.num_decodes :] == [engine.kv_cache.block_size]
    for request_id in ("d0", "d1", "waiting"):
        engine.abort_request(request_id)
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_a_workers_first_step_of_each_kind_is_not_a_sample(tiny_model_dir):
    """One-off costs (the allocator's growth, each kernel's first call, an extension built
    on first use) land in a worker's first steps: its first step with prompt tokens and its
    first without are left out of the step-cost fit; every later step is in it."""
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", threads=1, kv_cache_tokens=4096)
    )
    engine.add_request(_prompt(0), GREEDY, "first")  # 1 prefill step, then 7 decode steps
    _run(engine)
    assert [s[2] for s in engine.step_cost.samples] == [0.0] * 6
    engine.add_request(_prompt(1), GREEDY, "second")
    _run(engine)
    tokens = [s[2] for s in engine.step_cost.samples]
    assert tokens == [0.0] * 6 + [100.0] + [0.0] * 7


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_an_idle_worker_refusing_a_lone_prompt_for_long_relearns_its_costs(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    lone = ONE / 2  # a target no 100-token prompt meets under the recorded costs
    with pytest.raises(WorkerBusyError):
        engine.add_request(_prompt(0), GREEDY, "now", ttft_target_s=lone)
    # Long idle but with a request queued: the refusal stands (the queue is real work).
    engine._last_step_end -= RELEARN_AFTER_S
    engine.add_request(_prompt(1), GREEDY, "queued")
    with pytest.raises(WorkerBusyError):
        engine.add_request(_prompt(2), GREEDY, "behind", ttft_target_s=lone)
    _run(engine)
    assert engine.step_cost.coefficients is not None
    # Idle, but the last step just ran: still refused.
    with pytest.raises(WorkerBusyError):
        engine.add_request(_prompt(3), GREEDY, "recent", ttft_target_s=lone)
    # Idle for RELEARN_AFTER_S: the costs are dropped and the prompt admitted, as at start-up.
    engine._last_step_end -= RELEARN_AFTER_S
    engine.add_request(_prompt(4), GREEDY, "probe", ttft_target_s=lone)
    assert engine.step_cost.coefficients is None and "probe" in engine.scheduler.requests
    _run(engine)
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks


def test_offline_generation_takes_the_whole_budget_unless_asked(monkeypatch) -> None:
    """`pdserve generate` has no stream to keep within a TPOT target (vLLM's offline engine
    has none either): its steps take the token budget alone, while the serving commands
    keep the default target; a flag or PDSERVE_TPOT_TARGET_MS still sets one."""
    from pdserve.services.cli import build_parser

    monkeypatch.delenv("PDSERVE_TPOT_TARGET_MS", raising=False)
    args = ["--input", "in.jsonl", "--output", "-"]
    assert build_parser().parse_args(["generate", *args]).tpot_target_ms == 0
    assert build_parser().parse_args(["colocated"]).tpot_target_ms == 50
    assert build_parser().parse_args(["demo"]).tpot_target_ms == 50
    flag = ["generate", *args, "--tpot-target-ms", "80"]
    assert build_parser().parse_args(flag).tpot_target_ms == 80
    monkeypatch.setenv("PDSERVE_TPOT_TARGET_MS", "120")
    assert build_parser().parse_args(["generate", *args]).tpot_target_ms == 120
