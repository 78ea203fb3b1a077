"""Tensor parallelism's control path: rank 0 schedules, and hands each step's inputs to the
other ranks, which run the same forward on their shard of the weights and their share of
the KV heads (`ModelRunner.follow`).

A step is two broadcasts from rank 0: a fixed header (what follows and how long each part
is), then one int64 tensor with the token ids, positions, KV slots, block tables, sequence
lengths and the rows that sample. Block ids are rank 0's: every rank's cache has the same
blocks, each holding that rank's heads, so the KV manager lives on rank 0 alone. Between
steps rank 0 sends a keep-alive at least every `KEEPALIVE_S`, so an idle group's waiting
ranks never reach the collective timeout; `STOP` ends them. A `COMMAND` is any other work
for the ranks, in order with the steps (tensor parallelism's KV transfers,
`common/handoff/slices.py`): one picklable object to every rank, then an all-reduce of each rank's
status (0: done), so rank 0 learns whether all of them managed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pdserve.common.models.attention import AttentionMetadata
from pdserve.common.models.tensor_parallel import TensorShard

logger = logging.getLogger(__name__)

STEP, KEEPALIVE, STOP, COMMAND = 0, 1, 2, 3
KEEPALIVE_S = 10.0
_HEADER = 8


@dataclass
class StepInputs:
    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    meta: AttentionMetadata
    sample_idx: Tensor  # [S] int64: the rows whose logits are computed


class StepSender:
    """Rank 0's side: `send` every step, `keepalive` from the engine's idle housekeeping,
    `stop` once."""

    def __init__(self, shard: TensorShard, device: torch.device) -> None:
        self.shard = shard
        self.device = device
        self.last_sent = time.monotonic()

    def send(self, step: StepInputs) -> None:
        meta = step.meta
        decode_tables = meta.decode_block_tables
        prefill_tables = meta.prefill_block_tables
        header = [
            STEP,
            step.input_ids.shape[0],
            meta.num_decode_tokens,
            decode_tables.shape[1],
            len(meta.prefill_seq_lens),
            prefill_tables.shape[1],
            step.sample_idx.shape[0],
            0,
        ]
        lists = torch.tensor(
            meta.prefill_query_start_loc + meta.prefill_seq_lens, dtype=torch.int64
        ).to(self.device)
        payload = torch.cat(
            [
                step.input_ids,
                step.positions,
                meta.slot_mapping,
                decode_tables.reshape(-1).long(),
                meta.decode_seq_lens.long(),
                lists,
                prefill_tables.reshape(-1).long(),
                step.sample_idx,
            ]
        )
        self._broadcast_header(header)
        dist.broadcast(payload, 0, group=self.shard.group)

    def keepalive(self) -> None:
        if time.monotonic() - self.last_sent >= KEEPALIVE_S:
            self._broadcast_header([KEEPALIVE] + [0] * (_HEADER - 1))

    def stop(self) -> None:
        self._broadcast_header([STOP] + [0] * (_HEADER - 1))

    def command(self, obj: Any) -> int:
        """Hand `obj` to every other rank's command handler; the worst status any of them
        returned (0: all done)."""
        self._broadcast_header([COMMAND] + [0] * (_HEADER - 1))
        dist.broadcast_object_list([obj], 0, group=self.shard.group)
        return _worst_status(0, self.shard, self.device)

    def _broadcast_header(self, values: list[int]) -> None:
        header = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(header, 0, group=self.shard.group)
        self.last_sent = time.monotonic()


def _worst_status(status: int, shard: TensorShard, device: torch.device) -> int:
    flag = torch.tensor([status], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shard.group)
    return int(flag.item())


CommandHandler = Callable[[Any], int]


def _no_commands(obj: Any) -> int:
    return 1  # a rank without a handler cannot do the work: rank 0 learns it failed


def receive_step(
    shard: TensorShard, device: torch.device, on_command: CommandHandler = _no_commands
) -> StepInputs | None:
    """Ranks 1..N-1: the next step's inputs, or None once rank 0 stops. Commands that come
    first are run here (`on_command`, its status reported to rank 0)."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    while True:
        dist.broadcast(header, 0, group=shard.group)
        kind, tokens, nd, decode_width, prefills, prefill_width, samples, _ = header.tolist()
        if kind == STOP:
            return None
        if kind == STEP:
            break
        if kind == COMMAND:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, 0, group=shard.group)
            try:
                status = on_command(box[0])
            except Exception:
                logger.exception("tensor-parallel command failed")
                status = 1
            _worst_status(status, shard, device)
    sizes = [
        tokens,
        tokens,
        tokens,
        nd * decode_width,
        nd,
        2 * prefills + 1,
        prefills * prefill_width,
        samples,
    ]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(payload, 0, group=shard.group)
    ids, pos, slots, dtab, dlens, lists, ptab, sample = payload.split(sizes)
    starts_and_lens = lists.tolist()
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=nd,
        decode_block_tables=dtab.view(nd, decode_width).int(),
        decode_seq_lens=dlens.int(),
        prefill_query_start_loc=starts_and_lens[: prefills + 1],
        prefill_seq_lens=starts_and_lens[prefills + 1 :],
        prefill_block_tables=ptab.view(prefills, prefill_width).int(),
    )
    return StepInputs(ids, pos, meta, sample)
