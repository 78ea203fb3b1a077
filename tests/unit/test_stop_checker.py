"""StopChecker: stop strings (also across tokens), stop token ids, EOS, max_tokens, and the
held-back text: what is emitted always concatenates to the final, truncated text."""

from __future__ import annotations

import random

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.stop_checker import StopChecker, StopResult

EOS = 2
TOKEN = 100  # any token that is neither EOS nor a stop token


def _run(checker: StopChecker, deltas: list[str]) -> tuple[list[StopResult], str]:
    results = []
    for delta in deltas:
        results.append(checker.check(TOKEN, delta))
        if results[-1].finished:
            break
    return results, "".join(r.text for r in results)


def test_stop_string_in_one_delta() -> None:
    checker = StopChecker(SamplingParams(max_tokens=50, stop=["END"]), [EOS])
    results, text = _run(checker, ["Hello", " wEND world", " more"])
    assert len(results) == 2 and results[-1] == (True, "stop", " w")
    assert text == "Hello w" == checker.text
    assert checker.finish_reason == "stop"


def test_stop_string_across_tokens() -> None:
    checker = StopChecker(SamplingParams(max_tokens=50, stop=["STOP"]), [EOS])
    results, text = _run(checker, ["foo ", "S", "T", "O", "P bar"])
    assert [r.text for r in results] == ["foo ", "", "", "", ""]
    assert results[-1].finish_reason == "stop" and text == "foo "


def test_held_text_released_when_not_a_stop() -> None:
    checker = StopChecker(SamplingParams(max_tokens=50, stop=["STOP"]), [EOS])
    results, text = _run(checker, ["a S", "T", "x", "y ST"])
    assert [r.text for r in results] == ["a ", "", "STx", "y "]
    assert not results[-1].finished and text == "a STxy "


def test_earliest_stop_string_wins() -> None:
    checker = StopChecker(SamplingParams(max_tokens=50, stop=["world", "lo w"]), [EOS])
    _, text = _run(checker, ["hel", "lo world"])
    assert text == "hel" == checker.text


def test_stop_token_ids_and_eos() -> None:
    params = SamplingParams(max_tokens=50, stop=["zzz"], stop_token_ids=[7])
    checker = StopChecker(params, [EOS])
    assert checker.check(TOKEN, "ab z") == (False, None, "ab ")
    # The stop token's own text is kept; held-back text is flushed.
    assert checker.check(7, "!") == (True, "stop", "z!")
    assert checker.text == "ab z!" and checker.num_tokens == 2

    checker = StopChecker(SamplingParams(max_tokens=50), [EOS, 3])
    assert checker.check(3, "") == (True, "stop", "")


def test_ignore_eos_runs_to_max_tokens() -> None:
    checker = StopChecker(SamplingParams(max_tokens=3, ignore_eos=True), [EOS])
    assert checker.check(EOS, "a") == (False, None, "a")
    assert checker.check(EOS, "b") == (False, None, "b")
    assert checker.check(EOS, "c") == (True, "length", "c")


def test_ignore_eos_keeps_stop_token_ids() -> None:
    checker = StopChecker(SamplingParams(ignore_eos=True, stop_token_ids=[EOS]), [EOS])
    assert checker.check(EOS, "") == (True, "stop", "")


def test_max_tokens_flushes_held_text() -> None:
    checker = StopChecker(SamplingParams(max_tokens=2, stop=["</s>"]), [EOS])
    assert checker.check(TOKEN, "x <") == (False, None, "x ")
    assert checker.check(TOKEN, "/") == (True, "length", "</")
    with pytest.raises(RuntimeError):
        checker.check(TOKEN, "more")


def test_stop_string_beats_length_and_stop_token() -> None:
    checker = StopChecker(SamplingParams(max_tokens=1, stop=["b"]), [EOS])
    assert checker.check(TOKEN, "abc") == (True, "stop", "a")
    checker = StopChecker(SamplingParams(stop=["b"]), [EOS])
    assert checker.check(EOS, "abc") == (True, "stop", "a")


def test_flush_callable_on_finish_only() -> None:
    calls: list[int] = []

    def flush() -> str:
        calls.append(1)
        return "\ufffd"

    checker = StopChecker(SamplingParams(max_tokens=2), [EOS])
    assert checker.check(TOKEN, "a", flush) == (False, None, "a")
    assert calls == []
    assert checker.check(TOKEN, "", flush) == (True, "length", "\ufffd")
    assert calls == [1]


def test_random_splits_match_reference() -> None:
    rng = random.Random(0)
    alphabet = "ab c\n"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in "xy"]
        cuts = sorted(rng.sample(range(1, len(text) + 1), k=min(len(text), rng.randint(0, 8))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        want = text[: min(found)] if found else text

        checker = StopChecker(SamplingParams(max_tokens=len(deltas), stop=stops), [EOS])
        results, emitted = _run(checker, deltas)
        assert emitted == want == checker.text, (text, stops, deltas)
        assert results[-1].finished
        assert results[-1].finish_reason == ("stop" if found else "length")


def test_min_tokens_holds_off_stop_tokens_and_strings() -> None:
    checker = StopChecker(SamplingParams(max_tokens=50, min_tokens=3, stop=["END"]), [EOS])
    assert checker.tokens_to_ban() == {EOS}
    assert checker.check(EOS, "") == (False, None, "")
    assert checker.check(TOKEN, "END") == (False, None, "END")
    assert checker.tokens_to_ban() == {EOS}
    assert checker.check(TOKEN, "x").finished is False  # the third token: still held off
    assert checker.tokens_to_ban() == frozenset()
    assert checker.check(TOKEN, " END").finish_reason == "stop"
    assert checker.text == "ENDx "


def test_min_tokens_must_fit_max_tokens() -> None:
    from pdserve.common.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5).validate()
