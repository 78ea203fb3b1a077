"""Constrained decoding in the engine (xgrammar): every token a constrained request draws is
one its grammar allows at that point (checked against a fresh matcher replaying the output,
the naive reference), its output matches the regex or is one of the choices, unconstrained
rows beside it are untouched, its tokens do not depend on its batch, the handoff continues
from the prefill worker's grammar state, bad constraints are refused naming the field, and
each distinct constraint compiles once into a bounded cache."""

from __future__ import annotations

import json
import re

import pytest
import torch
from handoff_pair import handoff, make_pair

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured_output import (
    GrammarCompiler,
    StructuredOutput,
    apply_bitmasks,
)

CODE = StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}")
CHOICE = StructuredOutput("choice", choices=("red", "green", "blue"))
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}


def constraint_mask_row(constraint, vocab: int) -> torch.Tensor:
    """The reference: the tokens one matcher allows next, as a bool row read bit by bit."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab)
    constraint.fill(bitmask, 0)
    bits = bitmask[0].to(torch.int64) & 0xFFFFFFFF
    allowed = torch.zeros(bits.numel() * 32, dtype=torch.bool)
    for b in range(32):
        allowed[b::32] = ((bits >> b) & 1).bool()
    return allowed[:vocab]


def _engine(model_dir, **kw) -> LLMEngine:
    config = dict(model=str(model_dir), dtype="float32", threads=1, kv_cache_tokens=2048)
    return LLMEngine(EngineConfig(**{**config, **kw}))


def _params(constraint, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 24, "temperature": 0, "structured": constraint, **kw})


@pytest.mark.parametrize(
    ("constraint", "reason"),
    [
        (StructuredOutput("json", "{not json", field="f"), "Expecting property name"),
        (StructuredOutput("json", '{"type": "objec"}', field="f"), 'Unsupported type "objec"'),
        (StructuredOutput("regex", "[0-9", field="f"), "Unclosed '\\['"),
        (StructuredOutput("choice", choices=(), field="f"), "between 1 and 256 choices"),
        (StructuredOutput("grammar", "root ::= ", field="f"), ""),
        (StructuredOutput("xml", "<a/>", field="f"), "must be one of"),
    ],
)
def test_a_constraint_that_cannot_be_used_is_refused_naming_its_field(constraint, reason):
    with pytest.raises(InvalidRequestError, match=f"^f: .*{reason}") as refused:
        constraint.check()
    assert refused.value.field == "f"


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_every_drawn_token_is_allowed_and_the_output_matches(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    free = engine.kv_cache.num_free_blocks
    prompts = [list(range(100, 130)), list(range(200, 211)), list(range(300, 340))]
    params = [
        _params(CODE),
        _params(CHOICE, temperature=1.0, seed=11),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),  # free, beside them
    ]
    outs = engine.generate(prompts, params)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].text), outs[0].text
    assert outs[1].text in CHOICE.choices
    assert outs[0].finish_reason == outs[1].finish_reason == "stop"
    assert len(outs[2].token_ids) == 24  # the unconstrained row ran its course
    grammars = engine.grammars()
    vocab = engine.runner.hf_config.vocab_size
    for out, constraint in ((outs[0], CODE), (outs[1], CHOICE)):
        reference = grammars.matcher(constraint)
        for t in out.token_ids:
            assert constraint_mask_row(reference, vocab)[t], (constraint.kind, t)
            assert reference.accept(t)
        assert reference.terminated
    assert engine.kv_cache.num_free_blocks == free


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_a_constrained_requests_tokens_do_not_depend_on_its_batch(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    prompt = list(range(400, 437))
    alone = engine.generate([prompt], _params(CODE))[0].token_ids
    others = [list(range(500 + 7 * i, 530 + 7 * i)) for i in range(4)]
    batch = engine.generate(
        [*others[:2], prompt, *others[2:]],
        [_params(CHOICE), _params(None), _params(CODE), _params(None), _params(CHOICE)],
    )
    assert batch[2].token_ids == alone


def test_the_bitmask_touches_only_constrained_rows():
    class Only:  # allows token 3 alone, like a matcher at a one-token choice
        terminated = False

        def fill(self, bitmask, row):
            bitmask[row] = 0
            bitmask[row, 0] = 1 << 3

    logits = torch.randn(3, 70)
    before = logits.clone()
    apply_bitmasks(logits, [None, Only(), None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert logits[1].argmax().item() == 3 and torch.isinf(logits[1]).sum().item() == 69


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3]])
def test_the_byte_table_masks_as_the_bits_and_xgrammar_say(rows):
    """Random masks (every bit, the int32 sign bit included) over a vocabulary that ends
    mid-word: the CPU table path against the bit-by-bit reference and xgrammar's own apply."""
    import xgrammar as xgr

    vocab = 1000  # 31.25 words of 32 tokens
    gen = torch.Generator().manual_seed(7)
    words = torch.randint(-(2**31), 2**31, (4, (vocab + 31) // 32), generator=gen,
                          dtype=torch.int64).to(torch.int32)  # fmt: skip
    words[rows[0]] = -1  # a row that allows everything

    class Given:
        terminated = False

        def __init__(self, row: int) -> None:
            self.row = row

        def fill(self, bitmask, row):
            bitmask[row] = words[self.row]

    logits = torch.randn(4, vocab, generator=gen)
    ours = logits.clone()
    given = [Given(i) if i in rows else None for i in range(4)]
    apply_bitmasks(ours, given)
    kept = logits.clone()
    assert torch.equal(apply_bitmasks(kept, given, inplace=False), ours)
    assert torch.equal(kept, logits)  # a new tensor: the input is left as it was
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, words, indices=rows)
    assert torch.equal(ours, theirs)
    for i in range(4):
        bits = words[i].to(torch.int64) & 0xFFFFFFFF
        allowed = torch.zeros(bits.numel() * 32, dtype=torch.bool)
        for b in range(32):
            allowed[b::32] = ((bits >> b) & 1).bool()
        allowed = allowed[:vocab] if i in rows else torch.ones(vocab, dtype=torch.bool)
        assert torch.equal(ours[i][allowed], logits[i][allowed])
        assert torch.isneginf(ours[i][~allowed]).all()


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_a_constraint_compiles_once_into_a_bounded_cache(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    grammars = GrammarCompiler(engine.tokenizer, engine.runner.hf_config.vocab_size,
                               cache_bytes=256 * 1024)  # fmt: skip
    grammars.compile(CODE)
    grammars.compile(StructuredOutput("regex", CODE.spec, field="other"))  # same constraint
    assert grammars.num_compiled == 1
    for i in range(40):
        grammars.compile(StructuredOutput("json", json.dumps({**SCHEMA, "title": f"s{i}"})))
    assert grammars.num_compiled == 41
    assert 0 < grammars.cache_bytes() <= 256 * 1024
    with pytest.raises(InvalidRequestError, match=r"^sampling\.x: "):
        grammars.compile(StructuredOutput("regex", "(", field="sampling.x"))


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_the_handoff_continues_the_prefill_workers_grammar_state(tiny_model_dir):
    reference = _engine(tiny_model_dir)
    pair = make_pair(tiny_model_dir)
    try:
        json_schema = StructuredOutput("json", json.dumps(SCHEMA))
        prompt = list(range(600, 650))
        for rid, constraint in (("code", CODE), ("json", json_schema)):
            params = _params(constraint, max_tokens=40)
            expected = reference.generate([prompt], params)[0].token_ids
            assert handoff(pair, prompt, params, rid)[0] == expected, rid
        # A first token the grammar does not allow is the caller's mistake, named.
        with pytest.raises(InvalidRequestError, match=r"^first_token_id: token 5 does not fit"):
            pair.receiver.arrive(prompt, 5, _params(CODE), "bad", None)
    finally:
        pair.close()
