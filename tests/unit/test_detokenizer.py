"""IncrementalDetokenizer on real tokenizers built offline: a byte-level BPE trained here and a
byte-fallback (sentencepiece-style) BPE, both wrapped in transformers' fast tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdserve.common.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world, this is pdserve streaming text.",
    "Café crème brûlée à la carte, naïve façade résumé.",
    "日本語のテキストです。東京は大きい都市です。",
    "Emoji time 😀🎉👍🏽 and 🇯🇵 flags! 👨‍👩‍👧 family.",
    "Привет, мир! Ελληνικά γράμματα.",
]
TEXTS = [
    "Hello 😀 world!",
    "東京は大きい。日本語です。",
    "Café crème brûlée, naïve résumé.",
    "👍🏽 🇯🇵 👨‍👩‍👧 mixed 日本 and é!",
    "Привет 😀 Ελληνικά 🎉",
    "unseen: 한국어 🦀 ñandú",
]


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def byte_fallback() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<eos>": 1}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzHCP,.!:":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(t) for t in ids]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("tokenizer", ["byte_bpe", "byte_fallback"])
def test_deltas_concatenate_to_decode(
    tokenizer: str, text: str, request: pytest.FixtureRequest
) -> None:
    tok = request.getfixturevalue(tokenizer)
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.flush() == ""


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_characters_held_until_complete(byte_bpe: PreTrainedTokenizerFast, text: str):
    ids = byte_bpe.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_bpe, byte_bpe.encode("Prompt: ", add_special_tokens=False))
    deltas = _stream(detok, ids)
    assert "".join(deltas) == byte_bpe.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    for i in range(len(ids)):
        # After i+1 tokens the whole decoded text is out, unless it ends inside a character;
        # then the tokens of that character (and only they) are held back.
        emitted, decoded = "".join(deltas[: i + 1]), byte_bpe.decode(ids[: i + 1])
        if decoded.endswith("\ufffd"):
            assert decoded.startswith(emitted)
        else:
            assert emitted == decoded


def test_holds_back_split_emoji(byte_fallback: PreTrainedTokenizerFast) -> None:
    ids = byte_fallback.encode("a😀", add_special_tokens=False)
    tokens = byte_fallback.convert_ids_to_tokens(ids)
    assert tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    detok = IncrementalDetokenizer(byte_fallback, [])
    deltas = _stream(detok, ids)
    assert deltas[-4:] == ["", "", "", "😀"]
    assert detok.text == "a😀"


def test_prompt_context_keeps_leading_space(byte_fallback: PreTrainedTokenizerFast) -> None:
    prompt = byte_fallback.encode("hi there", add_special_tokens=False)
    out = byte_fallback.encode("you 東京 é!", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_fallback, prompt)
    text = "".join(_stream(detok, out))
    full = byte_fallback.decode(prompt + out)
    assert text == full[len(byte_fallback.decode(prompt)) :] == " you 東京 é!"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(byte_bpe: PreTrainedTokenizerFast, skip: bool) -> None:
    eos = byte_bpe.eos_token_id
    ids = byte_bpe.encode("Hi 😀", add_special_tokens=False)
    ids = [*ids[:2], eos, *ids[2:], eos]
    detok = IncrementalDetokenizer(byte_bpe, [eos], skip_special_tokens=skip)
    text = "".join(_stream(detok, ids))
    assert text == byte_bpe.decode(ids, skip_special_tokens=skip)
    assert ("<eos>" in text) is not skip


def test_flush_emits_incomplete_tail(byte_fallback: PreTrainedTokenizerFast) -> None:
    ids = byte_fallback.encode("ok 東", add_special_tokens=False)[:-1]  # cut mid-character
    detok = IncrementalDetokenizer(byte_fallback, [])
    text = "".join(_stream(detok, ids))
    assert text == "ok "
    text += detok.flush()
    assert text == byte_fallback.decode(ids) == detok.text
    assert text.endswith("\ufffd")


def test_prompt_ending_mid_character(byte_fallback: PreTrainedTokenizerFast) -> None:
    ids = byte_fallback.encode("ab 東京", add_special_tokens=False)
    prompt, out = ids[:-2], ids[-2:]  # the prompt ends after the first byte of 京
    detok = IncrementalDetokenizer(byte_fallback, prompt)
    # Without the prompt the output bytes are not valid text: held until flushed.
    assert _stream(detok, out) == ["", ""]
    assert detok.flush() == byte_fallback.decode(out) == "\ufffd\ufffd"


def test_decodes_small_windows(byte_bpe: PreTrainedTokenizerFast) -> None:
    ids = byte_bpe.encode(" ".join(TEXTS) * 3, add_special_tokens=False)
    lengths: list[int] = []

    class Counting:
        def decode(self, window: list[int], **kwargs: bool) -> str:
            lengths.append(len(window))
            return byte_bpe.decode(window, **kwargs)

    detok = IncrementalDetokenizer(Counting(), ids[:50])
    assert "".join(_stream(detok, ids)) == byte_bpe.decode(ids)
    assert len(ids) > 200 and max(lengths) <= 12
