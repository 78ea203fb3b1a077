"""A lease's end never depends on a wall clock: prefill expires it on its own monotonic
clock, the handle carries the milliseconds left as it is sent, and every host that receives
it counts them down on its own monotonic clock from its arrival. Here the wall clock cannot
be read at all (it raises), the monotonic clock moves only when the test moves it, and the
receiving host's monotonic clock has another origin than the sender's, as on two hosts."""

from __future__ import annotations

import time

import pytest
from handoff_pair import make_pair, prefill

from pdserve.common.handoff import lease_clock
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.handoff_proto import handle_from_proto, handle_to_proto

LLAMA = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)

PROMPT = list(range(100, 137))  # 3 blocks of 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LEASE_S = 30.0


class MonotonicClock:
    """`time.monotonic` that moves only when the test says."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> MonotonicClock:
    clock = MonotonicClock(1000.0)
    monkeypatch.setattr(time, "monotonic", clock)
    return clock


def forbid_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    def wall_clock(*args: object) -> float:
        raise AssertionError("the handoff read the wall clock")

    monkeypatch.setattr(time, "time", wall_clock)
    monkeypatch.setattr(time, "time_ns", wall_clock)


@LLAMA
def test_prefill_expires_its_lease_on_its_monotonic_clock(tiny_model_dir, clock, monkeypatch):
    pair = make_pair(tiny_model_dir, lease_s=LEASE_S)
    forbid_wall_clock(monkeypatch)  # from the prefill on: the grant, the handle, the expiry
    try:
        _, handle = prefill(pair, PROMPT, GREEDY, "a")
        assert handle_to_proto(handle).lease_ttl_ms == LEASE_S * 1000
        clock.advance(LEASE_S - 10)
        assert handle_to_proto(handle).lease_ttl_ms == 10_000  # what is left as it is sent
        free = pair.prefill.runner.num_blocks - handle.num_blocks
        pair.prefill.step()
        assert len(pair.sender.leases) == 1 and pair.prefill.kv_cache.num_free_blocks == free
        clock.advance(10)  # the lease's end on prefill's clock
        assert handle_to_proto(handle).lease_ttl_ms == 0
        pair.prefill.step()
        assert len(pair.sender.leases) == 0 and pair.sender.leases.num_expired == 1
        assert pair.prefill.kv_cache.num_free_blocks == pair.prefill.runner.num_blocks
    finally:
        pair.close()


@LLAMA
def test_a_receiver_counts_the_time_left_from_its_arrival(tiny_model_dir, clock, monkeypatch):
    pair = make_pair(tiny_model_dir, lease_s=LEASE_S)
    forbid_wall_clock(monkeypatch)
    try:
        _, sent = prefill(pair, PROMPT, GREEDY, "a")
        clock.advance(4)  # prefill answers 4 s after the grant
        wire = handle_to_proto(sent)
        clock.now = 5.0e6  # another host: its monotonic clock has another origin
        received = handle_from_proto(wire)
        assert received.lease_left() == pytest.approx(LEASE_S - 4)
        clock.advance(6)  # it waits for blocks there, then forwards the handle
        assert received.lease_left() == pytest.approx(LEASE_S - 10)
        forwarded = handle_from_proto(handle_to_proto(received))
        assert forwarded.lease_left() == pytest.approx(LEASE_S - 10)
        assert received.lease_deadline - clock.now == pytest.approx(LEASE_S - 10)
        clock.advance(LEASE_S)
        assert received.lease_left() == 0 and handle_to_proto(received).lease_ttl_ms == 0
    finally:
        pair.close()


def test_the_wire_field_is_bounded(clock):
    assert lease_clock.ttl_ms(clock.now - 5) == 0  # over: nothing left, never negative
    assert lease_clock.ttl_ms(clock.now + 1e9) == lease_clock.MAX_TTL_MS
    assert lease_clock.deadline(1500) == clock.now + 1.5
