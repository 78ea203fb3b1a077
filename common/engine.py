"""The engine: one loop that owns a scheduler, a KV cache manager and a model runner.

A request's path inside a worker: `add_request` validates and tokenizes it (bad input is
refused here, before it can touch anything shared) → the scheduler queues it → each `step`
schedules a batch, runs one forward pass, samples, and turns new tokens into text deltas
(incremental detokenization, stop rules) → a finished request's blocks go back to the pool
at once, its full blocks staying in the prefix cache for whoever shares its prefix."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from pdserve.common.config import EngineConfig, default_threads
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.errors import InvalidRequestError, WorkerBusyError
from pdserve.common.handoff.handle import KvHandle
from pdserve.common.handoff.remote_queue import RemoteQueueFull
from pdserve.common.kv_cache_manager import KVCacheManager
from pdserve.common.kv_host_tier import HostTier
from pdserve.common.kv_offload import DiskTier
from pdserve.common.kv_tiers import KVTier
from pdserve.common.model_files import resolve_model
from pdserve.common.model_runner import ModelRunner
from pdserve.common.prompts import Prompt, max_model_len, tokenize_prompt
from pdserve.common.request import Request, RequestStatus, Resume
from pdserve.common.sampler import TokenLogprobs
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.scheduler import Scheduler
from pdserve.common.step_cost import StepCostModel, attention_pairs
from pdserve.common.stop_checker import StopChecker
from pdserve.common.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)

# A worker idle this long that still predicts a lone prompt past its TTFT target relearns its
# step costs (LLMEngine._admit).
RELEARN_AFTER_S = 30.0


@dataclass
class RequestOutput:
    """What one step produced for one request: the new tokens and text since the last
    output, and on the last one the finish reason. `token_ids`/`text` accumulate."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Log-probabilities of `new_token_ids` (empty when the request asked for none).
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # When it asked for them, on every output: its prompt tokens' (entry i is token i + 1's;
    # the first prompt token has none). Complete from the first output on.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # A stream's last output when its request moves to another worker (live migration):
    # its KV, leased here (`common/handoff/migration.py`). `finished`, with no reason.
    migrate_kv: KvHandle | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = (config or EngineConfig()).validate()
        torch.set_num_threads(config.threads or default_threads())
        self.model_dir = resolve_model(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.runner = ModelRunner(config, self.model_dir)
        self.max_model_len = max_model_len(self.runner.hf_config, config.max_model_len)
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        kv = self.runner.kv_cache
        disk = host = shared = None
        if config.kv_offload_dir:
            disk = self._disk_tier("kv_offload_dir", config.kv_offload_dir, config.kv_offload_gb)
        if config.kv_host_offload_gb:
            host = HostTier(
                int(config.kv_host_offload_gb * 2**30), kv.shape[1:], kv.dtype,
                pin=kv.device.type == "cuda", below=disk.store if disk is not None else None,
            )  # fmt: skip
        if config.kv_shared_dir:
            shared = self._disk_tier(
                "kv_shared_dir", config.kv_shared_dir, config.kv_shared_gb, shared=True
            )
        self.kv_cache.attach_tiers(kv, host=host, disk=disk, shared=shared)
        self.step_cost = StepCostModel()
        # The first step with prompt tokens and the first without pay one-off costs (the
        # allocator's growth, each kernel's first call, a C++ extension built on first use:
        # once ~30 s), which a least-squares fit would spread over every later prediction.
        self._cold_step_kinds = {True, False}
        self._last_step_end = time.monotonic()  # when a step last ran (see _admit)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens,
            self.step_cost, config.tpot_target_ms / 1000,
        )  # fmt: skip
        self.eos_token_ids = self._eos_token_ids()
        self._ids = itertools.count()
        self.last_batch_size = 0  # requests in the last step (0: nothing could be scheduled)
        self.prefill_seconds_per_token: float | None = None  # measured, see _time_prefill
        self._grammars: GrammarCompiler | None = None  # made on the first constrained request
        self._grammars_lock = threading.Lock()

    def grammars(self) -> GrammarCompiler:
        """This engine's compiler of structured-output constraints (any thread)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer, self.runner.hf_config.vocab_size, sorted(self.eos_token_ids)
                )
            return self._grammars

    def _disk_tier(self, name: str, folder: str, gb: float, shared: bool = False) -> DiskTier:
        kv = self.runner.kv_cache
        try:
            return DiskTier(
                folder, int(gb * 2**30), self.runner.layout_fingerprint, kv.shape[1:], kv.dtype,
                shared=shared,
            )  # fmt: skip
        except OSError as e:
            raise ValueError(f"{name}: cannot use {folder!r} for the KV tier: {e}") from e

    def close(self) -> None:
        """Finish the tiers' pending writes (so a restart finds them) and stop their threads."""
        self.kv_cache.tiers.close()

    def _eos_token_ids(self) -> frozenset[int]:
        """EOS ids from the model config, the generation config (where chat models list
        several) and the tokenizer."""
        sources = [getattr(self.runner.hf_config, "eos_token_id", None)]
        sources.append(self.tokenizer.eos_token_id)
        with contextlib.suppress(OSError):  # the folder may have no generation_config.json
            sources.append(GenerationConfig.from_pretrained(self.model_dir).eos_token_id)
        ids: set[int] = set()
        for eos in sources:
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(eos)
        return frozenset(ids)

    # ---- requests in -------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt, chat messages (template applied) or token ids."""
        return tokenize_prompt(self.tokenizer, prompt, self.runner.hf_config.vocab_size)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
        resume: Resume | None = None,
        ttft_target_s: float = 0.0,
    ) -> Request:
        """Validate, tokenize and queue one request. Raises `InvalidRequestError`. A
        `prefill_only` request stops after its first token and keeps its KV blocks (status
        PREFILLED); the handoff leases them (`common/handoff`). `resume`: the
        prompt ends with output of this request from an earlier, lost leg. `ttft_target_s`
        (serving; 0: none): raises `WorkerBusyError` when the prompt's first token is
        predicted later than that, so a saturated worker refuses early instead of letting
        every request miss (a resumed leg is never refused: its stream is already open)."""
        request = self._new_request(prompt, params, request_id, resume)
        request.prefill_only = prefill_only
        if ttft_target_s > 0 and resume is None:
            self._admit(request, ttft_target_s)
        self.scheduler.add_request(request)
        return request

    def _admit(self, request: Request, ttft_target_s: float) -> None:
        wait = self.scheduler.prefill_wait_s(request)
        if wait is None or wait <= ttft_target_s:
            return
        idle_s = time.monotonic() - self._last_step_end
        if not self.scheduler.requests and idle_s >= RELEARN_AFTER_S:
            # Idle, and refusing a lone prompt for a while: the fit may be stale (steps
            # measured under a neighbour's load, say), and refusing everything it would never
            # learn otherwise. Start over, as at start-up: admit while unmeasured.
            logger.warning(
                "idle for %.0f s and predicting %.2f s for a lone %d-token prompt, past the "
                "TTFT target: relearning the step costs from the next steps",
                idle_s, wait, request.num_tokens,
            )  # fmt: skip
            self.step_cost.reset()
            return
        raise WorkerBusyError(
            f"this worker's first token for a {request.num_tokens}-token prompt is "
            f"predicted in {wait:.2f} s, past its TTFT target (--ttft-target-ms "
            f"{ttft_target_s * 1000:g}); retry later or elsewhere",
            reason="ttft_target",
            retry_after_s=wait - ttft_target_s,
        )

    def _new_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        resume: Resume | None = None,
    ) -> Request:
        params = (params or SamplingParams()).validate()
        token_ids = self.tokenize(prompt)
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{len(token_ids)} tokens is longer than max_model_len ({self.max_model_len})",
            )
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        if self.kv_cache.blocks_needed(longest) > self.runner.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens ({longest} tokens) needs more KV blocks than the cache "
                f"holds ({self.runner.num_blocks} x {self.config.block_size} tokens)",
            )
        request = Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
        )
        if params.seed is not None:
            request.generator = torch.Generator(self.runner.device).manual_seed(params.seed)
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer, token_ids, params.skip_special_tokens
        )
        request.stop_checker = StopChecker(params, self.eos_token_ids)
        self._check_token_ids(params)
        request.bad_word_ids = self._bad_word_ids(params.bad_words)
        if params.structured is not None:
            request.constraint = self.grammars().matcher(params.structured)
        if params.prompt_logprobs is not None and resume is None:
            request.prompt_logprobs = []
        if resume is not None:
            self._resume(request, resume)
        return request

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.runner.hf_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids",
                          params.allowed_token_ids)):  # fmt: skip
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(name, f"token ids must be in [0, {vocab}), got {bad}")

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as tokens, alone and after a space (as vLLM tokenizes them)."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _resume(self, request: Request, resume: Resume) -> None:
        """Bring a resumed request's output state to where its lost leg left it."""
        n = resume.output_tokens
        prompt = request.prompt_token_ids
        if not 0 < n < len(prompt):
            raise InvalidRequestError(
                "resumed.output_tokens", f"must be in [1, {len(prompt)}), got {n}"
            )
        params = request.sampling_params
        request.num_resumed_tokens = n
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt[:-n], params.skip_special_tokens
        )
        text = "".join(request.detokenizer.add(t) for t in prompt[-n:])
        if resume.sent_chars > len(text):
            raise InvalidRequestError(
                "resumed.sent_chars", f"the output so far has {len(text)} characters"
            )
        assert request.stop_checker is not None
        request.stop_checker.resume(text, resume.sent_chars)
        request.output_text = text[: resume.sent_chars]
        if request.generator is not None and not params.greedy:
            self._skip_draws(request.generator, n)
        if request.constraint is not None:  # the lost leg's output, under its grammar
            request.constraint.replay(prompt[-n:], "resumed.output_tokens")

    def _skip_draws(self, generator: torch.Generator, draws: int) -> None:
        """Advance a seeded generator past `draws` tokens' noise (one row of the vocabulary
        each, drawn as the sampler draws it)."""
        row = torch.empty(1, self.runner.hf_config.vocab_size, device=self.runner.device)
        for _ in range(draws):
            row.exponential_(generator=generator)

    # ---- requests prefilled elsewhere (a decode worker's side of the handoff) ----------

    def new_prefilled_request(
        self,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        resume: Resume | None = None,
    ) -> Request:
        """A request whose prompt was computed and first token sampled by another worker.
        Its output state (detokenizer, stop rules, seeded generator) is brought to where
        that worker left it, so the tokens after the first are those one engine would give.
        It holds no blocks yet: see `add_prefilled`."""
        request = self._new_request(list(prompt_token_ids), params, request_id, resume)
        request.prompt_logprobs = None  # the prefill worker reported them
        vocab = self.runner.hf_config.vocab_size
        if not 0 <= first_token_id < vocab:
            raise InvalidRequestError(
                "first_token_id", f"must be in [0, {vocab}), got {first_token_id}"
            )
        if request.generator is not None and not request.sampling_params.greedy:
            # The first draw consumed one row of noise from the generator: consume it here.
            self._skip_draws(request.generator, 1)
        if request.constraint is not None:  # the grammar state the prefill worker left
            request.constraint.replay([first_token_id], "first_token_id")
        request.append_output_token(first_token_id)
        if self._process_token(request, first_token_id, in_scheduler=False).finished:
            raise InvalidRequestError(
                "first_token_id", "the first token already ends this request; nothing to decode"
            )
        self.kv_cache.prefetch(request)  # the tier's copy of its prefix, read while it queues
        return request

    def add_prefilled(
        self,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        resume: Resume | None = None,
    ) -> tuple[Request, Future[int]]:
        """A request prefilled elsewhere (`new_prefilled_request`), queued for its blocks: a
        future of how many leading blocks this worker's prefix cache serves (the rest are
        pulled; then `scheduler.remote.landed`). Raises `InvalidRequestError`, or
        `RemoteQueueFull` having given back what it made."""
        request = self.new_prefilled_request(
            prompt_token_ids, first_token_id, params, request_id, resume
        )
        try:
            return request, self.scheduler.remote.submit(request)
        except RemoteQueueFull:
            self.scheduler.remote.withdraw(request)
            raise

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def drop(self, request: Request) -> None:
        """End this request wherever it is and give back its blocks: in the scheduler
        (aborted), PREFILLED (blocks kept for a handoff, under a lease or not yet), or
        waiting for its KV from another worker."""
        if self.scheduler.requests.get(request.request_id) is request:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        elif request.status == RequestStatus.PREFILLED:
            self.scheduler.leases.pop_request(request)
            self.kv_cache.free(request)
        elif not request.finished:
            self.scheduler.remote.withdraw(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        step_start = time.perf_counter()
        batch = self.scheduler.schedule()
        self.last_batch_size = len(batch.requests)
        if not batch.requests:
            return []
        attention = sum(
            attention_pairs(r.num_computed_tokens, n)
            for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)
        )
        prefill = batch.num_tokens - batch.num_decodes
        start = time.perf_counter()
        sampled = self.runner.execute(batch)
        self._time_prefill(prefill, time.perf_counter() - start)
        self.scheduler.on_step_computed(batch)
        outputs = []
        now = time.monotonic()
        for s in sampled:
            request = s.request
            if request.constraint is not None:
                request.constraint.accept(s.token_id)
            request.append_output_token(s.token_id)
            if s.logprobs is not None:
                request.logprobs.append(s.logprobs)
            if request.first_token_time is None:
                request.first_token_time = now
            outputs.append(self._process_token(request, s.token_id, logprobs=s.logprobs))
        seconds = time.perf_counter() - step_start
        self._last_step_end = time.monotonic()
        kind = prefill > 0
        if kind in self._cold_step_kinds:
            self._cold_step_kinds.discard(kind)
        else:
            self.step_cost.record(batch.num_decodes, prefill, attention, seconds)
        return outputs

    def _time_prefill(self, prefill_tokens: int, seconds: float) -> None:
        """A running mean of a prompt token's compute time, from steps that are mostly
        prefill (what a block read back from the tier saves)."""
        if prefill_tokens >= 4 * self.config.block_size:
            per_token = seconds / prefill_tokens
            old = self.prefill_seconds_per_token
            new = per_token if old is None else 0.8 * old + 0.2 * per_token
            self.prefill_seconds_per_token = self.kv_cache.prefill_seconds_per_token = new

    def tier_cost(self, tier: KVTier | None) -> float:
        """Bringing a block back from `tier` over computing it, both measured here (0 while
        either is unknown, or without the tier)."""
        load = tier.seconds_per_load() if tier is not None else None
        compute = self.prefill_seconds_per_token
        if load is None or not compute:
            return 0.0
        return min(1.0, load / (compute * self.config.block_size))

    def _process_token(
        self,
        request: Request,
        token_id: int,
        in_scheduler: bool = True,
        logprobs: TokenLogprobs | None = None,
    ) -> RequestOutput:
        assert request.detokenizer is not None and request.stop_checker is not None
        delta = request.detokenizer.add(token_id)
        result = request.stop_checker.check(token_id, delta, flush=request.detokenizer.flush)
        request.output_text += result.text
        finished = result.finished
        if not finished and request.constraint is not None and request.constraint.terminated:
            finished = True  # the structure is complete (its grammar took the end token)
            request.stop_checker.finish_reason = "stop"
        if not finished and request.num_tokens >= self.max_model_len:
            finished = True
            request.stop_checker.finish_reason = "length"
        if finished and in_scheduler:
            reason = result.finish_reason or request.stop_checker.finish_reason
            status = (
                RequestStatus.FINISHED_LENGTH if reason == "length"
                else RequestStatus.FINISHED_STOPPED
            )  # fmt: skip
            request.finish_time = time.monotonic()
            self.scheduler.finish(request, status)
        elif request.prefill_only and in_scheduler:
            finished = True
            request.finish_time = time.monotonic()
            self.scheduler.finish(request, RequestStatus.PREFILLED)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[token_id],
            new_text=result.text,
            finished=finished,
            finish_reason=request.status.finish_reason if finished else None,
            prompt_tokens=request.num_prompt_tokens,
            cached_tokens=request.num_cached_tokens,
            token_ids=request.output_token_ids,
            text=request.output_text,
            logprobs=request.logprobs,
            new_logprobs=[logprobs] if logprobs is not None else [],
            prompt_logprobs=request.prompt_logprobs,
        )

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Run a batch to completion; outputs in input order. Any bad request raises before
        anything runs (use `add_request` per request to isolate errors)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp).request_id for p, sp in zip(prompts, params, strict=True)]
        final = self.run_until_done(len(ids), progress)
        return [final[i] for i in ids]

    def run_until_done(self, total: int, progress: bool = False) -> dict[str, RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = _progress_bar(total, progress)
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return final


def _progress_bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc="requests", unit="req", file=None)
