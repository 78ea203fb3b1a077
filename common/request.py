"""One request's whole state inside an engine, from arrival to finish.

Lifecycle: WAITING (queued) → RUNNING (has KV blocks, advances each step; prefill chunks
then decode tokens) → PREEMPTED (blocks taken back, back in the queue to be recomputed) →
RUNNING … → one of the FINISHED states, or PREFILLED (a prefill worker's request after its
first token: out of the scheduler, blocks kept for the decode worker to pull). The status
enum is ordered so `status > PREEMPTED` means finished. The scheduler, KV manager, model
runner and output path all read and write this one object; nothing keeps a parallel copy."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pdserve.common.block_pool import KVCacheBlock
    from pdserve.common.detokenizer import IncrementalDetokenizer
    from pdserve.common.stop_checker import StopChecker
    from pdserve.common.structured_output import Constraint


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    # Prefill-only request done: it left the scheduler but keeps its blocks for a handoff.
    PREFILLED = 6

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True)
class Resume:
    """A request continued on new workers after it lost one: the last `output_tokens`
    prompt tokens are output it had already generated, and the client already has the first
    `sent_chars` characters of their text. Its output state (text, stop rules, seeded
    generator) is rebuilt from them, so held-back text is sent, a stop string spanning the
    two legs is found, and sampling goes on as if no worker had been lost."""

    output_tokens: int
    sent_chars: int


@dataclass(frozen=True)
class PenaltyHistory:
    """The token ids a request's penalties count (`logits_processors.py`): its prompt (the
    client's, without a lost leg's output) and everything it has generated."""

    prompt: list[int]
    output: list[int]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    # Stop after the first token and keep the KV blocks (a prefill worker's requests).
    prefill_only: bool = False
    status: RequestStatus = RequestStatus.WAITING

    # Prompt followed by every generated token; what the model must have computed KV for.
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache when the request was first scheduled.
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    # KV blocks held, in sequence order, and the hashes of the full ones (a prefix of it).
    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already in the prefix cache index

    # Output side: seeded generator, detokenizer, stop rules, emitted text and logprobs.
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    stop_checker: StopChecker | None = None
    # Its grammar state when its output is constrained (`structured_output.py`).
    constraint: Constraint | None = None
    # Its `bad_words` as token sequences (each with and without a leading space).
    bad_word_ids: list[list[int]] = field(default_factory=list)
    # The prompt's last tokens that a lost leg generated (a resumed request's output).
    num_resumed_tokens: int = 0
    output_text: str = ""
    logprobs: list = field(default_factory=list)
    # Its prompt tokens' log-probabilities (entry i: token i + 1), while it asks for them;
    # None otherwise (and for a resumed leg, whose first leg reported them).
    prompt_logprobs: list | None = None
    scheduled_time: float | None = None  # first admitted into a batch (monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    def penalty_history(self) -> PenaltyHistory:
        """What its penalties count: the client's prompt, and all the output so far."""
        cut = len(self.prompt_token_ids) - self.num_resumed_tokens
        return PenaltyHistory(
            self.prompt_token_ids[:cut], self.prompt_token_ids[cut:] + self.output_token_ids
        )

    @property
    def computing_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are still to compute: it asks for them and has no output yet
        (a preempted request that recomputes later does not redo them)."""
        return self.prompt_logprobs is not None and not self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
