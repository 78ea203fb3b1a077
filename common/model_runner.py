"""The model runner: owns the weights and the KV cache tensor, turns a `ScheduledBatch` into
one forward pass, and samples the next token for every request that has reached the end of
its known tokens. All tensor work of a step happens here; the scheduler and KV manager only
deal in ids.

KV cache layout (block-major, one contiguous region per block so a block moves between
workers as one buffer): `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`."""

from __future__ import annotations

import hashlib
import logging
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from pdserve.common.config import EngineConfig
from pdserve.common.decode_graphs import DecodeGraphs
from pdserve.common.errors import ModelLoadError
from pdserve.common.logits_processors import bad_word_bans, wants_penalties
from pdserve.common.models import fp8
from pdserve.common.models.attention import AttentionMetadata
from pdserve.common.models.expert_balance import ExpertBalancer
from pdserve.common.models.expert_parallel import ExpertShard
from pdserve.common.models.families import family_for
from pdserve.common.models.llama import LlamaForCausalLM
from pdserve.common.models.tensor_parallel import TensorShard
from pdserve.common.models.tp_steps import (
    CommandHandler,
    StepInputs,
    StepSender,
    receive_step,
)
from pdserve.common.prompts import max_model_len
from pdserve.common.request import Request
from pdserve.common.sampler import Sampler, TokenLogprobs, token_logprobs
from pdserve.common.scheduler import ScheduledBatch
from pdserve.kernels import invariant_gemm

logger = logging.getLogger(__name__)


@dataclass
class SampledToken:
    request: Request
    token_id: int
    logprobs: TokenLogprobs | None


def _group_timeout_s() -> float:
    import os

    return float(os.environ.get("PDSERVE_EP_TIMEOUT", "300"))


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                state[name] = f.get_tensor(name)
    return state


def kv_bytes_per_block(
    hf_config: PretrainedConfig, block_size: int, dtype: torch.dtype, kv_heads: int | None = None
) -> int:
    """`kv_heads`: the KV heads one rank keeps (default: all of the model's)."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    elem = torch.empty((), dtype=dtype).element_size()
    heads = hf_config.num_key_value_heads if kv_heads is None else kv_heads
    return hf_config.num_hidden_layers * 2 * block_size * heads * head_dim * elem


def num_kv_blocks(
    config: EngineConfig, hf_config: PretrainedConfig, kv_heads: int | None = None
) -> int:
    """Blocks in one rank's pool; under tensor parallelism `--kv-cache-gb` is per rank."""
    if config.kv_cache_tokens is not None:
        return max(1, config.kv_cache_tokens // config.block_size)
    per_block = kv_bytes_per_block(hf_config, config.block_size, config.torch_dtype, kv_heads)
    return max(1, int(config.kv_cache_gb * 2**30) // per_block)


def allocate_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The KV cache tensor, committed up front. On CPU it is an anonymous mapping advised onto
    transparent huge pages: decode attention reads blocks scattered over the whole pool, and
    2 MB pages spare it most TLB misses (measured: decode attention ~25% faster at batch 64).
    Touching every page here moves the page faults from the first requests' steps (measured:
    writing a fresh block's K/V several times slower) to start-up."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype).view(shape).zero_()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        shard = self._expert_shard() if config.expert_parallel > 1 else None
        self.tp = self._tensor_shard() if config.tensor_parallel > 1 else None
        state = load_state_dict(model_dir)
        quant = getattr(self.hf_config, "quantization_config", None)
        state = fp8.load_weights(state, quant, self.dtype, self.device)  # FP8 checkpoints
        try:
            self.model = LlamaForCausalLM(
                self.hf_config, state, self.dtype, self.device, shard, self.tp
            )
        except ValueError as exc:  # a model the shard cannot split
            raise ModelLoadError(str(exc)) from None
        # Tensor parallelism: rank 0 hands its steps to the others (`follow`).
        self.step_sender = (
            StepSender(self.tp, self.device) if self.tp is not None and self.tp.rank == 0 else None
        )
        self.num_forwards = 0  # model forwards so far (expert-parallel ranks keep in step)
        self.expert_balance = ExpertBalancer(self.model.moe_blocks(), config)
        count = config.count_expert_tokens or config.redundant_experts > 0
        self.expert_counter = self.model.enable_expert_counting() if count else None
        m = self.model
        # Under tensor parallelism every rank has as many blocks as the one with most heads.
        heads = self.tp.max_kv_heads(self.hf_config.num_key_value_heads) if self.tp else None
        self.num_blocks = num_kv_blocks(config, self.hf_config, heads)
        self.kv_cache = allocate_kv_cache(
            (self.num_blocks, m.num_layers, 2, self.block_size, m.num_kv_heads, m.head_dim),
            self.dtype,
            self.device,
        )
        self.sampler = Sampler()
        self.layout_fingerprint = self._layout_fingerprint(state["model.embed_tokens.weight"])
        del state
        self.decode_graphs = self._capture_decode_graphs()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            self.num_blocks, self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
        )  # fmt: skip

    @torch.inference_mode()
    def _layout_fingerprint(self, embed: torch.Tensor) -> str:
        """Names what a KV block holds: two workers may exchange blocks only if this is
        equal. Shapes and dtype, plus a digest of a few embedding rows (of the checkpoint,
        whatever the sharding) so two checkpoints of one architecture do not mix. It names
        the whole model's layout: under tensor parallelism a rank's blocks hold its heads of
        it (the KV handle says the group's size; `head_slices.py` maps one group's heads
        onto another's)."""
        m = self.model
        rows = embed[:: max(1, embed.shape[0] // 8)][:8].to(self.dtype)
        digest = hashlib.sha256(rows.float().cpu().numpy().tobytes()).hexdigest()[:12]
        arch = self.hf_config.model_type
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{arch}/{dtype}/layers={m.num_layers}/kv_heads={self.hf_config.num_key_value_heads}"
            f"/head_dim={m.head_dim}/block={self.block_size}/{digest}"
        )

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of decode steps (`decode_graphs.py`) on a GPU for a dense model on one
        rank with the batch-invariant kernels (padding relies on them), unless
        `enforce_eager`; None where steps run eagerly."""
        c = self.config
        if (
            self.device.type != "cuda"
            or c.enforce_eager
            or not invariant_gemm.enabled()
            or self.tp is not None
            or c.expert_parallel > 1
            or self.model.moe_blocks()
        ):
            return None
        longest = max_model_len(self.hf_config, c.max_model_len)
        graphs = DecodeGraphs(
            self.model, self.kv_cache, c.max_num_seqs, -(-longest // self.block_size)
        )
        graphs.capture()
        return graphs

    def _tensor_shard(self) -> TensorShard:
        """This rank's place in its tensor-parallel group; the process already belongs to
        it (`rank_group.join_rank_group`)."""
        import torch.distributed as dist

        world_size = self.config.tensor_parallel
        if not dist.is_initialized() or dist.get_world_size() != world_size:
            raise RuntimeError(f"tensor_parallel={world_size} needs a process group of that size")
        rank, shm = dist.get_rank(), None
        if self.device.type == "cpu":  # the ranks of one host: collectives in shared memory
            from pdserve.kernels import shm_collective

            shm = shm_collective.create(rank, world_size, _group_timeout_s())
        return TensorShard(rank, world_size, shm=shm)

    def follow(self, on_command: CommandHandler | None = None) -> None:
        """Tensor-parallel ranks 1..N-1: run rank 0's steps on this rank's shard, and its
        commands through `on_command`, until it stops (`tp_steps`)."""
        assert self.tp is not None and self.tp.rank != 0
        handler = {} if on_command is None else {"on_command": on_command}
        with torch.inference_mode():
            while (step := receive_step(self.tp, self.device, **handler)) is not None:
                hidden = self.model.forward(
                    step.input_ids, step.positions, step.meta, self.kv_cache
                )
                self.num_forwards += 1
                if step.sample_idx.numel():
                    self.model.compute_logits(hidden[step.sample_idx])

    def stop_followers(self) -> None:
        """Rank 0 of a tensor-parallel group: let the other ranks' `follow` return."""
        if self.step_sender is not None:
            self.step_sender.stop()
            self.step_sender = None

    def _expert_shard(self) -> ExpertShard:
        """This rank's share of every MoE layer's experts; the process already belongs to
        its expert-parallel group (`expert_parallel.init_group`)."""
        import torch.distributed as dist

        world_size = self.config.expert_parallel
        moe = family_for(self.hf_config).moe
        if moe is None:
            raise ModelLoadError("expert_parallel: the model has no mixture-of-experts layers")
        if not dist.is_initialized() or dist.get_world_size() != world_size:
            raise RuntimeError(f"expert_parallel={world_size} needs a process group of that size")
        try:
            return ExpertShard(
                dist.get_rank(), world_size, getattr(self.hf_config, moe.num_experts_attr),
                redundant=self.config.redundant_experts,
            )  # fmt: skip
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None

    def idle_step(self) -> None:
        """One model step without tokens: an expert-parallel rank with nothing to run still
        joins the other ranks' exchanges."""
        self.model.idle_forward()
        self.num_forwards += 1

    def rebalance_experts_if_due(self) -> None:
        """Expert parallelism: every rank calls this once per lockstep iteration, after its
        step (or idle step); see `ExpertBalancer.after_step`."""
        if self.config.expert_parallel > 1 and self.expert_counter is not None:
            self.expert_balance.after_step(self.num_forwards, self.expert_counter.counts)

    def expert_imbalance(self) -> torch.Tensor | None:
        """Per layer, the busiest rank's routed tokens over the mean rank's under the current
        expert placement ([num_layers] float64; 1.0 for dense layers); None unless counting
        is on for an MoE model. Issues no collective (safe from any thread)."""
        counts = self.expert_token_counts()
        return None if counts is None else self.expert_balance.imbalance(counts)

    def expert_token_counts(self) -> torch.Tensor | None:
        """Tokens routed to each expert of each layer so far, [num_layers, num_experts] on the
        CPU (rows of dense layers are zero); None unless counting is on for an MoE model."""
        return None if self.expert_counter is None else self.expert_counter.snapshot()

    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        graphs = self.decode_graphs
        requests = batch.requests
        prompt = _PromptRows()
        if (
            graphs is not None
            and batch.num_decodes == len(requests)
            and graphs.fits(len(requests), max(len(r.blocks) for r in requests))
        ):
            tokens, positions, slots, rows, sampling = self._decode_rows(requests)
            hidden = graphs.run(tokens, positions, slots, [r.block_ids for r in requests])
            sample_idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        else:
            input_ids, pos, meta, sample_idx, sampling, prompt = self._prepare(batch)
            if prompt.rows:  # their logits come with the sampled rows' (one lm_head call)
                rows = torch.tensor(prompt.rows, dtype=torch.int64, device=self.device)
                sample_idx = torch.cat([sample_idx, rows])
            if self.step_sender is not None:
                self.step_sender.send(StepInputs(input_ids, pos, meta, sample_idx))
            hidden = self.model.forward(input_ids, pos, meta, self.kv_cache)
        self.num_forwards += 1
        if not sample_idx.numel():
            return []
        logits = self.model.compute_logits(hidden[sample_idx])
        if prompt.rows:
            prompt.record(logits[len(sampling) :])
            logits = logits[: len(sampling)]
        if not sampling:
            return []
        out = self.sampler.sample(
            logits,
            [r.sampling_params for r in sampling],
            [r.generator for r in sampling],
            [_bans(r) for r in sampling],
            [r.constraint for r in sampling],
            [r.penalty_history() if wants_penalties(r.sampling_params) else None
             for r in sampling],
        )  # fmt: skip
        return [
            SampledToken(r, t, lp)
            for r, t, lp in zip(sampling, out.token_ids, out.logprobs, strict=True)
        ]

    def _decode_rows(
        self, decodes: list[Request]
    ) -> tuple[list[int], list[int], list[int], list[int], list[Request]]:
        """Decodes advance one token each, at position num_computed_tokens: their tokens,
        positions and KV slots, and which rows sample (and for whom)."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        sampling: list[Request] = []
        for i, r in enumerate(decodes):
            pos = r.num_computed_tokens
            tokens.append(r.all_token_ids[pos])
            positions.append(pos)
            slots.append(r.blocks[pos // bs].block_id * bs + pos % bs)
            if pos + 1 == r.num_tokens:
                sample_idx.append(i)
                sampling.append(r)
        return tokens, positions, slots, sample_idx, sampling

    def _prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        nd = batch.num_decodes
        decodes = batch.requests[:nd]
        tokens, positions, slots, sample_idx, sampling = self._decode_rows(decodes)
        prompt = _PromptRows()

        # Prefill chunks: a run of tokens each.
        query_start = [0]
        prefill_lens: list[int] = []
        offset = nd
        for r, n in zip(batch.requests[nd:], batch.num_new_tokens[nd:], strict=True):
            start = r.num_computed_tokens
            end = start + n
            tokens.extend(r.all_token_ids[start:end])
            pos = np.arange(start, end)
            positions.extend(pos.tolist())
            block_ids = np.asarray(r.block_ids, dtype=np.int64)
            slots.extend((block_ids[pos // bs] * bs + pos % bs).tolist())
            query_start.append(query_start[-1] + n)
            prefill_lens.append(end)
            if r.computing_prompt_logprobs:
                prompt.add(r, start, end, offset)
            offset += n
            if end == r.num_tokens:
                sample_idx.append(offset - 1)
                sampling.append(r)

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode_tokens=nd,
            decode_block_tables=self._block_table(decodes),
            decode_seq_lens=torch.tensor(
                [r.num_computed_tokens + 1 for r in decodes], dtype=torch.int32, device=device
            ),
            prefill_query_start_loc=query_start,
            prefill_seq_lens=prefill_lens,
            prefill_block_tables=self._block_table(batch.requests[nd:]),
        )
        return (
            torch.tensor(tokens, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            meta,
            torch.tensor(sample_idx, dtype=torch.int64, device=device),
            sampling,
            prompt,
        )

    def _block_table(self, requests: list[Request]) -> torch.Tensor:
        width = max((len(r.blocks) for r in requests), default=0)
        table = np.zeros((len(requests), width), dtype=np.int32)
        for i, r in enumerate(requests):
            table[i, : len(r.blocks)] = r.block_ids
        return torch.from_numpy(table).to(self.device)


class _PromptRows:
    """The rows of a step whose logits give prompt logprobs: position p of a prompt chunk
    predicts prompt token p + 1 (the last prompt position predicts the first output token,
    sampled as usual)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.targets: list[int] = []
        self.spans: list[tuple[Request, int, int]] = []  # (request, first position, count)

    def add(self, request: Request, start: int, end: int, first_row: int) -> None:
        stop = min(end, request.num_prompt_tokens - 1)
        if stop > start:
            self.rows.extend(range(first_row, first_row + stop - start))
            self.targets.extend(request.all_token_ids[start + 1 : stop + 1])
        self.spans.append((request, start, max(0, stop - start)))

    def record(self, logits: torch.Tensor) -> None:
        """Each request's entries from `logits` (one row per `rows`), in prompt order; a
        chunk that starts over (after a preemption) replaces what was there."""
        targets = torch.tensor(self.targets, dtype=torch.int64, device=logits.device)
        tops: list[int] = []
        for r, _, count in self.spans:
            tops += [r.sampling_params.prompt_logprobs or 0] * count
        entries = token_logprobs(logits, targets, tops)
        at = 0
        for r, start, count in self.spans:
            assert r.prompt_logprobs is not None
            del r.prompt_logprobs[start:]
            r.prompt_logprobs.extend(entries[at : at + count])
            at += count


def _bans(request: Request) -> frozenset[int]:
    """The tokens a request may not draw this step: stop tokens under its min_tokens, and
    the last token of a bad word whose other tokens its output ends with."""
    banned = request.stop_checker.tokens_to_ban() if request.stop_checker else frozenset()
    if request.bad_word_ids:
        banned = banned | bad_word_bans(request.output_token_ids, request.bad_word_ids)
    return banned
