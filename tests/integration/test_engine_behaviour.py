"""Engine behaviour on the real default model: seeded sampling independent of the batch,
stop strings, logprobs, aborts and length limits, with no KV block leaked."""

from __future__ import annotations

import pytest
import torch
from oracle import engine

from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams

QUESTION = [{"role": "user", "content": "Tell me about the ocean."}]


@pytest.fixture(scope="module")
def eng(default_model_dir):
    return engine(default_model_dir, dtype="bfloat16", kv_cache_tokens=8192)


def _all_free(eng) -> bool:
    return eng.kv_cache.num_free_blocks == eng.runner.num_blocks


def test_seed_gives_same_tokens_whatever_the_batch(default_model_dir):
    # Prefix caching off: a cache hit changes which tokens a prefill computes, and with them
    # the bf16 rounding of the rest; the seed's guarantee is about the batch.
    eng = engine(
        default_model_dir, dtype="bfloat16", kv_cache_tokens=8192, enable_prefix_caching=False
    )
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    alone = eng.generate([QUESTION], params)[0].token_ids
    others = [
        ("Write a poem.", SamplingParams(max_tokens=30, temperature=1.0)),
        ("hi", SamplingParams(max_tokens=8, temperature=0.0)),
        ("List colors.", SamplingParams(max_tokens=40, temperature=0.7, seed=7)),
    ]
    prompts = [[{"role": "user", "content": p}] for p, _ in others]
    outs = eng.generate(
        [*prompts[:2], QUESTION, prompts[2]], [o[1] for o in others[:2]] + [params, others[2][1]]
    )
    assert outs[2].token_ids == alone
    other_seed = eng.generate([QUESTION], SamplingParams(max_tokens=24, temperature=0.9, seed=99))
    assert other_seed[0].token_ids != alone
    assert _all_free(eng)


def test_stop_string_truncates_text(eng):
    greedy = eng.generate([QUESTION], SamplingParams(max_tokens=40, temperature=0.0))[0]
    words = greedy.text.split()
    stop = " " + words[len(words) // 2]
    cut = greedy.text.index(stop)
    out = eng.generate([QUESTION], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == greedy.text[:cut]
    assert out.token_ids == greedy.token_ids[: len(out.token_ids)]


def test_stop_token_ids_and_ignore_eos(eng):
    greedy = eng.generate([QUESTION], SamplingParams(max_tokens=20, temperature=0.0))[0]
    stop_id = greedy.token_ids[5]
    out = eng.generate(
        [QUESTION], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_id])
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:6]
    hi = [{"role": "user", "content": "hi"}]
    short = eng.generate([hi], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in eng.eos_token_ids
    longer = eng.generate([hi], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))[0]
    assert longer.finish_reason == "length" and len(longer.token_ids) == 64
    assert longer.token_ids[: len(short.token_ids)] == short.token_ids


def test_logprobs(eng):
    out = eng.generate([QUESTION], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))[0]
    assert len(out.logprobs) == 6
    for token_id, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token_id and len(lp.top) == 3
        assert lp.top[0][0] == token_id  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0.0
        probs = torch.tensor([p for _, p in lp.top]).exp()
        assert probs.sum() <= 1.0 + 1e-4


def test_abort_running_and_waiting_frees_blocks(eng):
    free = eng.kv_cache.num_free_blocks
    params = SamplingParams(max_tokens=50, temperature=0.0)
    reqs = [
        eng.add_request([{"role": "user", "content": f"Count to {n}."}], params) for n in range(4)
    ]
    eng.step()
    eng.step()
    assert eng.kv_cache.num_free_blocks < free
    eng.abort_request(reqs[1].request_id)
    late = eng.add_request(QUESTION, params)
    eng.abort_request(late.request_id)  # still waiting
    while eng.has_unfinished_requests():
        eng.step()
    assert reqs[1].status.finish_reason == "abort" and late.status.finish_reason == "abort"
    assert all(r.finished for r in reqs)
    assert _all_free(eng)


def test_length_limits(eng, default_model_dir):
    small = engine(default_model_dir, dtype="bfloat16", kv_cache_tokens=1024, max_model_len=64)
    prompt = list(range(100, 160))  # 60 tokens: 4 left before max_model_len
    out = small.generate([prompt], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        small.add_request(list(range(100, 165)))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        engine(default_model_dir, dtype="bfloat16", kv_cache_tokens=64).add_request(
            list(range(100, 150)), SamplingParams(max_tokens=100)
        )
    assert _all_free(small)
