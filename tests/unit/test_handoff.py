"""The KV handoff inside one process: the real `KvSender` and `KvReceiver` over the
in-process transport, joined by `LocalLink` where processes use gRPC (the real twin, over
UCX between processes, is tests/integration/test_disaggregated.py). A prefill-only engine
hands a request's blocks to a second engine, which continues it. The tokens must be those
one engine gives — greedy and seeded sampling alike — and every block must come back,
through the engines' own steps (leases end, pulls land, abandoned requests go)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from handoff_pair import engine, handoff, make_pair, prefill, run

from pdserve.common.errors import InvalidRequestError
from pdserve.common.handoff.local_link import LocalLink
from pdserve.common.handoff.receiver import PullFailed
from pdserve.common.sampling_params import SamplingParams

pytestmark = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)

PROMPTS = [list(range(100, 137)), list(range(300, 348)), [5, 6, 7]]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True),
]


@pytest.fixture
def pair(tiny_model_dir):
    pair = make_pair(tiny_model_dir)
    yield pair
    pair.close()


def test_handoff_gives_one_engines_tokens(tiny_model_dir, pair):
    reference = engine(tiny_model_dir, enable_prefix_caching=False)
    free = [e.kv_cache.num_free_blocks for e in (pair.prefill, pair.decode)]
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        expected = reference.generate([prompt], params)[0].token_ids
        got, pulled = handoff(pair, prompt, params, f"r{i}")
        assert got == expected, params
        assert pulled == -(-len(prompt) // 16)
    assert [e.kv_cache.num_free_blocks for e in (pair.prefill, pair.decode)] == free


def test_decode_pulls_only_what_it_does_not_cache(tiny_model_dir, pair):
    params = PARAMS[0]
    shared = list(range(1000, 1064))  # four full blocks
    handoff(pair, [*shared, 1, 2, 3], params, "a")
    got, pulled = handoff(pair, [*shared, 9, 8], params, "b")
    assert pulled == 1  # only the tail block; the shared four come from decode's cache
    reference = engine(tiny_model_dir, enable_prefix_caching=False)
    assert got == reference.generate([[*shared, 9, 8]], params)[0].token_ids


def test_everything_cached_releases_the_lease_unsent(pair):
    params = PARAMS[0]
    prompt = list(range(2000, 2032))  # two full blocks, both cached on decode after the first
    handoff(pair, prompt, params, "a")
    free = pair.prefill.kv_cache.num_free_blocks
    first, handle = prefill(pair, prompt, params, "b")
    assert len(pair.sender.leases) == 1
    request, admitted = pair.receiver.arrive(prompt, first, params, "b", None)
    num_cached = admitted.result(0)
    assert num_cached == handle.num_blocks  # prompt + first token: a third block, fresh
    link = LocalLink(pair.sender)
    assert asyncio.run(pair.receiver.pull(request, handle, num_cached, link)) == 0
    assert len(pair.sender.leases) == 0  # released, not expired
    pair.receiver.landed(request)
    run(pair.decode)
    pair.prefill.step()
    assert pair.prefill.kv_cache.num_free_blocks == free


def test_a_stale_handle_fails_the_pull_and_gives_back_its_blocks(pair):
    params = PARAMS[0]
    prompt = PROMPTS[1]
    free = pair.decode.kv_cache.num_free_blocks
    first, handle = prefill(pair, prompt, params, "a")
    assert pair.sender.release(handle.lease_id)  # the lease is gone before decode pulls
    request, admitted = pair.receiver.arrive(prompt, first, params, "a", None)
    link = LocalLink(pair.sender)
    with pytest.raises(PullFailed, match="NOT_FOUND: lease_id") as failed:
        asyncio.run(pair.receiver.pull(request, handle, admitted.result(0), link))
    assert failed.value.reason == PullFailed.STALE
    pair.receiver.abandon(request)
    assert pair.decode.has_unfinished_requests()  # the abandon waits for a step
    pair.decode.step()
    pair.prefill.step()
    assert not pair.decode.has_unfinished_requests()
    assert not pair.prefill.has_unfinished_requests()
    assert pair.decode.kv_cache.num_free_blocks == free
    assert pair.prefill.kv_cache.num_free_blocks == pair.prefill.runner.num_blocks


def test_an_unpulled_lease_expires_in_the_prefill_engines_step(tiny_model_dir):
    pair = make_pair(tiny_model_dir, lease_s=0.0)
    prefill(pair, PROMPTS[0], PARAMS[0], "a")
    assert pair.prefill.has_unfinished_requests()  # a lease is held: steps have work
    pair.prefill.step()
    assert len(pair.sender.leases) == 0 and pair.sender.leases.num_expired == 1
    assert pair.prefill.kv_cache.num_free_blocks == pair.prefill.runner.num_blocks
    assert not pair.prefill.has_unfinished_requests()


def test_first_token_that_finishes_is_not_handed_off(pair):
    params = SamplingParams(max_tokens=1, temperature=0)
    request = pair.prefill.add_request(PROMPTS[0], params, "one", prefill_only=True)
    (out,) = run(pair.prefill)
    assert out.finish_reason == "length" and not request.blocks
    with pytest.raises(InvalidRequestError, match="first_token_id"):
        pair.receiver.arrive(PROMPTS[0], out.new_token_ids[0], params, "one", None)
    assert not pair.decode.has_unfinished_requests()


def test_bad_first_token_is_refused(pair):
    with pytest.raises(InvalidRequestError, match=r"first_token_id: must be in \[0, 49152\)"):
        pair.receiver.arrive(PROMPTS[0], 49152, PARAMS[0], "bad", None)


def test_a_handle_for_another_layout_is_refused_naming_the_field(pair):
    _, handle = prefill(pair, PROMPTS[1], PARAMS[0], "a")
    cases = {
        "kv_handle.block_size": dataclasses.replace(handle, block_size=32),
        "kv_handle.num_tokens": dataclasses.replace(handle, num_tokens=5),
        "kv_handle.layout_fingerprint": dataclasses.replace(handle, layout_fingerprint="x"),
        "kv_handle.transport": dataclasses.replace(handle, transport="ucx"),
        "kv_handle.lease_id": dataclasses.replace(handle, lease_id=""),
        "kv_handle.block_ids": dataclasses.replace(handle, block_ids=handle.block_ids[:1]),
    }
    for field, bad in cases.items():
        with pytest.raises(InvalidRequestError, match=f"^{field}: ") as refused:
            pair.receiver.check(bad, len(PROMPTS[1]))
        assert refused.value.field == field
    pair.receiver.check(handle, len(PROMPTS[1]))


def test_a_block_corrupted_in_transit_fails_the_pull_before_any_token(tiny_model_dir, pair):
    """The sender's checksums travel with the transfer; a block that lands with other bytes
    fails the pull (UNAVAILABLE: the request goes on elsewhere), its blocks go back, and no
    step ever reads it. Then the same handoff, uncorrupted, gives the usual tokens."""
    from pdserve.common import faults

    params = PARAMS[0]
    prompt = PROMPTS[1]
    free = pair.decode.kv_cache.num_free_blocks
    first, handle = prefill(pair, prompt, params, "a")
    request, admitted = pair.receiver.arrive(prompt, first, params, "a", None)
    steps = pair.decode.runner.num_forwards
    faults.arm("decode.before_landing=corrupt@1")
    try:
        with pytest.raises(PullFailed, match="arrived corrupted") as failed:
            asyncio.run(pair.receiver.pull(request, handle, admitted.result(0),
                                           LocalLink(pair.sender)))  # fmt: skip
    finally:
        faults.arm("")
    assert failed.value.reason == PullFailed.UNAVAILABLE
    pair.receiver.abandon(request)
    run(pair.decode)
    assert pair.decode.runner.num_forwards == steps  # nothing computed from those blocks
    assert pair.decode.kv_cache.num_free_blocks == free
    got, _ = handoff(pair, prompt, params, "b")
    reference = engine(tiny_model_dir, enable_prefix_caching=False)
    assert got == reference.generate([prompt], params)[0].token_ids
    assert pair.decode.kv_cache.num_free_blocks == free
