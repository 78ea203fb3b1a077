"""transformers as the reference oracle: greedy generation and teacher-forced logits from
the Hugging Face implementation of the same weights."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.models.attention import AttentionMetadata


def load_reference(model_dir: Path, dtype: torch.dtype = torch.float32):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    return model


@torch.inference_mode()
def reference_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, eos: int | None
) -> list[int]:
    """Greedy continuation, one prompt at a time (no padding). An explicit all-ones attention
    mask: otherwise generate() masks every prompt token equal to the pad id."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
    )
    return out[0, len(prompt_ids) :].tolist()


def engine(model_dir: Path | str | None, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir) if model_dir else None, dtype="float32", threads=2)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


@torch.inference_mode()
def engine_logits(eng: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits of every position, from one prefill through our runner."""
    kv = eng.kv_cache
    bs = kv.block_size
    blocks = kv.pool.get_new_blocks(kv.blocks_needed(len(token_ids)))
    try:
        block_ids = torch.tensor([b.block_id for b in blocks], dtype=torch.int64)
        pos = torch.arange(len(token_ids))
        meta = AttentionMetadata(
            slot_mapping=block_ids[pos // bs] * bs + pos % bs,
            num_decode_tokens=0,
            decode_block_tables=torch.zeros((0, 0), dtype=torch.int32),
            decode_seq_lens=torch.zeros(0, dtype=torch.int32),
            prefill_query_start_loc=[0, len(token_ids)],
            prefill_seq_lens=[len(token_ids)],
            prefill_block_tables=block_ids.to(torch.int32).unsqueeze(0),
        )
        model = eng.runner.model
        hidden = model.forward(torch.tensor(token_ids), pos, meta, eng.runner.kv_cache)
        return model.compute_logits(hidden)
    finally:
        kv.pool.free_blocks(blocks)
