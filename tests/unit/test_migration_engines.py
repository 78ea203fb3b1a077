"""Live migration between two engines in one process (the real twin, over UCX between a
draining decode worker and another, is tests/integration/test_live_migration.py): a request
decodes on one engine, is paused between steps with its KV leased (`migration.pause`), and
goes on on a second engine that pulls that KV through the real `KvReceiver` and `KvSender`
(over the in-process transport) and resumes the output state as the coordinator's migrated
leg asks. The tokens must be those of an uninterrupted run, greedy, seeded and constrained,
wherever the pause falls (right after the first token, inside a block, on a block boundary),
nothing is recomputed on the second engine but the last token, and every block comes back."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest
from handoff_pair import engine, make_pair, run

from pdserve.common.handoff import migration
from pdserve.common.handoff.local_link import LocalLink
from pdserve.common.request import RequestStatus, Resume
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured_output import StructuredOutput

pytestmark = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)

PROMPT = list(range(100, 137))  # 37 tokens: the pause points cross the block at 48
PARAMS = [
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.9, top_k=50, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True),
    # Constrained: the grammar's state goes on where the source left it.
    SamplingParams(
        max_tokens=20,
        temperature=0.8,
        seed=5,
        ignore_eos=True,
        structured=StructuredOutput("regex", "[a-z]+( [a-z]+)*"),
    ),
]


@pytest.fixture
def engines(tiny_model_dir):
    """A source and a target engine joined by the real sender and receiver (`handoff_pair`)."""
    pair = make_pair(tiny_model_dir)
    yield pair.prefill, pair.decode, pair.sender, pair.receiver
    pair.close()


def migrate(engines, params: SamplingParams, steps: int, rid: str) -> tuple[list[int], int]:
    """Decode `steps` tokens on the source, move the request, finish it on the target: (all
    tokens, tokens the target computed before its first new token)."""
    source, target, sender, receiver = engines
    request = source.add_request(PROMPT, params, rid)
    chars_before_last = 0  # the text a client had before the last token's (as the coordinator)
    while request.num_output_tokens < steps:
        chars_before_last = len(request.output_text)
        source.step()
    (moved,) = migration.pause(source.scheduler, sender)
    paused, handle = moved
    assert paused is request and request.status == RequestStatus.PREFILLED
    assert not source.scheduler.running and len(sender.leases) == 1
    tokens = list(request.output_token_ids)
    n = len(tokens) - 1
    computed = PROMPT + tokens[:-1]
    assert handle.num_tokens == len(computed) == request.num_computed_tokens
    receiver.check(handle, len(computed))
    leg = dataclasses.replace(params, max_tokens=params.max_tokens - n)
    resume = Resume(n, chars_before_last) if n else None
    arrived, admitted = receiver.arrive(computed, tokens[-1], leg, rid, resume)
    num_cached = admitted.result(0)
    asyncio.run(receiver.pull(arrived, handle, num_cached, LocalLink(sender)))
    receiver.landed(arrived)
    target.step()  # joins the batch: computes the last token's KV alone, samples the next
    recomputed = arrived.num_computed_tokens - len(computed)
    run(target)
    source.step()  # the lease ended with the send: its blocks go back at this step
    return tokens + arrived.output_token_ids[1:], recomputed


@pytest.mark.parametrize("steps", [1, 5, 12])
def test_a_moved_request_gives_the_uninterrupted_tokens(tiny_model_dir, engines, steps):
    reference = engine(tiny_model_dir, enable_prefix_caching=False)
    source, target = engines[0], engines[1]
    free = [e.kv_cache.num_free_blocks for e in (source, target)]
    for i, params in enumerate(PARAMS):
        out = reference.generate([PROMPT], params)[0]
        expected = out.token_ids
        if params.structured is not None:  # the constraint is at work
            assert len(expected) == params.max_tokens and re.fullmatch("[a-z ]+", out.text)
        got, recomputed = migrate(engines, params, steps, f"r{i}")
        assert got == expected, (steps, params)
        assert recomputed == 1  # the last sampled token's KV; the rest was pulled
    assert [e.kv_cache.num_free_blocks for e in (source, target)] == free
    assert len(engines[2].leases) == 0


def test_only_decoding_requests_move(engines):
    source, _, sender, _ = engines
    params = PARAMS[0]
    decoding = source.add_request(PROMPT, params, "decoding")
    while not decoding.output_token_ids:
        source.step()
    prompt_only = source.add_request(list(range(500, 900)), params, "prompt")
    source.scheduler.max_num_batched_tokens = 64  # the long prompt takes several chunks
    source.step()
    assert prompt_only.status == RequestStatus.RUNNING and not prompt_only.output_token_ids
    assert migration.pause(source.scheduler, sender, keep={"decoding"}) == []  # it stays
    moved = migration.pause(source.scheduler, sender)
    assert [r for r, _ in moved] == [decoding]
    assert migration.busy(source.scheduler)  # the prompt still runs, the lease is held
