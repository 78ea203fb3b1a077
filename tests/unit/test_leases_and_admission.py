"""The two pieces of KV state a handoff adds around the engine: the prefill side's leases
(blocks held until pulled, released or expired) and the decode side's admission queue
(back-pressure: wait for blocks, bounded, withdrawable). No block may leak either way."""

from __future__ import annotations

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.handoff.leases import LeaseBusy, LeaseError, LeaseTable
from pdserve.common.handoff.remote_queue import RemoteKvQueue, RemoteQueueFull
from pdserve.common.sampling_params import SamplingParams

pytestmark = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def remote_queue(engine: LLMEngine, **kw) -> RemoteKvQueue:
    """The decode engine's line of requests waiting for remote KV, set up as a worker would."""
    engine.scheduler.remote = RemoteKvQueue(engine.scheduler, **kw)
    return engine.scheduler.remote


def _engine(model_dir, tokens: int = 1024) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", threads=1, kv_cache_tokens=tokens)
    )


def _prefilled(engine: LLMEngine, prompt: list[int], rid: str):
    request = engine.add_request(prompt, GREEDY, rid, prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    return request


def test_lease_release_on_pull_and_errors(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    free = engine.kv_cache.num_free_blocks
    leases = LeaseTable(lease_s=60)
    lease = leases.grant(_prefilled(engine, list(range(100, 140)), "a"))  # 3 blocks
    assert engine.kv_cache.num_free_blocks == free - 3
    assert leases.begin_send(lease.lease_id, 1) == lease.request.block_ids[1:]
    with pytest.raises(LeaseBusy, match="already being pulled"):
        leases.begin_send(lease.lease_id, 0)
    assert leases.release(lease.lease_id) is None  # the transfer frees them, not a release
    assert leases.pop_expired() == [] and len(leases) == 1
    request = leases.pop(lease.lease_id)
    assert request is lease.request and leases.pop(lease.lease_id) is None
    engine.kv_cache.free(request)
    assert engine.kv_cache.num_free_blocks == free
    with pytest.raises(LeaseError, match="lease_id"):
        leases.begin_send(lease.lease_id, 0)


def test_lease_first_block_out_of_range(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    leases = LeaseTable(lease_s=60)
    lease = leases.grant(_prefilled(engine, list(range(100, 140)), "a"))
    with pytest.raises(ValueError, match=r"first_block: must be in \[0, 3\)"):
        leases.begin_send(lease.lease_id, 3)


def test_a_receiver_expecting_other_blocks_is_refused_and_the_lease_kept(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    leases = LeaseTable(lease_s=60)
    lease = leases.grant(_prefilled(engine, list(range(100, 140)), "a"))  # 3 blocks
    with pytest.raises(ValueError, match="num_blocks: this lease holds 2 blocks"):
        leases.begin_send(lease.lease_id, 1, num_blocks=5)
    assert leases.begin_send(lease.lease_id, 1, num_blocks=2) == lease.request.block_ids[1:]


def test_unpulled_lease_expires_but_not_while_sending(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    leases = LeaseTable(lease_s=0.0)
    idle = leases.grant(_prefilled(engine, list(range(100, 140)), "a"))
    busy = leases.grant(_prefilled(engine, list(range(200, 240)), "b"))
    leases.begin_send(busy.lease_id, 0)
    assert leases.pop_expired() == [idle.request]
    assert len(leases) == 1 and leases.num_expired == 1
    assert leases.pop_request(busy.request) and not leases.pop_request(busy.request)


def test_admission_waits_for_blocks_and_is_bounded(tiny_model_dir):
    engine = _engine(tiny_model_dir, tokens=64)  # 4 blocks
    admission = remote_queue(engine, max_pending=1)
    prompt = list(range(200, 240))  # 40 tokens + the first token: 3 blocks
    a = engine.new_prefilled_request(prompt, 5, GREEDY, "a")
    b = engine.new_prefilled_request(list(range(300, 340)), 5, GREEDY, "b")
    c = engine.new_prefilled_request(list(range(400, 440)), 5, GREEDY, "c")
    assert admission.submit(a).result(0) == 0
    waiting = admission.submit(b)
    assert not waiting.done() and engine.kv_cache.num_free_blocks == 1
    with pytest.raises(RemoteQueueFull, match="max_pending 1"):
        admission.submit(c)
    admission.admit()
    assert not waiting.done()
    admission.withdraw(a)  # a's pull failed: its blocks go back
    admission.admit()
    assert waiting.result(0) == 0
    admission.withdraw(b)
    assert engine.kv_cache.num_free_blocks == 4


def test_withdraw_from_the_queue(tiny_model_dir):
    engine = _engine(tiny_model_dir, tokens=64)
    admission = remote_queue(engine, max_pending=4)
    a = engine.new_prefilled_request(list(range(200, 240)), 5, GREEDY, "a")
    b = engine.new_prefilled_request(list(range(300, 340)), 5, GREEDY, "b")
    admission.submit(a)
    waiting = admission.submit(b)
    admission.withdraw(b)
    assert waiting.cancelled() and not admission.pending
    admission.withdraw(a)
    assert engine.kv_cache.num_free_blocks == 4


def test_admission_counts_pulls_against_max_num_seqs(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", threads=1,
                     kv_cache_tokens=1024, max_num_seqs=1)
    )  # fmt: skip
    admission = remote_queue(engine, max_pending=4)
    a = engine.new_prefilled_request(list(range(200, 240)), 5, GREEDY, "a")
    b = engine.new_prefilled_request(list(range(300, 340)), 5, GREEDY, "b")
    admission.submit(a)
    waiting = admission.submit(b)  # blocks are free, but the one batch slot is taken
    admission.start(a)
    admission.admit()
    assert not waiting.done()
    admission.withdraw(a)  # aborts the running request
    admission.admit()
    assert waiting.result(0) == 0
    admission.withdraw(b)
    assert engine.kv_cache.num_free_blocks == 64


def test_admission_saturates_when_a_handoff_would_wait_past_the_bound(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", threads=1,
                     kv_cache_tokens=1024, max_num_seqs=1)
    )  # fmt: skip
    all_free = engine.kv_cache.num_free_blocks
    now = [0.0]
    admission = remote_queue(engine, max_pending=8, max_wait_s=3.0, clock=lambda: now[0])
    req = {
        rid: engine.new_prefilled_request(list(range(200 + 50 * i, 240 + 50 * i)), 5, GREEDY, rid)
        for i, rid in enumerate("abcde")
    }
    assert admission.predicted_wait_s(1) is None  # no stream has left the batch yet
    assert admission.submit(req["a"]).result(0) == 0
    admission.start(req["a"])  # the one batch slot
    b = admission.submit(req["b"])
    admission.admit()
    for t, gone, joins in ((1.0, "a", "b"), (3.0, "b", "c")):  # one leaves, the next joins
        now[0] = t
        if joins == "c":
            c = admission.submit(req["c"])
        admission.withdraw(req[gone])  # aborted in the batch: it left
        admission.admit()  # the next step boundary sees it gone
        assert (b if joins == "b" else c).result(0) == 0
        admission.start(req[joins])
    # Two departures 2 s apart in one busy spell; each line had one grant: no line rate yet.
    assert admission.predicted_wait_s(1) == 2.0
    assert not admission.saturated()  # nobody waits: a new handoff would be first in line
    head = admission.submit(req["d"])
    assert admission.saturated()  # a new one would be second in line: 4 s, past 3 s
    second = admission.submit(req["e"])  # saturation refuses nothing here: handoffs queue
    now[0] = 5.0  # no stream left since: the rate decays, 2 s -> 4 s a place
    assert admission.predicted_wait_s(1) == 4.0
    admission.max_wait_s = 0  # no bound: never saturated
    assert not admission.saturated()
    admission.withdraw(req["c"])  # c leaves: the head gets its slot, the second waits on
    admission.admit()
    assert head.result(0) == 0 and not second.done()
    for rid in "de":
        admission.withdraw(req[rid])
    assert second.cancelled() and not admission.pending
    assert engine.kv_cache.num_free_blocks == all_free


def test_the_wait_prediction_follows_the_lines_grants_where_blocks_are_the_limit(
    tiny_model_dir,
):
    """Where KV blocks, not batch slots, hold the line, one stream leaving can let several in:
    once the line has been granted slots at two moments, its wait is predicted at that rate,
    not at one per departure (which would call the worker saturated three times too early).
    A new line starts from the departures' rate again, and an idle batch forgets that."""
    engine = _engine(tiny_model_dir, tokens=512)  # 32 blocks of 16
    all_free = engine.kv_cache.num_free_blocks
    now = [0.0]
    admission = remote_queue(engine, max_pending=16, max_wait_s=3.0, clock=lambda: now[0])
    big = {
        rid: engine.new_prefilled_request(
            list(range(1000 + 200 * i, 1150 + 200 * i)), 5, GREEDY, rid
        )
        for i, rid in enumerate("XY")
    }  # 10 blocks each
    small = [
        engine.new_prefilled_request(list(range(3000 + 50 * i, 3040 + 50 * i)), 5, GREEDY, f"s{i}")
        for i in range(13)
    ]  # 3 blocks each
    for request in (*big.values(), *small[:4]):
        assert admission.submit(request).result(0) == 0
        admission.start(request)
    assert engine.kv_cache.num_free_blocks == 0
    line = [admission.submit(request) for request in small[4:]]
    assert not any(f.done() for f in line)
    for t, rid, granted in ((0.0, "X", 3), (2.0, "Y", 6)):  # each big leaving lets 3 in
        now[0] = t
        admission.withdraw(big[rid])
        admission.admit()
        assert sum(f.done() for f in line) == granted
    # Two departures 2 s apart; the line got 3 slots in those 2 s: 2/3 s a place. A new
    # handoff would be 4th in line: 2.7 s, within the 3 s bound (4 departures: 8 s).
    assert admission.predicted_wait_s(4) == pytest.approx(8 / 3)
    assert not admission.saturated()
    now[0] = 5.0  # nothing granted since: the rate decays, 5/3 s a place
    assert admission.predicted_wait_s(1) == pytest.approx(5 / 3) and admission.saturated()
    for request in small[9:]:  # the line empties; a new one forms at once (a big one)
        admission.withdraw(request)
    again = engine.new_prefilled_request(list(range(5000, 5150)), 5, GREEDY, "Z")
    assert not admission.submit(again).done()
    assert admission.predicted_wait_s(1) == pytest.approx(5 / 1)  # not the old line's rate
    admission.withdraw(again)
    for request in small[:9]:
        admission.withdraw(request)
    admission.admit()  # the batch is idle: its old departures say nothing of the next spell
    assert admission.predicted_wait_s(1) is None
    assert engine.kv_cache.num_free_blocks == all_free
