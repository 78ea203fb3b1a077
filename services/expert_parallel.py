"""`--expert-parallel N`: one command becomes N rank processes (`rank_group.py`) for
`pdserve generate` and the serving roles `prefill`, `decode`, `colocated` (which
`pdserve serve` starts).

Before any process starts, rank 0 checks that the model is a mixture of experts whose
expert count N divides. Each rank loads the whole model, keeps only its share of every MoE
layer's experts, and has its own KV cache (data-parallel attention). A serving rank is a
worker endpoint of its own (`worker_process.py`, `lockstep_loop.py`).

`pdserve generate`'s path: rank 0 reads and checks the JSONL lines and hands every rank the
list of good ones; rank r runs lines r, r+N, r+2N, … Every step all ranks agree whether any
has work left, and each runs one model step (an idle rank an empty one), so the MoE layers'
all-to-all exchanges line up. At the end rank 0 gathers every rank's results and writes
them in input order."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

import torch.distributed as dist

from pdserve.common.engine import LLMEngine, RequestOutput
from pdserve.common.errors import InvalidRequestError, PdserveError
from pdserve.common.models.expert_parallel import lockstep_busy
from pdserve.services.generate_lines import Defaults, parse_line, result_row
from pdserve.services.rank_group import RANK_ENV, RankGroup, join_rank_group


def check_model(model: str | None, world_size: int, redundant_experts: int = 0) -> None:
    """Clear errors before any process starts: a dense model, N not dividing the experts,
    more redundant slots than experts."""
    from transformers import AutoConfig

    from pdserve.common.model_files import resolve_model
    from pdserve.common.models.families import family_for

    config = AutoConfig.from_pretrained(resolve_model(model))
    family = family_for(config)
    if family.moe is None:
        raise PdserveError(
            f"--expert-parallel: {family.name} is not a mixture-of-experts model; "
            "use --expert-parallel 1"
        )
    experts = getattr(config, family.moe.num_experts_attr)
    if world_size < 1 or experts % world_size:
        raise PdserveError(
            f"--expert-parallel: must divide the model's {experts} experts, got {world_size}"
        )
    if redundant_experts > experts:
        raise PdserveError(
            f"--redundant-experts: at most the model's {experts} experts, got {redundant_experts}"
        )


def join_expert_parallel_group(args: argparse.Namespace, engine_flags: list[str]) -> RankGroup:
    """Check the model, then make this process a rank of its expert-parallel group."""
    world = args.expert_parallel
    if os.environ.get(RANK_ENV) is None:
        check_model(args.model, world, args.redundant_experts)
    return join_rank_group(args, engine_flags, world, "expert")


def run_generate_ranks(
    engine: LLMEngine, infile: TextIO, outfile: TextIO, defaults: Defaults
) -> int:
    """This rank's part of `pdserve generate`; on rank 0 returns the number of bad lines."""
    try:
        return _generate_on_rank(engine, infile, outfile, defaults)
    except RuntimeError as exc:  # a peer died or hung: a collective failed or timed out
        text = str(exc).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
        raise PdserveError(
            f"expert-parallel rank {dist.get_rank()}: the group failed: {reason}"
        ) from None


def _generate_on_rank(
    engine: LLMEngine, infile: TextIO, outfile: TextIO, defaults: Defaults
) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[int, dict[str, Any]] = {}
    good: list[tuple[int, int, Any, Any]] = []  # (index, line number, prompt, params)
    if rank == 0:
        index = 0
        for lineno, line in enumerate(infile, start=1):
            if not line.strip():
                continue
            try:
                prompt, params = parse_line(line, defaults)
                good.append((index, lineno, prompt, params))
            except InvalidRequestError as exc:
                results[index] = {"index": index, "error": str(exc), "line": lineno}
            index += 1
    shared: list[Any] = [good]
    dist.broadcast_object_list(shared, src=0)
    request_to_index: dict[str, int] = {}
    for index, lineno, prompt, params in shared[0][rank::world]:
        try:
            request = engine.add_request(prompt, params, request_id=f"line-{lineno}")
            request_to_index[request.request_id] = index
        except InvalidRequestError as exc:
            results[index] = {"index": index, "error": str(exc), "line": lineno}

    for request_id, out in _run_in_lockstep(engine).items():
        index = request_to_index[request_id]
        results[index] = result_row(index, out)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if rank != 0:
        return 0
    assert gathered is not None
    merged = {i: row for part in gathered for i, row in part.items()}
    errors = 0
    for i in sorted(merged):
        row = merged[i]
        if "error" in row:
            errors += 1
            print(f"pdserve generate: line {row.pop('line')}: {row['error']}", file=sys.stderr)
    for i in sorted(merged):
        outfile.write(json.dumps(merged[i], ensure_ascii=False) + "\n")
    return errors


def _run_in_lockstep(engine: LLMEngine) -> dict[str, RequestOutput]:
    runner = engine.runner
    final: dict[str, RequestOutput] = {}
    while lockstep_busy(engine.has_unfinished_requests(), runner.device):
        before = runner.num_forwards
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        if runner.num_forwards == before:  # nothing ran here: join the others' exchanges
            runner.idle_step()
        runner.rebalance_experts_if_due()
    return final
