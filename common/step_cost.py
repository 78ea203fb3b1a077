"""What an engine step costs, learned from the steps the engine ran, and the prefill chunk
that keeps a step with running decodes inside the TPOT target.

A stream's time per output token is the time of the steps it is in; a prefill chunk in the
same step lengthens it. Sarathi-Serve bounds that with a fixed token budget profiled ahead
of time; here the budget comes from a model of the step's time fitted to the steps just
run (least squares over a window, every coefficient kept non-negative):

    seconds = base + per_decode × decodes + per_prefill_token × prefill tokens
                   + per_attention × (query tokens × keys they attend to) / 1e6

`StepPlan` spends a step's time: the decodes first, then each prefill chunk gets the tokens
that still fit (at least `min_chunk` for the step's first chunk, so prefill always moves,
even under a target the decodes alone exceed). Until the model is fitted, a step with
decodes takes `warmup_chunk` prompt tokens in all: a fixed budget, as Sarathi's, whose
steps are the samples the fit needs.

The same model predicts the queue ahead of a new prompt (`prefill_wait_s`): the TTFT
target's admission refuses a prompt whose first token would come too late."""

from __future__ import annotations

import math
from collections import deque

import numpy as np

ATTENTION_UNIT = 1e6  # query-key pairs per unit of the attention feature


def attention_pairs(start: float, num_tokens: float) -> float:
    """Query-key pairs of `num_tokens` queries at positions start.. (causal), in units."""
    return num_tokens * (start + (num_tokens + 1) / 2) / ATTENTION_UNIT


class StepCostModel:
    """A linear model of a step's seconds, refitted every `refit_every` recorded steps over
    the last `window` of them. A step's prefill cost is known once `min_samples` steps with
    prompt tokens were seen, its decode cost once `min_samples` steps without them were (a
    prefill worker learns only the first, a decode worker only the second); it predicts
    nothing it has not measured."""

    def __init__(self, window: int = 256, min_samples: int = 4, refit_every: int = 8) -> None:
        self.samples: deque[tuple[float, float, float, float, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        self.refit_every = refit_every
        self.coefficients: np.ndarray | None = None  # base, decode, prefill token, attention
        self.prefill_measured = False
        self.decodes_measured = False
        self._since_fit = 0

    def reset(self) -> None:
        """Forget every sample and the fit: predict nothing until measured again."""
        self.samples.clear()
        self.coefficients = None
        self.prefill_measured = self.decodes_measured = False
        self._since_fit = 0

    def record(self, decodes: int, prefill_tokens: int, attention: float, seconds: float) -> None:
        self.samples.append((1.0, float(decodes), float(prefill_tokens), attention, seconds))
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._since_fit = 0
            self._fit()

    def _fit(self) -> None:
        data = np.array(self.samples)
        with_prefill = int((data[:, 2] > 0).sum())
        without_prefill = len(data) - with_prefill
        if max(with_prefill, without_prefill) < self.min_samples:
            return
        x, y = data[:, :4], data[:, 4]
        # A feature never seen (no decodes on a prefill worker) has no weight to fit. Nor has
        # a stream count that never varied (a decode worker's first streams, one at a time):
        # it cannot be told from the base, and the least-squares split of a constant batch's
        # cost between the two (even: both columns are ~1) would predict one more stream at
        # 1.5x the step, so admission by the TPOT target would keep the batch at one stream
        # and never see another. The base takes it until steps differ in streams. (Prompt
        # tokens, in the hundreds, take nearly all of a constant chunk's cost from the same
        # split: a compute-bound step's.)
        active = [0, *(i for i in (2, 3) if x[:, i].any())]
        if np.ptp(x[:, 1]) > 0:
            active.insert(1, 1)
        coefficients = np.zeros(4)
        while active:  # drop a feature whose best weight is negative, fit the rest again
            solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            if (solution >= 0).all():
                coefficients[active] = solution
                break
            active.pop(int(np.argmin(solution)))
        # A step with prefill must cost something per token, or no chunk would ever be cut.
        prefill = with_prefill >= self.min_samples and coefficients[2] > 0
        decodes = without_prefill >= self.min_samples
        if prefill or decodes:
            self.coefficients = coefficients
            self.prefill_measured, self.decodes_measured = prefill, decodes

    def predict(self, decodes: int, prefill_tokens: int, attention: float) -> float | None:
        if self.coefficients is None:
            return None
        if (prefill_tokens and not self.prefill_measured) or (
            decodes and not self.decodes_measured
        ):
            return None
        return float(self.coefficients @ np.array([1.0, decodes, prefill_tokens, attention]))

    def prefill_wait_s(
        self, prompts: list[tuple[int, int, int]], streams: list[tuple[int, int]],
        target_s: float, min_chunk: int, max_step_tokens: int,
    ) -> float | None:  # fmt: skip
        """Seconds until every prompt of `prompts` is prefilled, in queue order, as the plan
        runs them. A prompt is (first position to compute, tokens, decode steps it runs once
        prefilled: 0 where it is handed off); a stream decoding now is (context tokens,
        steps left at most). While streams decode under the TPOT target `target_s`, the
        prompt at the head takes its own compute plus the decodes' share of the steps it
        spans (each step has the target's room left by the decodes, at least `min_chunk`
        tokens' worth); without them (or without a target), steps of `max_step_tokens`
        prompt tokens, each at its base cost. The streams advance step by step and leave
        when their steps run out (the head's share of the steps until then is counted, and
        the rest of it at the rate after); a prefilled prompt joins them, so the queue
        behind it prefills beside one more stream. None while unmeasured."""
        if not self.prefill_measured:
            return None
        assert self.coefficients is not None
        base, _, per_token, per_attention = self.coefficients

        def work(start: float, tokens: float) -> float:
            return per_token * tokens + per_attention * attention_pairs(start, tokens)

        # [next position, tokens left, decode steps once prefilled]: a prompt part-way in.
        queue = [[float(start), float(tokens), steps] for start, tokens, steps in prompts]
        live = [[float(context), float(left)] for context, left in streams]  # [context, steps]
        seconds = 0.0
        while queue:
            joined = []
            if target_s > 0 and live:
                head = queue[0]
                decode_attention = sum(attention_pairs(c, 1) for c, _ in live)
                decode_s = self.predict(len(live), 0, decode_attention)
                if decode_s is None:
                    return None
                room = max(target_s - decode_s, per_token * min_chunk)
                own = work(head[0], head[1])
                steps = own / room
                first_out = min(left for _, left in live)
                if steps > first_out:  # a stream leaves first: this batch runs until then
                    steps = first_out
                    done = head[1] * steps * room / own
                    seconds += steps * (room + decode_s)
                    head[0] += done
                    head[1] -= done
                else:
                    seconds += own + steps * decode_s
                    queue.pop(0)
                    if head[2] > 0:
                        joined.append([head[0] + head[1], float(head[2])])
            else:  # one step of the token budget, prompts packed into it
                steps, room = 1.0, float(max(1, max_step_tokens))
                while queue and room > 0:
                    head = queue[0]
                    part = min(head[1], room)
                    seconds += work(head[0], part)
                    room -= part
                    head[0] += part
                    head[1] -= part
                    if head[1] <= 0:
                        queue.pop(0)
                        if head[2] > 0:
                            joined.append([head[0], float(head[2])])
                seconds += base
            for stream in live:
                stream[0] += steps
                stream[1] -= steps
            live = [stream for stream in live if stream[1] > 0] + joined
        return seconds


class StepPlan:
    """One step's time under `target_s`: decodes reserved first, then prefill chunks."""

    def __init__(
        self, model: StepCostModel, target_s: float, decodes: int, decode_attention: float,
        min_chunk: int, warmup_chunk: int,
    ) -> None:  # fmt: skip
        self.coefficients = model.coefficients
        self.min_chunk = min_chunk
        self.first_chunk = True
        self.room_s = math.inf
        self.warmup_left: int | None = None  # prompt tokens left while unmeasured
        self.target_s = target_s
        self.decode_s: float | None = None  # the decodes' predicted seconds alone
        if target_s > 0 and decodes > 0:
            used = model.predict(decodes, 0, decode_attention)
            self.decode_s = used
            if used is None or not model.prefill_measured:
                self.warmup_left = warmup_chunk
            else:
                self.room_s = target_s - used

    def unmet_target(self) -> str | None:
        """Why this step cannot meet the TPOT target (the decodes alone are predicted past
        it, so prefill gets only its minimum chunk a step and first tokens wait), or None."""
        if self.decode_s is None or self.decode_s <= self.target_s:
            return None
        return (
            f"decode steps alone are predicted at {self.decode_s * 1e3:.0f} ms, past the "
            f"TPOT target (--tpot-target-ms {self.target_s * 1e3:g}): prompts get "
            f"{self.min_chunk} tokens a step, so first tokens wait and the TTFT target "
            "refuses early; raise the target to the SLO this host can meet, or add decode "
            "capacity"
        )

    def prefill_tokens(self, start: int, wanted: int) -> int:
        """How many of `wanted` prompt tokens from position `start` this step takes; the
        caller schedules exactly that many (0: none fit)."""
        if self.warmup_left is not None:
            fit = min(wanted, self.warmup_left)
            self.warmup_left -= fit
            return fit
        if self.room_s == math.inf:
            return wanted
        assert self.coefficients is not None
        per_token, per_attention = self.coefficients[2], self.coefficients[3] / ATTENTION_UNIT
        # Largest n with per_token·n + per_attention·n·(start + (n+1)/2) <= room.
        a = per_attention / 2
        b = per_token + per_attention * (start + 0.5)
        room = max(self.room_s, 0.0)
        n = room / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * room)) / (2 * a)
        fit = min(wanted, int(n))
        if self.first_chunk:
            fit = max(fit, min(wanted, self.min_chunk))
        if fit <= 0:
            return 0
        self.first_chunk = False
        self.room_s -= per_token * fit + per_attention * fit * (start + (fit + 1) / 2)
        return fit
