"""Sampler: greedy, masks, temperature, seeded reproducibility independent of the batch, and
logprobs of the raw distribution."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.common.sampler import Sampler, apply_top_k_top_p
from pdserve.common.sampling_params import SamplingParams

VOCAB = 64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(seed)


def _logits(steps: int, rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(steps, rows, VOCAB, generator=_gen(seed)) * 2


def test_greedy_is_argmax() -> None:
    logits = _logits(1, 8)[0].to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, top_k=3, seed=1) for _ in range(8)]
    out = Sampler().sample(logits, params, [None] * 8)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_rows_must_match() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(_logits(1, 2)[0], [SamplingParams()], [None])
    assert Sampler().sample(torch.empty(0, VOCAB), [], []) == ([], [])


# A seeded request, and the batch positions / neighbours it is run with.
SEEDED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=1234)
NEIGHBOURS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.5, seed=99),
]


def _run_seeded(layout: list[int], steps: int = 12) -> list[int]:
    """Sample `steps` tokens for SEEDED placed among NEIGHBOURS[i] for i in layout (-1 marks
    SEEDED's row). Its logits are the same every run; the others' differ per run."""
    logits = _logits(steps, 1, seed=5)
    noise = _logits(steps, len(layout), seed=len(layout) + sum(layout) * 7)
    params = [SEEDED if i < 0 else NEIGHBOURS[i] for i in layout]
    gens = [_gen(p.seed) if p.seed is not None else None for p in params]
    row = layout.index(-1)
    torch.manual_seed(len(layout))  # the global RNG differs run to run too
    tokens = []
    for step in range(steps):
        batch = noise[step].clone()
        batch[row] = logits[step, 0]
        tokens.append(Sampler().sample(batch, params, gens).token_ids[row])
    return tokens


def test_seed_reproducible_whatever_the_batch() -> None:
    alone = _run_seeded([-1])
    assert _run_seeded([-1]) == alone
    for layout in ([0, -1], [-1, 1, 2], [3, 2, -1, 1, 0], [1, 1, -1, 0, 3, 2]):
        assert _run_seeded(layout) == alone, layout


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: any two seeds should disagree within 8 steps
    params = [SamplingParams(temperature=1.0)]
    runs = []
    for seed in range(4):
        g = _gen(seed)
        runs.append([Sampler().sample(logits, params, [g]).token_ids[0] for _ in range(8)])
    assert len({tuple(r) for r in runs}) == 4


def test_top_k_keeps_exactly_k() -> None:
    logits = _logits(1, 5)[0]
    top_k = torch.tensor([1, 3, 17, -1, VOCAB])
    masked = apply_top_k_top_p(logits, top_k, torch.ones(5))
    kept = torch.isfinite(masked)
    assert kept.sum(dim=-1).tolist() == [1, 3, 17, VOCAB, VOCAB]
    for row, k in enumerate([1, 3, 17]):
        assert set(kept[row].nonzero().flatten().tolist()) == set(
            logits[row].topk(k).indices.tolist()
        )
    assert torch.equal(masked[kept], logits[kept])  # kept logits untouched
    assert torch.isfinite(logits).all()  # input not modified


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # ranked: 1 (.5), 3 (.3), 2 (.15), 0 (.05)
    cases = {0.3: {1}, 0.7: {1, 3}, 0.9: {1, 3, 2}, 0.97: {0, 1, 2, 3}, 1.0: {0, 1, 2, 3}}
    cases[1e-9] = {1}  # at least one token is kept
    top_p = torch.tensor(list(cases))
    logits = probs.log().expand(len(cases), 4) * 1.0
    masked = apply_top_k_top_p(logits, torch.full((len(cases),), -1), top_p)
    for row, want in enumerate(cases.values()):
        assert set(torch.isfinite(masked[row]).nonzero().flatten().tolist()) == want


def test_top_k_then_top_p() -> None:
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log().expand(2, 4)
    # After top-k=2 the kept probs renormalise to .625/.375.
    masked = apply_top_k_top_p(logits, torch.tensor([2, 2]), torch.tensor([0.6, 0.65]))
    want = [[False, True, False, False], [False, True, False, True]]
    assert torch.isfinite(masked).tolist() == want


def test_sampled_tokens_respect_masks() -> None:
    logits = _logits(1, 1)[0].expand(200, VOCAB)
    params = [SamplingParams(temperature=2.0, top_k=3)] * 100
    params += [SamplingParams(temperature=2.0, top_k=1, seed=i) for i in range(100)]
    gens = [None] * 100 + [_gen(i) for i in range(100)]
    out = Sampler().sample(logits, params, gens).token_ids
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(out[:100]) <= top3 and len(set(out[:100])) > 1
    assert set(out[100:]) == {int(logits[0].argmax())}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(temperature: float) -> None:
    base = torch.tensor([0.6, 0.3, 0.1])
    want = base ** (1 / temperature)
    want = want / want.sum()
    n = 4000
    params = [SamplingParams(temperature=temperature)] * n
    torch.manual_seed(0)
    out = Sampler().sample(base.log().expand(n, 3), params, [None] * n).token_ids
    freq = torch.bincount(torch.tensor(out), minlength=3).float() / n
    assert torch.allclose(freq, want, atol=0.03), (freq, want)
    # A seeded request draws from the same distribution, step after step.
    g, row = _gen(7), base.log().unsqueeze(0)
    seeded = [Sampler().sample(row, params[:1], [g]).token_ids[0] for _ in range(1500)]
    freq = torch.bincount(torch.tensor(seeded), minlength=3).float() / 1500
    assert torch.allclose(freq, want, atol=0.05), (freq, want)


def test_logprobs_of_raw_distribution() -> None:
    logits = _logits(1, 4)[0].half()
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=3),
        SamplingParams(temperature=1.0, logprobs=None),
        SamplingParams(temperature=1.0, top_p=0.5, logprobs=0),
    ]
    out = Sampler().sample(logits, params, [None, _gen(3), None, None])
    ref = logits.float().log_softmax(dim=-1)
    assert out.logprobs[2] is None
    for row in (0, 1, 3):
        lp = out.logprobs[row]
        assert lp is not None and lp.token_id == out.token_ids[row]
        assert math.isclose(lp.logprob, ref[row, lp.token_id].item(), abs_tol=1e-5)
        n = params[row].logprobs or 0
        values, indices = ref[row].topk(n) if n else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), values, atol=1e-5)
    assert out.logprobs[0].top[0][0] == out.token_ids[0]  # greedy: sampled is the best


def test_banned_tokens_are_never_drawn_but_keep_their_logprobs() -> None:
    logits = _logits(1, 4)[0]
    top = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=t, logprobs=0) for t in (0.0, 0.0, 1.0, 1.0)]
    banned = [frozenset({top[0]}), frozenset(), frozenset({top[2]}), frozenset()]
    for seed in range(20):
        out = Sampler().sample(logits, params, [_gen(seed)] * 4, banned)
        assert out.token_ids[0] != top[0] and out.token_ids[1] == top[1]
        assert out.token_ids[2] != top[2]
    greedy = Sampler().sample(logits[:1], params[:1], [None], banned[:1])
    second = logits[0].clone()
    second[top[0]] = float("-inf")
    assert greedy.token_ids == [int(second.argmax())]
    raw = logits[0].log_softmax(dim=-1)[greedy.token_ids[0]].item()
    assert greedy.logprobs[0] is not None
    assert math.isclose(greedy.logprobs[0].logprob, raw, rel_tol=1e-5)
