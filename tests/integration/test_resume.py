"""A request continued after a lost worker (`Resume`) on the real default model: resumed
after any number k of its tokens, with the text the client had at that point, it goes on
exactly as if nothing had been lost: the same tokens (seeded sampling included, the
generator advanced past the k draws), text held back before the loss is sent, a stop string
that spans the two legs is found, and the finish reason is the same. All resumed copies run
in one batch (the kernels are batch- and chunk-invariant)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from oracle import engine

from pdserve.common.errors import InvalidRequestError
from pdserve.common.request import Resume
from pdserve.common.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Tell me about the ocean and the creatures in it."}]


@pytest.fixture(scope="module")
def eng(default_model_dir):
    return engine(default_model_dir, dtype="bfloat16", kv_cache_tokens=16384)


def run(eng, requests) -> dict[str, tuple[list[int], list[str], str | None]]:
    """Step until done: per request, its tokens, its text deltas, its finish reason."""
    out: dict[str, tuple[list[int], list[str], str | None]] = {
        r.request_id: ([], [], None) for r in requests
    }
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens, texts, _ = out[o.request_id]
            tokens += o.new_token_ids
            texts.append(o.new_text)
            out[o.request_id] = (tokens, texts, o.finish_reason)
    return out


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_resumed_request_goes_on_as_if_nothing_was_lost(eng, sampling):
    base = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
    if sampling == "seeded":
        base = replace(base, temperature=0.8, top_p=0.95, seed=11)
    prompt = eng.tokenize(QUESTION)
    [free] = run(eng, [eng.add_request(prompt, base, "free")]).values()
    text = "".join(free[1])
    # A stop string in the middle of the text, and one that is a word's start, so text is
    # held back (it could begin the stop string) before the stop is complete.
    middle = len(text) // 2
    stop = text[middle : middle + 7]
    params = replace(base, stop=[stop])
    [ref_tokens, ref_texts, ref_reason] = run(eng, [eng.add_request(prompt, params, "ref")])["ref"]
    assert ref_reason == "stop" and "".join(ref_texts) == text[:middle]
    held = [k for k in range(1, len(ref_tokens)) if sum(map(len, ref_texts[:k])) < len(
        eng.tokenizer.decode(ref_tokens[:k], skip_special_tokens=True))]  # fmt: skip
    assert held, "no split point had text held back: the test would not test that"

    # Early, late, and every point where text was held back (around the stop string).
    n = len(ref_tokens)
    splits = sorted({1, 2, *held, n - 2, n - 1} & set(range(1, n)))
    resumed = []
    for k in splits:
        sent = sum(len(t) for t in ref_texts[:k])
        rest = replace(params, max_tokens=params.max_tokens - k)
        resumed.append(
            eng.add_request(prompt + ref_tokens[:k], rest, f"k{k}", resume=Resume(k, sent))
        )
    outs = run(eng, resumed)
    for k in splits:
        tokens, texts, reason = outs[f"k{k}"]
        assert ref_tokens[:k] + tokens == ref_tokens, k
        assert "".join(ref_texts[:k]) + "".join(texts) == "".join(ref_texts), k
        assert reason == ref_reason, k
    assert eng.kv_cache.num_free_blocks == eng.runner.num_blocks


def test_a_resume_out_of_range_is_refused(eng):
    prompt = eng.tokenize(QUESTION)
    for resume, field in [
        (Resume(0, 0), "resumed.output_tokens"),
        (Resume(len(prompt), 0), "resumed.output_tokens"),
        (Resume(3, 10_000), "resumed.sent_chars"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request(prompt, SamplingParams(max_tokens=4), resume=resume)
        assert e.value.field == field
    assert not eng.has_unfinished_requests()
