"""The determinism contract end to end on the real default model, in the default dtype
(bfloat16 where the CPU has it) and in float32: a request's greedy tokens do not depend on
what else is in its batch, on how its prompt is chunked, or on a prefix-cache hit; a
seeded request's samples neither. Exact ids, no tolerance. `test_isa_classes.py` runs this
module again under each instruction-set class below the host's own."""

from __future__ import annotations

import random

import pytest
from chat_prompts import QUESTIONS
from oracle import engine

from pdserve.common.sampling_params import SamplingParams

PROMPTS = [
    *QUESTIONS,
    "Summarise the plot of Hamlet in one sentence.",
    "What does a compiler do?",
    "Suggest a name for a grey cat.",
    "Why do leaves change colour in autumn?",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _all_free(eng) -> bool:
    return eng.kv_cache.num_free_blocks == eng.runner.num_blocks


@pytest.fixture(scope="module", params=["auto", "float32"])
def dtype(request) -> str:
    return request.param


def test_greedy_ids_do_not_depend_on_batch_or_chunking(default_model_dir, dtype):
    wide = engine(default_model_dir, dtype=dtype, kv_cache_tokens=16384)
    alone = [wide.generate([_chat(p)], GREEDY)[0].token_ids for p in PROMPTS]
    assert _all_free(wide)
    # The same prompts shuffled among 20 others, through a 24-token step budget with at most
    # 3 sequences a step: every prompt is chunked, and every decode shares its step.
    narrow = engine(
        default_model_dir,
        dtype=dtype,
        kv_cache_tokens=16384,
        max_num_batched_tokens=24,
        max_num_seqs=3,
        enable_prefix_caching=False,
    )
    rng = random.Random(0)
    fillers = [
        f"Tell me fact number {i} about {rng.choice(['rivers', 'stars', 'bees'])}."
        for i in range(20)
    ]
    mixed = [(p, True) for p in PROMPTS] + [(f, False) for f in fillers]
    rng.shuffle(mixed)
    params = [
        GREEDY if mine else SamplingParams(max_tokens=rng.randint(4, 30)) for _, mine in mixed
    ]
    outs = narrow.generate([_chat(p) for p, _ in mixed], params)
    got = {p: o.token_ids for (p, mine), o in zip(mixed, outs, strict=True) if mine}
    assert [got[p] for p in PROMPTS] == alone
    assert _all_free(narrow)
    # All of them in one batch on the wide engine.
    together = wide.generate([_chat(p) for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in together] == alone


def test_prefix_cache_hit_gives_the_same_tokens(default_model_dir, dtype):
    eng = engine(default_model_dir, dtype=dtype, kv_cache_tokens=16384, max_num_batched_tokens=40)
    system = {"role": "system", "content": "You are a terse assistant. " * 12}
    first = eng.generate([[system, *_chat(PROMPTS[0])]], GREEDY)[0]
    again = eng.generate([[system, *_chat(PROMPTS[0])]], GREEDY)[0]
    assert again.cached_tokens > 0  # the precondition: the second run hit the cache
    assert again.token_ids == first.token_ids
    # A different question behind the cached system prompt, against a cold engine.
    cold = engine(
        default_model_dir, dtype=dtype, kv_cache_tokens=16384, enable_prefix_caching=False
    )
    other = [system, *_chat(PROMPTS[1])]
    assert eng.generate([other], GREEDY)[0].token_ids == cold.generate([other], GREEDY)[0].token_ids
    assert _all_free(eng) and _all_free(cold)


def test_seeded_samples_do_not_depend_on_the_batch(default_model_dir, dtype):
    eng = engine(default_model_dir, dtype=dtype, kv_cache_tokens=16384, max_num_batched_tokens=32)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = eng.generate([_chat(PROMPTS[2])], seeded)[0].token_ids
    noise = [SamplingParams(max_tokens=16, temperature=1.0), SamplingParams(max_tokens=9, seed=7)]
    outs = eng.generate(
        [_chat(PROMPTS[3]), _chat(PROMPTS[2]), _chat(PROMPTS[4])], [noise[0], seeded, noise[1]]
    )
    assert outs[1].token_ids == alone
    assert _all_free(eng)
