"""Greedy tokens equal transformers' on the same weights in float32: the default model on
16 chat prompts of mixed lengths, in one batch, with prefix-cache hits, with chunked prefill,
and with preemption forced by a tiny KV pool; and tiny random-weight Llama, Qwen2 and
Mistral models. Every run ends with every KV block free."""

from __future__ import annotations

import pytest
import torch
from oracle import engine, engine_logits, load_reference, reference_greedy

from pdserve.common.sampling_params import SamplingParams

NEW_TOKENS = 32

CHAT_PROMPTS = [
    "What is the capital of France?",
    "hi",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Tell me a short story about a robot who learns to paint. Keep it under 100 words and "
    "give the robot a name.",
    "Why do we have seasons on Earth?",
    "Give me a recipe for pancakes.",
    "What does a compiler do?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Name the planets of the solar system in order from the sun, and say one interesting "
    "fact about each of them, briefly.",
    "How do I reverse a list in Python?",
    "What's the difference between weather and climate?",
    "Suggest a name for a bakery.",
]


@pytest.fixture(scope="module")
def reference_outputs(default_model_dir):
    """transformers' greedy continuation of every prompt, computed once for the module."""
    eng = engine(default_model_dir, kv_cache_tokens=64)
    prompts = [eng.tokenize([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    model = load_reference(default_model_dir)
    eos = eng.tokenizer.eos_token_id
    return prompts, [reference_greedy(model, ids, NEW_TOKENS, eos) for ids in prompts]


def _run_and_compare(eng, prompts, expected):
    free_before = eng.kv_cache.num_free_blocks
    outs = eng.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        assert out.token_ids == ref, f"prompt {i} ({CHAT_PROMPTS[i]!r}) diverged"
        assert out.finish_reason == ("stop" if len(ref) < NEW_TOKENS else "length")
    assert eng.kv_cache.num_free_blocks == free_before == eng.runner.num_blocks
    assert not eng.has_unfinished_requests()
    return outs


def test_default_model_one_batch_with_prefix_hits(default_model_dir, reference_outputs):
    prompts, expected = reference_outputs
    eng = engine(default_model_dir, kv_cache_tokens=16 * 1024)
    _run_and_compare(eng, prompts, expected)
    assert len({len(p) for p in prompts}) > 8, "prompts should have mixed lengths"
    # All were admitted in the same step, before any block was registered: no hits yet.
    # A second pass over the same prompts is served from the prefix cache and still exact.
    hits = eng.scheduler.stats.prefix_cache_hits
    outs = _run_and_compare(eng, prompts, expected)
    assert eng.scheduler.stats.prefix_cache_hits - hits >= sum(len(p) - 16 for p in prompts)
    assert all(o.cached_tokens >= len(p) - 16 for o, p in zip(outs, prompts, strict=True))


def test_default_model_chunked_prefill(default_model_dir, reference_outputs):
    prompts, expected = reference_outputs
    # A 24-token budget splits every prompt (all are longer) into several chunks that share
    # steps with other requests' decodes.
    eng = engine(default_model_dir, max_num_batched_tokens=24, enable_prefix_caching=False)
    _run_and_compare(eng, prompts, expected)


def test_default_model_preemption_by_tiny_kv_pool(default_model_dir, reference_outputs):
    prompts, expected = reference_outputs
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    eng = engine(default_model_dir, kv_cache_tokens=longest + 48, block_size=16)
    _run_and_compare(eng, prompts, expected)
    assert eng.scheduler.stats.num_preemptions > 0


def test_tiny_random_models_match(tiny_model_dir):
    eng = engine(tiny_model_dir, kv_cache_tokens=4096, max_num_batched_tokens=64)
    model = load_reference(tiny_model_dir)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 40, 96, 1)]
    expected = [reference_greedy(model, p, 24, None) for p in prompts]
    outs = eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for out, ref in zip(outs, expected, strict=True):
        assert out.token_ids == ref
    assert eng.kv_cache.num_free_blocks == eng.runner.num_blocks


def test_teacher_forced_logits_close(default_model_dir, reference_outputs):
    """float32: max |Δlogit| < 1e-3 over every position (logits are O(10)); bfloat16
    against the float32 reference: same argmax on at least 95% of positions."""
    prompts, expected = reference_outputs
    model = load_reference(default_model_dir)
    seq = prompts[7] + expected[7]
    with torch.inference_mode():
        ref = model(torch.tensor([seq])).logits[0].float()
    ours = engine_logits(engine(default_model_dir, kv_cache_tokens=1024), seq)
    assert (ours - ref).abs().max().item() < 1e-3
    bf16 = engine_logits(engine(default_model_dir, kv_cache_tokens=1024, dtype="bfloat16"), seq)
    agree = (bf16.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.95
