"""Prompts into token ids, the first thing on a request's path (the coordinator and every
engine do it the same way): text is encoded, chat messages go through the model's chat
template, token ids are checked against the vocabulary. Also the context limit a model
allows, so the coordinator can refuse an over-long prompt before any worker sees it."""

from __future__ import annotations

from typing import Any

from pdserve.common.errors import InvalidRequestError

# A prompt: text, chat messages ([{"role": ..., "content": ...}]), or token ids.
Prompt = str | list[dict[str, str]] | list[int]


def tokenize_prompt(tokenizer: Any, prompt: Prompt, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        return tokenizer.encode(prompt)
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError(
            "prompt", "must be a non-empty string, list of messages or list of token ids"
        )
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)  # type: ignore[operator]
        if bad is not None:
            raise InvalidRequestError("token_ids", f"ids must be in [0, {vocab_size}), got {bad}")
        return list(prompt)  # type: ignore[arg-type]
    if all(isinstance(m, dict) for m in prompt):
        for i, m in enumerate(prompt):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):  # type: ignore[union-attr]
                raise InvalidRequestError(f"messages[{i}]", "must have string 'role' and 'content'")
        ids = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    raise InvalidRequestError("prompt", "a list prompt must be all token ids or all messages")


def max_model_len(hf_config: Any, configured: int | None) -> int:
    """The longest prompt + output: the model's position limit (and sliding window, since
    we attend over the full context), lowered by `configured` if given."""
    limit = hf_config.max_position_embeddings
    if getattr(hf_config, "sliding_window", None) and getattr(
        hf_config, "use_sliding_window", True
    ):
        limit = min(limit, hf_config.sliding_window)
    return min(configured or limit, limit)
