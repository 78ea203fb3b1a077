"""Qwen3 (dense) and Gemma 3 (text) end to end, on tiny random-weight checkpoints built with
transformers (`tiny_models.py`) that switch their quirks on: per-head q/k norms, and for
Gemma 3 sliding-window layers with a window shorter than most prompts between global ones,
scaled embeddings, (1 + weight) norms around attention and the MLP, the GELU MLP, its query
scale, two rotary bases and tied embeddings.

- float32 greedy ids equal transformers' on mixed-length prompts, batched, chunked and with
  prefix-cache hits; the window changes Gemma's ids on these prompts, so a kernel that
  ignored it would fail here.
- bfloat16 ids of a prompt alone equal its ids in a batch and under any chunking.
- Chat messages go through the model folder's chat template.
- Tensor parallelism over 2 ranks (uneven head split) gives transformers' ids.
- Qwen3 with sliding layers (`use_sliding_window`) matches transformers too.
Every run ends with every KV block free."""

from __future__ import annotations

import random

import pytest
import torch
from oracle import engine, load_reference, reference_greedy
from tiny_models import SLIDING_WINDOW, tiny_model

from pdserve.common.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

VOCAB = 49152
NEW_TOKENS = 16
PROMPT_LENS = (5, 17, 40, 96, 1, 33, 9)
ARCHS = ["qwen3", "gemma3"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny_dir(request, tmp_path_factory, default_model_dir):
    return tiny_model(tmp_path_factory.mktemp(request.param), default_model_dir, request.param)


def _prompts(seed: int = 11, lens=PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lens]


def _greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _all_free(eng) -> bool:
    return eng.kv_cache.num_free_blocks == eng.runner.num_blocks


def test_float32_greedy_matches_transformers(tiny_dir):
    prompts = _prompts()
    model = load_reference(tiny_dir)
    expected = [reference_greedy(model, p, NEW_TOKENS, None) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts), "degenerate reference"
    if model.config.model_type == "gemma3_text":
        assert max(PROMPT_LENS) > 2 * SLIDING_WINDOW
        model.config.sliding_window = 4096  # every layer global: other ids on long prompts
        unwindowed = [reference_greedy(model, p, NEW_TOKENS, None) for p in prompts]
        assert unwindowed != expected, "the window does not matter on these prompts"
    # Chunked prefill (a 24-token budget) next to other requests' decodes.
    eng = engine(tiny_dir, kv_cache_tokens=4096, max_num_batched_tokens=24)
    for round_ in range(2):  # the second round reads the first one's prefixes from the cache
        hits = eng.scheduler.stats.prefix_cache_hits
        outs = eng.generate(prompts, _greedy())
        for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
            assert out.token_ids == ref, f"round {round_}: prompt {i} ({PROMPT_LENS[i]} tokens)"
        assert _all_free(eng)
    assert eng.scheduler.stats.prefix_cache_hits - hits >= 16 * 3  # 3 prompts of >1 block


def test_bf16_ids_do_not_depend_on_batch_or_chunking(tiny_dir):
    prompts = _prompts(seed=5, lens=(70, 33, 9, 120, 2, 48))
    wide = engine(tiny_dir, dtype="bfloat16", kv_cache_tokens=8192, enable_prefix_caching=False)
    alone = [wide.generate([p], _greedy(20))[0].token_ids for p in prompts]
    assert len({tuple(a) for a in alone}) == len(prompts), "degenerate ids"
    assert [o.token_ids for o in wide.generate(prompts, _greedy(20))] == alone
    assert _all_free(wide)
    rng = random.Random(0)
    for budget, seqs in ((7, 3), (16, 8), (33, 2)):
        narrow = engine(tiny_dir, dtype="bfloat16", kv_cache_tokens=8192,
                        max_num_batched_tokens=budget, max_num_seqs=seqs,
                        enable_prefix_caching=False)  # fmt: skip
        fillers = _prompts(seed=budget, lens=[rng.randint(1, 90) for _ in range(6)])
        mixed = [(p, True) for p in prompts] + [(f, False) for f in fillers]
        rng.shuffle(mixed)
        params = [_greedy(20) if mine else _greedy(rng.randint(2, 25)) for _, mine in mixed]
        outs = narrow.generate([p for p, _ in mixed], params)
        got = {tuple(p): o.token_ids for (p, mine), o in zip(mixed, outs, strict=True) if mine}
        assert [got[tuple(p)] for p in prompts] == alone, f"budget {budget}"
        assert _all_free(narrow)


def test_chat_messages_go_through_the_folder_template(tiny_dir):
    eng = engine(tiny_dir, kv_cache_tokens=2048)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = eng.tokenize(messages)
    assert ids == eng.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    out = eng.generate([messages], _greedy(8))[0]
    assert out.token_ids == reference_greedy(load_reference(tiny_dir), ids, 8, None)
    assert _all_free(eng)


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_2_matches_transformers(tmp_path, default_model_dir, arch):
    """6 query heads over 3 KV heads: rank 0 takes 2 KV heads, rank 1 one; Gemma with
    `attention_bias` (q/k/v biases by head, o_proj's added once)."""
    from test_tensor_parallel import generate

    bias = {"attention_bias": True} if arch == "gemma3" else {}
    folder = tiny_model(tmp_path, default_model_dir, arch, num_attention_heads=6,
                        num_key_value_heads=3, hidden_size=96, **bias)  # fmt: skip
    prompts = _prompts(seed=31, lens=(5, 40, 1, 17))
    lines = [{"token_ids": p, "max_tokens": 12, "ignore_eos": True} for p in prompts]
    rows = generate(tmp_path, lines, "--model", str(folder), "--dtype", "float32",
                    "--tensor-parallel", "2", "--max-num-batched-tokens", "16")  # fmt: skip
    model = load_reference(folder)
    for prompt, row in zip(prompts, rows, strict=True):
        assert row["token_ids"] == reference_greedy(model, prompt, 12, None)


def test_qwen3_sliding_layers_match_transformers(tmp_path, default_model_dir):
    """Qwen3 with `use_sliding_window`: the layers from `max_window_layers` on slide."""
    folder = tiny_model(tmp_path, default_model_dir, "qwen3", use_sliding_window=True,
                        sliding_window=SLIDING_WINDOW, max_window_layers=1)  # fmt: skip
    prompts = _prompts(seed=3)
    model = load_reference(folder)
    assert model.config.layer_types == ["full_attention"] + ["sliding_attention"] * 2
    expected = [reference_greedy(model, p, NEW_TOKENS, None) for p in prompts]
    model.config.sliding_window = 4096
    assert [reference_greedy(model, p, NEW_TOKENS, None) for p in prompts] != expected
    eng = engine(folder, kv_cache_tokens=4096, max_num_batched_tokens=24)
    assert [o.token_ids for o in eng.generate(prompts, _greedy())] == expected
    assert _all_free(eng)
