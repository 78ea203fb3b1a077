"""The KV handoff inside one process, with the in-process transport (its real twin, over
UCX between processes, is tests/integration/test_disaggregated.py): a prefill-only engine
hands a request's blocks to a second engine, which continues it. The tokens must be those
one engine gives — greedy and seeded sampling alike — and every block must come back."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.errors import InvalidRequestError
from pdserve.common.kv_transfer import KvTransport, create_transport
from pdserve.common.request import RequestStatus
from pdserve.common.sampling_params import SamplingParams

pytestmark = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)

PROMPTS = [list(range(100, 137)), list(range(300, 348)), [5, 6, 7]]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True),
]


def _engine(model_dir, **kw) -> LLMEngine:
    config = dict(model=str(model_dir), dtype="float32", threads=1, kv_cache_tokens=1024)
    return LLMEngine(EngineConfig(**{**config, **kw}))


def _run(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


class Worker(NamedTuple):
    engine: LLMEngine
    transport: KvTransport


def handoff(prefill_worker: Worker, decode_worker: Worker, prompt, params, rid: str):
    """Prefill on one engine, move the blocks, decode on the other: (tokens, pulled)."""
    prefill, decode = prefill_worker.engine, decode_worker.engine
    request = prefill.add_request(prompt, params, rid, prefill_only=True)
    (first,) = _run(prefill)
    assert first.finished and first.finish_reason is None
    assert request.status == RequestStatus.PREFILLED and request.blocks

    continued = decode.new_prefilled_request(prompt, first.new_token_ids[0], params, rid)
    num_cached = decode.reserve_prefilled(continued)
    assert num_cached is not None
    src = request.block_ids[num_cached:]
    if src:
        tag = decode_worker.transport.new_tag()
        received = decode_worker.transport.post_receive(
            tag, continued.block_ids[num_cached : len(request.blocks)], timeout=5
        )
        sent = prefill_worker.transport.send(decode_worker.transport.address, tag, src, timeout=5)
        assert sent.result(5).num_blocks == received.result(5).num_blocks == len(src)
    prefill.free_request(request)
    decode.start_prefilled(continued)
    outs = _run(decode)
    return first.new_token_ids + [t for o in outs for t in o.new_token_ids], len(src)


@pytest.fixture
def engines(tiny_model_dir):
    workers = []
    for _ in range(2):
        engine = _engine(tiny_model_dir)
        transport = create_transport("inproc")
        transport.register_pool(engine.runner.kv_cache)
        workers.append(Worker(engine, transport))
    yield workers
    for worker in workers:
        worker.transport.close()


def test_handoff_gives_one_engines_tokens(tiny_model_dir, engines):
    reference = _engine(tiny_model_dir, enable_prefix_caching=False)
    free = [w.engine.kv_cache.num_free_blocks for w in engines]
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        expected = reference.generate([prompt], params)[0].token_ids
        got, pulled = handoff(*engines, prompt, params, f"r{i}")
        assert got == expected, params
        assert pulled == -(-len(prompt) // 16)
    assert [w.engine.kv_cache.num_free_blocks for w in engines] == free


def test_decode_pulls_only_what_it_does_not_cache(tiny_model_dir, engines):
    params = PARAMS[0]
    shared = list(range(1000, 1064))  # four full blocks
    handoff(*engines, [*shared, 1, 2, 3], params, "a")
    got, pulled = handoff(*engines, [*shared, 9, 8], params, "b")
    assert pulled == 1  # only the tail block; the shared four come from decode's cache
    reference = _engine(tiny_model_dir, enable_prefix_caching=False)
    assert got == reference.generate([[*shared, 9, 8]], params)[0].token_ids


def test_first_token_that_finishes_is_not_handed_off(engines):
    prefill, decode = (w.engine for w in engines)
    params = SamplingParams(max_tokens=1, temperature=0)
    request = prefill.add_request(PROMPTS[0], params, "one", prefill_only=True)
    (out,) = _run(prefill)
    assert out.finish_reason == "length" and not request.blocks
    with pytest.raises(InvalidRequestError, match="first_token_id"):
        decode.new_prefilled_request(PROMPTS[0], out.new_token_ids[0], params, "one")


def test_bad_first_token_is_refused(engines):
    decode = engines[1].engine
    with pytest.raises(InvalidRequestError, match=r"first_token_id: must be in \[0, 49152\)"):
        decode.new_prefilled_request(PROMPTS[0], 49152, PARAMS[0], "bad")
