"""Tiny random-weight models of each supported dense architecture, saved as Hugging Face
folders with the default model's tokenizer beside them."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def tiny_model(tmp: Path, default_dir: Path, arch: str, **overrides: int) -> Path:
    """A tiny random-weight model of `arch` saved under `tmp`; `overrides` change its config
    (e.g. the head counts)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

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
    common.update(overrides)
    config = {
        "llama": lambda: LlamaConfig(**common),
        "qwen2": lambda: Qwen2Config(**common),  # q/k/v biases
        "mistral": lambda: MistralConfig(**common, sliding_window=None),
    }[arch]()
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":  # make the biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    folder = tmp / "-".join([arch, *(f"{k}{v}" for k, v in sorted(overrides.items()))])
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_dir / name).exists():
            shutil.copy(default_dir / name, folder / name)
    return folder
