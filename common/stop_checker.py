"""Finish decisions: after each new token, is the request done, and what text may be emitted.

The engine keeps one `StopChecker` per request and calls `check` once per new token with the
detokenizer's delta. Rules, first match wins:

* a stop string appears in the output text (also one spanning several tokens; only the tail
  that the new delta can complete is searched) -> "stop"; the text ends just before the
  earliest stop string, which is itself never emitted;
* the token is in ``stop_token_ids``, or is an EOS id and ``ignore_eos`` is off -> "stop";
  the token's own text is kept (special tokens such as EOS usually decode to "");
* the request has ``max_tokens`` output tokens -> "length".

Until ``min_tokens`` tokens exist, stop tokens and stop strings do not finish the request
(the sampler also masks the stop tokens then: see `tokens_to_ban`).

Text that could still be the start of a stop string (the longest tail of the text that is a
proper prefix of some stop string) is held back and emitted once it is clear it is not one,
or flushed on finish. So no text is ever emitted and then taken back, and the concatenated
emitted text is exactly the final (truncated) output text."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Literal, NamedTuple

from pdserve.common.sampling_params import SamplingParams

FinishReason = Literal["stop", "length"]


class StopResult(NamedTuple):
    finished: bool
    finish_reason: FinishReason | None
    text: str  # the text to emit now (may be "")


class StopChecker:
    def __init__(self, params: SamplingParams, eos_token_ids: Collection[int] = ()) -> None:
        self._params = params
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(eos_token_ids)
        self._stops = list(params.stop)
        self._num_tokens = 0
        self._output = ""  # all text seen (truncated at a stop string once found)
        self._emitted = 0  # how much of it has been emitted
        self.finished = False
        self.finish_reason: FinishReason | None = None

    @property
    def text(self) -> str:
        """The text emitted so far; once finished, the final output text."""
        return self._output[: self._emitted]

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def resume(self, text: str, sent_chars: int) -> None:
        """Continue after `text`, output another worker already checked, of which
        `sent_chars` characters were emitted (the rest was held back)."""
        self._output = text
        self._emitted = min(sent_chars, len(text))

    def tokens_to_ban(self) -> frozenset[int]:
        """Token ids the next draw must not pick: the stop tokens while fewer than
        ``min_tokens`` tokens exist, else none."""
        if self._num_tokens < self._params.min_tokens:
            return frozenset(self._stop_ids)
        return frozenset()

    def check(
        self, token_id: int, delta: str, flush: Callable[[], str] | None = None
    ) -> StopResult:
        """Account for one new output token and its text delta.

        ``flush`` (e.g. the detokenizer's ``flush``) is called when the token finishes the
        request, so text the detokenizer still holds is included in the final text."""
        if self.finished:
            raise RuntimeError("check called on a finished request")
        self._num_tokens += 1
        reason: FinishReason | None = None
        held_off = self._num_tokens < self._params.min_tokens
        if token_id in self._stop_ids and not held_off:
            reason = "stop"
        elif self._num_tokens >= self._params.max_tokens:
            reason = "length"
        if reason is not None and flush is not None:
            delta += flush()
        start = len(self._output)
        self._output += delta

        cut = None if held_off else self._find_stop(start)
        if cut is not None:
            self._output = self._output[:cut]
            return self._finish("stop")
        if reason is not None:
            return self._finish(reason)
        safe = len(self._output) - self._partial_stop_len()
        if safe <= self._emitted:
            return StopResult(False, None, "")
        out = self._output[self._emitted : safe]
        self._emitted = safe
        return StopResult(False, None, out)

    def _finish(self, reason: FinishReason) -> StopResult:
        out = self._output[self._emitted :]
        self._emitted = len(self._output)
        self.finished = True
        self.finish_reason = reason
        return StopResult(True, reason, out)

    def _find_stop(self, start: int) -> int | None:
        """Index of the earliest stop string that ends inside the text added at ``start``."""
        best: int | None = None
        for stop in self._stops:
            i = self._output.find(stop, max(start - len(stop) + 1, 0))
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._output
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
