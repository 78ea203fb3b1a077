"""Tiny random-weight models of each supported dense architecture, saved as Hugging Face
folders with the default model's tokenizer beside them. Qwen3 and Gemma 3 switch their
quirks on: per-head q/k norms with random weights; Gemma 3 also its sliding-window layers
(a window of `SLIDING_WINDOW` tokens, shorter than the tests' prompts) between global
ones, a local rotary base and linear rotary scaling on the global layers, its query scale,
and random weights in every one of its (1 + weight) norms."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

SLIDING_WINDOW = 8  # Gemma 3's local layers (and Qwen3's when asked for)


def tiny_model(tmp: Path, default_dir: Path, arch: str, **overrides: Any) -> Path:
    """A tiny random-weight model of `arch` saved under `tmp`; `overrides` change its config
    (e.g. the head counts)."""
    from transformers import (
        AutoModelForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(
        vocab_size=49152,  # the default model's tokenizer is copied in beside the weights
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,  # peaked distributions: no near-ties for greedy to flip on
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch in ("qwen3", "gemma3"):
        common["head_dim"] = 16  # not hidden_size / heads for every head count
    if arch == "gemma3":
        common.update(
            tie_word_embeddings=True,
            sliding_window=SLIDING_WINDOW,
            sliding_window_pattern=2,  # layers: local, global, local
            query_pre_attn_scalar=24,  # the scale is not 1 / sqrt(head_dim)
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            },
        )
    common.update(overrides)
    config = {
        "llama": lambda: LlamaConfig(**common),
        "qwen2": lambda: Qwen2Config(**common),  # q/k/v biases
        "mistral": lambda: MistralConfig(**common, sliding_window=None),
        "qwen3": lambda: Qwen3Config(**common),
        "gemma3": lambda: Gemma3TextConfig(**common),
    }[arch]()
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2" or overrides.get("attention_bias"):  # make the biases matter
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                if proj.bias is not None:
                    torch.nn.init.normal_(proj.bias, std=0.5)
    if arch in ("qwen3", "gemma3"):  # make the norms' weights matter (they start at 1 or 0)
        for name, param in model.named_parameters():
            if "norm" in name:
                # Gemma's layer outputs, normed, must not drown in its scaled embeddings.
                mean = 1.0 if arch == "qwen3" else (3.0 if ".post_" in name else 0.0)
                torch.nn.init.normal_(param, mean=mean, std=0.3)
    if arch == "gemma3":  # smaller (tied) embeddings, a larger final norm: peaked logits
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.3)
            torch.nn.init.normal_(model.model.norm.weight, mean=5.0, std=0.3)
    if arch == "gemma3":
        model.config.architectures = ["Gemma3ForCausalLM"]
    folder = tmp / "-".join([arch, *(f"{k}{v}" for k, v in sorted(overrides.items()))])
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_dir / name).exists():
            shutil.copy(default_dir / name, folder / name)
    return folder
