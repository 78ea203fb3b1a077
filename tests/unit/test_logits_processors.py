"""The rest of the sampler (`logits_processors.py`), each against a naive reference written
token by token from vLLM's definition: repetition, frequency and presence penalties,
logit_bias, allowed_token_ids, bad words and min_p; then in the engine: a penalty or a bias
changes the greedy choice the way the reference says, a request's tokens do not depend on
its batch, and the handoff's decode worker counts the prefill worker's first token."""

from __future__ import annotations

import math

import pytest
import torch
from handoff_pair import handoff, make_pair

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.errors import InvalidRequestError
from pdserve.common.logits_processors import (
    apply_allowed_tokens,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    bad_word_bans,
)
from pdserve.common.request import PenaltyHistory, Request
from pdserve.common.sampler import Sampler
from pdserve.common.sampling_params import SamplingParams

V = 50


def _reference_penalties(row: list[float], p: SamplingParams, h: PenaltyHistory) -> list[float]:
    out = list(row)
    for t in range(V):
        count = list(h.output).count(t)
        if p.repetition_penalty != 1.0 and (count or t in h.prompt):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * count
        out[t] -= p.presence_penalty * (1 if count else 0)
    return out


def test_penalties_match_the_reference():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    params = [
        SamplingParams(presence_penalty=0.7),
        SamplingParams(frequency_penalty=-0.4, repetition_penalty=1.3),
        SamplingParams(),  # no penalty: untouched
        SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=2.0),
    ]
    histories = [
        PenaltyHistory([1, 2, 3], [4, 4, 7]),
        PenaltyHistory([9, 9], [9, 10, 10, 10]),
        PenaltyHistory([1], [1]),
        PenaltyHistory([0, 49], [49, 3, 3]),
    ]
    got = logits.clone()
    apply_penalties(got, params, histories)
    for i in range(4):
        expected = _reference_penalties(logits[i].tolist(), params[i], histories[i])
        assert got[i].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6), i
    assert torch.equal(got[2], logits[2])


def test_bias_allowed_tokens_bad_words_and_min_p_match_the_reference():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    bias = {3: 5.0, 7: -100.0}
    params = [SamplingParams(logit_bias=bias), SamplingParams(allowed_token_ids=[2, 5]),
              SamplingParams()]  # fmt: skip
    got = logits.clone()
    apply_logit_bias(got, params)
    apply_allowed_tokens(got, params)
    for t in range(V):
        expected = logits[0, t] + torch.tensor(bias.get(t, 0.0))  # in float32, as the row
        assert got[0, t].item() == expected.item()
        assert (got[1, t].item() == -math.inf) == (t not in (2, 5))
    assert torch.equal(got[2], logits[2])
    # A bad word's last token is banned where the output ends with the rest of it.
    words = [[11, 12, 13], [20], [30, 31]]
    assert bad_word_bans([5, 11, 12], words) == {13, 20}
    assert bad_word_bans([11, 12, 5], words) == {20}
    assert bad_word_bans([30], words) == {20, 31}
    # min_p: tokens below min_p x the most likely one's probability go.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    kept = apply_min_p(probs, torch.tensor([0.4, 0.9]))
    assert kept[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    assert kept[1].tolist() == pytest.approx([0.25] * 4)


def test_the_sampler_applies_them_in_order_and_keeps_raw_logprobs():
    logits = torch.zeros(1, V)
    logits[0, 4], logits[0, 8] = 3.0, 2.5
    greedy = SamplingParams(temperature=0, logprobs=0)
    history = PenaltyHistory([], [4])
    sampler = Sampler()
    assert sampler.sample(logits, [greedy], [None]).token_ids == [4]
    penalised = SamplingParams(temperature=0, presence_penalty=1.0, logprobs=0)
    out = sampler.sample(logits, [penalised], [None], histories=[history])
    assert out.token_ids == [8]  # 3.0 - 1.0 < 2.5
    raw = logits.log_softmax(-1)[0, 8].item()
    assert out.logprobs[0].logprob == pytest.approx(raw)  # of the model's distribution
    biased = SamplingParams(temperature=0, logit_bias={30: 4.0})
    assert sampler.sample(logits, [biased], [None]).token_ids == [30]


def test_a_resumed_requests_penalties_count_the_lost_legs_output():
    request = Request("r", [1, 2, 3, 40, 41], SamplingParams())
    request.num_resumed_tokens = 2
    request.output_token_ids = [42]
    assert request.penalty_history() == PenaltyHistory([1, 2, 3], [40, 41, 42])


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", threads=1,
                                  kv_cache_tokens=2048))  # fmt: skip


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_in_the_engine_each_changes_the_output_as_defined_and_stays_batch_invariant(
    tiny_model_dir,
):
    engine = _engine(tiny_model_dir)
    prompt = list(range(100, 140))
    base = dict(max_tokens=16, temperature=0, ignore_eos=True)
    plain = engine.generate([prompt], SamplingParams(**base))[0].token_ids
    # A negative presence penalty rewards what the output already holds: it repeats.
    rewarded = SamplingParams(**base, presence_penalty=-2.0)
    kinds = {
        "rewarded": rewarded,
        "bias": SamplingParams(**base, logit_bias={777: 100.0}),
        "allowed": SamplingParams(**base, allowed_token_ids=[5, 6, 7]),
        "bad": SamplingParams(**base, bad_words=[engine.tokenizer.decode([plain[0]])]),
        "min_p": SamplingParams(max_tokens=16, temperature=1.5, min_p=0.3, seed=4,
                                ignore_eos=True),
    }  # fmt: skip
    alone = {k: engine.generate([prompt], p)[0].token_ids for k, p in kinds.items()}
    assert len(set(plain)) == len(plain) > len(set(alone["rewarded"]))
    assert alone["bias"] == [777] * 16
    assert set(alone["allowed"]) <= {5, 6, 7}
    assert plain[0] not in alone["bad"][:1]
    # Every kind again, all in one batch with unconstrained neighbours: the same tokens.
    others = [list(range(300 + 9 * i, 330 + 9 * i)) for i in range(3)]
    batch = engine.generate(
        [*others, *(prompt for _ in kinds)],
        [SamplingParams(**base)] * 3 + list(kinds.values()),
    )
    assert {k: o.token_ids for k, o in zip(kinds, batch[3:], strict=True)} == alone
    with pytest.raises(InvalidRequestError, match=r"^logit_bias: token ids must be in"):
        engine.add_request(prompt, SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(InvalidRequestError, match=r"^presence_penalty: must be in"):
        engine.add_request(prompt, SamplingParams(presence_penalty=2.5))


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_the_decode_worker_counts_the_prefill_workers_first_token(tiny_model_dir):
    reference = _engine(tiny_model_dir)
    pair = make_pair(tiny_model_dir)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                            presence_penalty=1.5, repetition_penalty=1.4)  # fmt: skip
    prompt = list(range(700, 740))
    try:
        expected = reference.generate([prompt], params)[0].token_ids
        assert handoff(pair, prompt, params, "r")[0] == expected
    finally:
        pair.close()
