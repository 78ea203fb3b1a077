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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from pdserve.common.config import EngineConfig, default_threads
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.errors import InvalidRequestError
from pdserve.common.kv_cache_manager import KVCacheManager
from pdserve.common.model_files import resolve_model
from pdserve.common.model_runner import ModelRunner
from pdserve.common.request import Request, RequestStatus
from pdserve.common.sampler import TokenLogprobs
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.scheduler import Scheduler
from pdserve.common.stop_checker import StopChecker

logger = logging.getLogger(__name__)

# A prompt: text, chat messages ([{"role": ..., "content": ...}]), or token ids.
Prompt = str | list[dict[str, str]] | list[int]


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


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = (config or EngineConfig()).validate()
        torch.set_num_threads(config.threads or default_threads())
        self.model_dir = resolve_model(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.runner = ModelRunner(config, self.model_dir)
        hf = self.runner.hf_config
        limit = hf.max_position_embeddings
        if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True):
            limit = min(limit, hf.sliding_window)  # we attend over the full context
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.eos_token_ids = self._eos_token_ids()
        self._ids = itertools.count()

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
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError("prompt", "must be a non-empty string, list of messages "
                                      "or list of token ids")  # fmt: skip
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.runner.hf_config.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError("token_ids", f"ids must be in [0, {vocab}), got {bad}")
            return list(prompt)
        if all(isinstance(m, dict) for m in prompt):
            for i, m in enumerate(prompt):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise InvalidRequestError(
                        f"messages[{i}]", "must have string 'role' and 'content'"
                    )
            ids = self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        raise InvalidRequestError("prompt", "a list prompt must be all token ids or all messages")

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        """Validate, tokenize and queue one request. Raises `InvalidRequestError`."""
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
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        sampled = self.runner.execute(batch)
        self.scheduler.on_step_computed(batch)
        outputs = []
        now = time.monotonic()
        for s in sampled:
            request = s.request
            request.append_output_token(s.token_id)
            if s.logprobs is not None:
                request.logprobs.append(s.logprobs)
            if request.first_token_time is None:
                request.first_token_time = now
            outputs.append(self._process_token(request, s.token_id))
        return outputs

    def _process_token(self, request: Request, token_id: int) -> RequestOutput:
        assert request.detokenizer is not None and request.stop_checker is not None
        delta = request.detokenizer.add(token_id)
        result = request.stop_checker.check(token_id, delta, flush=request.detokenizer.flush)
        request.output_text += result.text
        finished = result.finished
        if not finished and request.num_tokens >= self.max_model_len:
            finished = True
            request.stop_checker.finish_reason = "length"
        if finished:
            reason = result.finish_reason or request.stop_checker.finish_reason
            status = (
                RequestStatus.FINISHED_LENGTH if reason == "length"
                else RequestStatus.FINISHED_STOPPED
            )  # fmt: skip
            request.finish_time = time.monotonic()
            self.scheduler.finish(request, status)
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
