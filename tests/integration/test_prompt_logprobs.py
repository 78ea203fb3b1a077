"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`) from the
engine: in float32 every prompt token's log-probability, rank and top alternatives agree with
transformers' teacher-forced distribution to 1e-4; in the default dtype they are bit-identical
alone, in a batch, chunked and after the prompt was cached; asking for them changes no
sampled token; every KV block is free at the end."""

from __future__ import annotations

import pytest
import torch
from chat_prompts import QUESTIONS
from oracle import engine, load_reference

from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams

TOP = 5
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
WITH_PROMPT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _all_free(eng) -> bool:
    return eng.kv_cache.num_free_blocks == eng.runner.num_blocks and not (
        eng.has_unfinished_requests()
    )


def test_float32_prompt_logprobs_match_transformers(default_model_dir):
    eng = engine(default_model_dir, kv_cache_tokens=4096)
    model = load_reference(default_model_dir)
    for text in QUESTIONS[:2]:
        ids = eng.tokenize(_chat(text))
        out = eng.generate([ids], WITH_PROMPT)[0]
        with torch.inference_mode():
            ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(ids) - 1
        for i, entry in enumerate(entries):
            row = ref[i]
            assert entry.token_id == ids[i + 1]
            assert abs(entry.logprob - row[ids[i + 1]].item()) <= 1e-4
            # Its rank, up to tokens within the tolerance of it.
            above = int((row > row[ids[i + 1]] + 1e-4).sum()) + 1
            tied = int((row > row[ids[i + 1]] - 1e-4).sum())
            assert above <= entry.rank <= tied
            values = [v for _, v in entry.top]
            assert len(values) == TOP
            assert torch.allclose(torch.tensor(values), row.topk(TOP).values, atol=1e-4)
            for token, value in entry.top:
                assert abs(value - row[token].item()) <= 1e-4
    assert _all_free(eng)


def test_prompt_logprobs_do_not_depend_on_batch_chunking_or_cache(default_model_dir):
    wide = engine(default_model_dir, dtype="auto", kv_cache_tokens=16384)
    prompts = [wide.tokenize(_chat(q)) for q in QUESTIONS[:3]]
    alone = [wide.generate([p], WITH_PROMPT)[0] for p in prompts]
    plain = [wide.generate([p], GREEDY)[0] for p in prompts]
    # Asking for them changes no sampled token.
    assert [o.token_ids for o in alone] == [o.token_ids for o in plain]
    # The prompts are cached now: a request asking for prompt logprobs computes its prompt
    # anyway, and gets the same bits.
    again = wide.generate([prompts[0]], WITH_PROMPT)[0]
    assert again.cached_tokens == 0
    assert again.prompt_logprobs == alone[0].prompt_logprobs
    assert wide.generate([prompts[0]], GREEDY)[0].cached_tokens > 0
    assert _all_free(wide)

    # In a batch with others, every prompt chunked by a 24-token step budget.
    narrow = engine(
        default_model_dir,
        dtype="auto",
        kv_cache_tokens=16384,
        max_num_batched_tokens=24,
        max_num_seqs=3,
    )
    others = [narrow.tokenize(_chat(q)) for q in QUESTIONS[4:7]]
    params = [WITH_PROMPT] * len(prompts) + [GREEDY] * len(others)
    batched = narrow.generate(prompts + others, params)
    for solo, mixed in zip(alone, batched, strict=False):
        assert mixed.prompt_logprobs == solo.prompt_logprobs
        assert mixed.token_ids == solo.token_ids
    assert all(o.prompt_logprobs is None for o in batched[len(prompts) :])
    assert _all_free(narrow)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(prompt_logprobs=bad).validate()
    assert err.value.field == "prompt_logprobs"
