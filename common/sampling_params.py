"""Per-request sampling settings, validated once when a request enters the engine.

Limits follow the usual OpenAI / vLLM meanings: temperature 0 means greedy, top_k -1 means
no top-k, top_p in (0, 1]. A temperature below `GREEDY_BELOW` is greedy too (as in vLLM):
dividing logits by a subnormal temperature overflows them to inf and the softmax to NaN.
Stop strings are bounded (count and length) so that a request cannot make every step's stop
check slow. A bad value raises `InvalidRequestError` naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.common.errors import InvalidRequestError
from pdserve.common.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**64 - 1
GREEDY_BELOW = 1e-5
MAX_LOGIT_BIAS = 300  # tokens per request (OpenAI's limit)
MAX_BAD_WORDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    # Stop tokens (EOS, stop_token_ids) and stop strings are held off until this many tokens.
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Return the log-probabilities of this many most likely tokens at each step (0: only the
    # sampled token's; None: none at all).
    logprobs: int | None = None
    # Return the log-probability of every prompt token after the first, with this many most
    # likely alternatives at each position (vLLM's `prompt_logprobs`; None: none). A request
    # that asks for them computes its whole prompt (no prefix-cache hit).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Hold the output to a JSON schema, regex, choice or grammar (`structured_output.py`).
    structured: StructuredOutput | None = None
    # The logit adjustments of `logits_processors.py`, each neutral by default.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> SamplingParams:
        """Raise `InvalidRequestError` for the first field out of range; return self."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or not 0 <= self.min_tokens <= self.max_tokens
        ):
            raise InvalidRequestError(
                "min_tokens",
                f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
            )
        if (
            not _is_number(self.temperature)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise InvalidRequestError(
                "temperature",
                f"must be a finite number >= 0 (0 is greedy), got {self.temperature!r}",
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or self.top_k == 0
            or self.top_k < -1
        ):
            raise InvalidRequestError(
                "top_k", f"must be -1 (disabled) or at least 1, got {self.top_k!r}"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed <= MAX_SEED
        ):
            raise InvalidRequestError("seed", f"must be an integer in [0, 2^64), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop", "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                "stop", f"at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise InvalidRequestError(
                "stop", f"each string at most {MAX_STOP_CHARS} characters, got {longest}"
            )
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError("stop_token_ids", "must be a list of token ids >= 0")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                "logprobs", f"must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"
            )
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(
                "prompt_logprobs",
                f"must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs!r}",
            )
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError("structured", "must be a StructuredOutput")
        self._validate_adjustments()
        return self

    def _validate_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if not _is_number(r) or not 0.0 < r <= 2.0:
            raise InvalidRequestError("repetition_penalty", f"must be in (0, 2], got {r!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
            )
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequestError("logit_bias", f"keys must be token ids, got {token!r}")
            if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias[{token}]", f"must be in [-100, 100], got {bias!r}"
                )
        if len(self.bad_words) > MAX_BAD_WORDS or not all(
            isinstance(w, str) and w for w in self.bad_words
        ):
            raise InvalidRequestError(
                "bad_words", f"must be at most {MAX_BAD_WORDS} non-empty strings"
            )
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0
            for t in self.allowed_token_ids
        ):
            raise InvalidRequestError("allowed_token_ids", "must be a list of token ids >= 0")


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
