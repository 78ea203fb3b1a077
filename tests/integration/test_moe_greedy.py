"""Mixture-of-experts models end to end: tiny random-weight Mixtral, Qwen2-MoE (shared
expert, one dense layer), Qwen3-MoE and OLMoE checkpoints built with transformers and saved
as Hugging Face folders. Greedy token ids of our engine equal transformers' `generate`
(float32, one prompt at a time) on mixed-length batches with chunked prefill, so a
request's tokens do not depend on what shares its experts; expert counting sees every routed
token; `pdserve generate --model FOLDER` runs such a folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from oracle import engine, load_reference, reference_greedy

from pdserve.common.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

VOCAB = 49152  # the default model's tokenizer is copied in beside the weights
NEW_TOKENS = 20
PROMPT_LENS = (5, 17, 40, 96, 1, 33)


def _config(family: str):
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, num_experts_per_tok=2,
        initializer_range=0.3,  # peaked distributions: no near-ties for greedy to flip on
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=96, num_local_experts=8)
    if family == "qwen2_moe":  # layer 1 stays dense; shared expert; top-k not renormalised
        return Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48,
                              shared_expert_intermediate_size=80, num_experts=16,
                              mlp_only_layers=[1])  # fmt: skip
    if family == "qwen3_moe":  # per-head q/k norms; renormalised top-k
        return Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48,
                              num_experts=16, norm_topk_prob=True)  # fmt: skip
    return OlmoeConfig(**common, intermediate_size=48, num_experts=8, clip_qkv=3.0)


def build_tiny_moe(folder: Path, family: str, default_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_dir / name).exists():
            shutil.copy(default_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def tiny_moe_dir(request, tmp_path_factory, default_model_dir) -> Path:
    folder = tmp_path_factory.mktemp("moe") / request.param
    return build_tiny_moe(folder, request.param, default_model_dir)


def _prompts(seed: int = 11) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def test_greedy_matches_transformers(tiny_moe_dir):
    prompts = _prompts()
    model = load_reference(tiny_moe_dir)
    expected = [reference_greedy(model, p, NEW_TOKENS, None) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts), "degenerate reference"
    # A 64-token budget: the longer prompts are prefilled in chunks, sharing steps with the
    # shorter ones' decodes, so MoE layers see mixed decode + prefill batches.
    eng = engine(tiny_moe_dir, kv_cache_tokens=4096, max_num_batched_tokens=64,
                 enable_prefix_caching=False, count_expert_tokens=True)  # fmt: skip
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts, params)
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        assert out.token_ids == ref, f"prompt {i} (length {PROMPT_LENS[i]}) diverged"
    assert eng.kv_cache.num_free_blocks == eng.runner.num_blocks

    # Every token fed through the model was routed to top_k experts in every MoE layer.
    counts = eng.runner.expert_token_counts()
    assert counts is not None
    fed = sum(len(p) + NEW_TOKENS - 1 for p in prompts)
    top_k = eng.runner.hf_config.num_experts_per_tok
    sparse = [b.layer for b in eng.runner.model.moe_blocks()]
    for layer in range(counts.shape[0]):
        assert counts[layer].sum().item() == (fed * top_k if layer in sparse else 0)
    assert (counts[sparse] > 0).sum().item() > len(sparse), "routing used a single expert"


def test_pdserve_generate_runs_a_moe_folder(tmp_path, default_model_dir):
    import subprocess
    import sys

    folder = build_tiny_moe(tmp_path / "mixtral", "mixtral", default_model_dir)
    prompt = _prompts(seed=13)[2]
    expected = reference_greedy(load_reference(folder), prompt, 12, None)
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        json.dumps({"token_ids": prompt, "ignore_eos": True}) + "\n"
        + json.dumps({"prompt": "The capital of France is", "max_tokens": 4}) + "\n"
    )  # fmt: skip
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.services.cli", "generate", "--model", str(folder),
         "--input", str(inp), "--output", str(out), "--max-tokens", "12", "--dtype", "float32",
         "--threads", "2", "--kv-cache-tokens", "2048", "--no-progress"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["token_ids"] == expected
    assert rows[1]["prompt_tokens"] > 0 and len(rows[1]["token_ids"]) >= 1
