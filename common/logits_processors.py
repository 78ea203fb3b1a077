"""The sampler's logit adjustments beyond temperature, top-k and top-p, as vLLM defines each:
`logit_bias` (added to the named tokens), `allowed_token_ids` (every other token masked),
`bad_words` (a word's last token masked where the output ends with the rest of it),
`repetition_penalty` (tokens of the prompt or the output: positive logits divided by it,
negative ones multiplied), `frequency_penalty` (minus the penalty times each token's count
in the output) and `presence_penalty` (minus the penalty once for every token the output
holds), and `min_p` (after temperature, tokens less likely than min_p times the most likely
one are dropped). Applied in vLLM's order: bias and masks, then penalties, then (random rows
only) temperature, min_p, top-k/top-p.

Each works row by row on the rows that ask for it, so a request's tokens do not depend on
its batch; the output a penalty counts is everything the request has generated, a lost
leg's and a prefill worker's first token included (`PenaltyHistory`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pdserve.common.request import PenaltyHistory
from pdserve.common.sampling_params import SamplingParams


def wants_penalties(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def apply_logit_bias(logits: Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: each row's `logit_bias` added to its tokens."""
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), device=logits.device)
            logits[i].index_add_(0, ids, bias.to(logits.dtype))


def apply_allowed_tokens(logits: Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: every token outside a row's `allowed_token_ids` at -inf."""
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
            keep[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=logits.device)] = True
            logits[i].masked_fill_(~keep, float("-inf"))


def bad_word_bans(output: Sequence[int], words: Sequence[Sequence[int]]) -> set[int]:
    """The last token of each bad word whose other tokens the output ends with (a
    one-token word is banned always)."""
    banned = set()
    for word in words:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and list(output[-len(prefix) :]) == prefix):
            banned.add(word[-1])
    return banned


def apply_penalties(
    logits: Tensor, params: Sequence[SamplingParams], histories: Sequence[PenaltyHistory | None]
) -> None:
    """In place: repetition, frequency and presence penalties on the rows that ask."""
    vocab = logits.shape[1]
    device = logits.device
    for i, p in enumerate(params):
        history = histories[i]
        if history is None or not wants_penalties(p):
            continue
        output = torch.tensor(list(history.output), dtype=torch.long, device=device)
        counts = torch.bincount(output[output < vocab], minlength=vocab)[:vocab]
        row = logits[i]
        if p.repetition_penalty != 1.0:
            prompt = torch.tensor(list(history.prompt), dtype=torch.long, device=device)
            seen = counts > 0
            seen[prompt[prompt < vocab]] = True
            r = p.repetition_penalty
            penalised = torch.where(row > 0, row / r, row * r)
            row.copy_(torch.where(seen, penalised, row))
        if p.frequency_penalty:
            row.sub_(p.frequency_penalty * counts.to(row.dtype))
        if p.presence_penalty:
            row.sub_(p.presence_penalty * (counts > 0).to(row.dtype))


def apply_min_p(probs: Tensor, min_p: Tensor) -> Tensor:
    """`probs` [N, V] (after temperature) with each row's tokens below `min_p` times its
    most likely token's probability set to 0 (min_p 0: unchanged), renormalised."""
    if not bool((min_p > 0).any()):
        return probs
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1).to(probs.dtype)
    kept = probs.masked_fill(probs < threshold, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)
