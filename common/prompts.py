"""Prompts into token ids, the first thing on a request's path (the coordinator and every
engine do it the same way): text is encoded, chat messages go through the model's chat
template, token ids are checked against the vocabulary. Also the context limit a model
allows, so the coordinator can refuse an over-long prompt before any worker sees it."""

from __future__ import annotations

import json
from typing import Any

from pdserve.common.errors import InvalidRequestError
from pdserve.common.models.families import unmasked_window

# A prompt: text, chat messages ([{"role": ..., "content": ...}]), or token ids.
Prompt = str | list[dict[str, Any]] | list[int]

# Tools shown to a model whose chat template has no place for them (Hermes' format, which
# Qwen and many fine-tunes read): in the system turn, calls as <tool_call> blocks.
TOOLS_SYSTEM = (
    "You may call one or more functions to assist with the user query. The functions are "
    "described in JSON within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
    "function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders `tools` (and assistant tool calls)."""
    return "tools" in str(getattr(tokenizer, "chat_template", None) or "")


def with_tools_in_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list:
    """Messages for a template without tool support: the tools in the system turn, calls
    and results as Hermes' <tool_call> / <tool_response> text."""
    rendered = []
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = TOOLS_SYSTEM.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            rendered.append({"role": "system", "content": messages[0]["content"] + "\n\n" + block})
            messages = messages[1:]
        else:
            rendered.append({"role": "system", "content": block})
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            rendered.append({"role": "user", "content": text})
        elif m.get("tool_calls"):
            calls = [
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c in m["tool_calls"]
            ]  # fmt: skip
            content = "\n".join(filter(None, [m.get("content") or "", *calls]))
            rendered.append({"role": m["role"], "content": content})
        else:
            rendered.append({"role": m["role"], "content": m["content"]})
    return rendered


def tokenize_prompt(
    tokenizer: Any, prompt: Prompt, vocab_size: int, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """`tools` (chat messages only): OpenAI-shaped function tools for the chat template,
    or rendered into the messages where the template has no place for them."""
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
        messages: list[dict[str, Any]] = prompt  # type: ignore[assignment]
        extra: dict[str, Any] = {}
        uses_tools = bool(tools) or any(m.get("tool_calls") for m in messages)
        if uses_tools and template_takes_tools(tokenizer):
            extra["tools"] = tools or None
        elif uses_tools:  # (a lone tool turn is left to the template, which may refuse it)
            messages = with_tools_in_text(messages, tools or [])
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    raise InvalidRequestError("prompt", "a list prompt must be all token ids or all messages")


def max_model_len(hf_config: Any, configured: int | None) -> int:
    """The longest prompt + output: the model's position limit (and the sliding window of a
    family whose window we do not mask, since we then attend over the full context),
    lowered by `configured` if given."""
    limit = hf_config.max_position_embeddings
    window = unmasked_window(hf_config)
    if window:
        limit = min(limit, window)
    return min(configured or limit, limit)
