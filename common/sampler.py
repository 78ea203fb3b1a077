"""Token sampling: turns one step's logits into one token per sampling request.

The engine calls `Sampler.sample` once per step with the logits of the positions that sample
(the last position of each running request) and every such request's `SamplingParams` and
per-request `torch.Generator`. Greedy rows take the argmax; random rows are temperature-scaled,
masked by top-k then top-p in one batched pass, and drawn by an exponential race. A request
with a seed owns a generator (created once by the caller with
``torch.Generator(device).manual_seed(seed)``) and its draw uses only that generator and its
own row, so its tokens do not depend on what else is in the batch. Unseeded rows share the
global RNG. Log-probabilities, when asked for, are those of the model's raw distribution
(``log_softmax`` of the unmodified logits)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pdserve.common.logits_processors import (
    apply_allowed_tokens,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
)
from pdserve.common.request import PenaltyHistory
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured_output import Constraint, apply_bitmasks
from pdserve.kernels import fused_ops


class TokenLogprobs(NamedTuple):
    """Log-probabilities at one step for one request."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability
    top: list[tuple[int, float]]  # the `logprobs` most likely (token_id, logprob), best first
    rank: int = 0  # its rank in the distribution (1: the most likely)


def token_logprobs(logits: Tensor, targets: Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Row i of `logits` [N, V] is the distribution that gave token `targets[i]` (sampled,
    or the prompt's next: vLLM's prompt_logprobs): its log-probability, its rank, and the
    row's `num_top[i]` most likely tokens, all of the unmodified distribution."""
    if logits.shape[0] == 0:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    ranks: list[int] = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    k = min(max(num_top), logprobs.shape[1])
    top_v: list[list[float]] = [[] for _ in num_top]
    top_i: list[list[int]] = [[] for _ in num_top]
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)
        top_v, top_i = values.tolist(), indices.tolist()
    return [
        TokenLogprobs(t, lp, list(zip(ti[:n], tv[:n], strict=True)), rank)
        for t, lp, ti, tv, n, rank in zip(
            targets.tolist(),
            chosen.squeeze(1).tolist(),
            top_i,
            top_v,
            num_top,
            ranks,
            strict=True,
        )
    ]


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # one per row; None where params.logprobs is None


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Return ``logits`` [N, V] with the tokens outside each row's top-k, then top-p, set to -inf.

    ``top_k`` [N] (int): keep the k highest logits; -1 (or any k < 1 or k >= V) disables.
    ``top_p`` [N] (float): of what top-k kept, keep the smallest set of most likely tokens
    whose probability reaches p (a token is kept when the tokens ranked above it sum to less
    than p); p >= 1 disables. Ties at the cut are broken by position (stable sort), so top-k
    keeps exactly k. The most likely token is always kept. The input is not modified."""
    n, vocab = logits.shape
    k = top_k.to(device=logits.device, dtype=torch.long)
    p = top_p.to(device=logits.device, dtype=logits.dtype)
    use_k = bool(((k >= 1) & (k < vocab)).any())
    use_p = bool((p < 1.0).any())
    if not (use_k or use_p):
        return logits.clone()
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=logits.device).expand(n, vocab)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.where((k >= 1) & (k < vocab), k, vocab)
        drop |= ranks >= k.unsqueeze(1)
    if use_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        drop |= (mass_above >= p.unsqueeze(1)) & (p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def _exponential_race(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """Draw one index per row with probability ``probs``: argmax(probs / Exp(1) noise)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    # Exp(1) can round to 0; masked tokens (prob 0) would then give 0/0 = nan.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


class Sampler:
    """Stateless: every call gets the rows' params and generators."""

    def sample(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned: list[frozenset[int]] | None = None,
        constraints: list[Constraint | None] | None = None,
        histories: list[PenaltyHistory | None] | None = None,
    ) -> SamplerOutput:
        """``banned[i]``: token ids row i must not draw (a request under its min_tokens, a
        bad word's last token); ``constraints[i]``: row i's grammar state, whose allowed
        tokens alone it may draw (structured output); ``histories[i]``: what row i's
        penalties count. Log-probabilities stay those of the unmodified logits."""
        n = logits.shape[0]
        if len(params) != n or len(generators) != n:
            raise ValueError(
                f"sample: {n} logits rows, {len(params)} params, {len(generators)} generators"
            )
        if n == 0:
            return SamplerOutput([], [])
        raw = logits = logits.float()
        device = logits.device
        tokens = torch.empty(n, dtype=torch.long, device=device)
        logits = self._adjust(raw, params, banned, constraints, histories)

        greedy = [i for i, sp in enumerate(params) if sp.greedy]
        if len(greedy) == n:  # the common case: no copy of the [n, vocab] logits
            tokens = fused_ops.argmax(logits)
        elif greedy:
            rows = torch.tensor(greedy, device=device)
            tokens[rows] = fused_ops.argmax(logits[rows])

        rand = [i for i, sp in enumerate(params) if not sp.greedy]
        if rand:
            rows = torch.tensor(rand, device=device)
            temps = torch.tensor([params[i].temperature for i in rand], device=device)
            top_k = torch.tensor([params[i].top_k for i in rand], device=device)
            top_p = torch.tensor([params[i].top_p for i in rand], device=device)
            min_p = torch.tensor([params[i].min_p for i in rand], device=device)
            scaled = logits[rows] / temps.unsqueeze(1)
            if bool((min_p > 0).any()):  # vLLM's order: temperature, min_p, top-k/top-p
                scaled = apply_min_p(scaled.softmax(dim=-1), min_p).log()
            probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
            shared = [j for j, i in enumerate(rand) if generators[i] is None]
            if shared:
                idx = torch.tensor(shared, device=device)
                tokens[rows[idx]] = _exponential_race(probs[idx], None)
            for j, i in enumerate(rand):
                if generators[i] is not None:
                    tokens[i] = _exponential_race(probs[j : j + 1], generators[i])[0]

        token_ids: list[int] = tokens.tolist()
        return SamplerOutput(token_ids, self._logprobs(raw, params, tokens))

    @staticmethod
    def _adjust(
        raw: Tensor,
        params: list[SamplingParams],
        banned: list[frozenset[int]] | None,
        constraints: list[Constraint | None] | None,
        histories: list[PenaltyHistory | None] | None,
    ) -> Tensor:
        """The logits the rows draw from: `raw` itself when nothing adjusts them, else a copy
        with logit_bias and allowed_token_ids, the banned tokens, the penalties and then the
        grammar masks applied (`logits_processors.py`, `structured_output.py`)."""
        bias = any(p.logit_bias or p.allowed_token_ids for p in params)
        ban = banned is not None and any(banned)
        penalise = histories is not None and any(h is not None for h in histories)
        constrain = constraints is not None and any(c is not None for c in constraints)
        if not (bias or ban or penalise or constrain):
            return raw
        if not (bias or ban or penalise):  # masks alone: written into a new tensor at once
            assert constraints is not None
            return apply_bitmasks(raw, constraints, inplace=False)
        logits = raw.clone()
        if bias:
            apply_logit_bias(logits, params)
            apply_allowed_tokens(logits, params)
        if ban:
            assert banned is not None
            vocab = logits.shape[1]
            cols = [t for b in banned for t in b if t < vocab]
            rows = [i for i, b in enumerate(banned) for t in b if t < vocab]
            index = (torch.tensor(rows, dtype=torch.long, device=logits.device),
                     torch.tensor(cols, dtype=torch.long, device=logits.device))  # fmt: skip
            logits[index] = float("-inf")
        if penalise:
            assert histories is not None
            apply_penalties(logits, params, histories)
        if constrain:
            assert constraints is not None
            apply_bitmasks(logits, constraints)
        return logits

    @staticmethod
    def _logprobs(
        logits: Tensor, params: list[SamplingParams], tokens: Tensor
    ) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(params)
        want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        if not want:
            return out
        rows = torch.tensor(want, device=logits.device)
        tops = [params[i].logprobs or 0 for i in want]
        entries = token_logprobs(logits[rows], tokens[rows], tops)
        for i, entry in zip(want, entries, strict=True):
            out[i] = entry
        return out
