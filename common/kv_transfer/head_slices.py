"""KV transfer between tensor-parallel groups of different sizes: which rank sends which
KV heads to which rank, and the copies at both ends.

Rank r of a group of N keeps the KV heads `TensorShard(r, N).kv_heads(KVH)`, so its block
i holds [layers, 2, block_size, its heads, head_dim] of the prompt's block i. For a prefill
group of P ranks and a decode group of D, `plan` lists the slices: for each decode rank, its
heads in runs that one prefill rank holds (a replicated head is taken from the replica that
spreads the load). Each slice is one message: the sender copies those heads of the blocks
into one contiguous buffer (`pack`), the receiver copies its buffer into the same heads of
its own blocks (`unpack`). No rank receives a head it does not keep, none sends a head twice
to one rank, and no rank gathers another's share. With P = D = 1 there is nothing to slice:
whole blocks travel (`KvTransport.send`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.common.models.tensor_parallel import TensorShard


@dataclass(frozen=True)
class HeadSlice:
    index: int  # its place in the plan: sent under tag | index
    src_rank: int
    dst_rank: int
    heads: range  # the model's KV heads it carries
    src_first: int  # where they start among the sending rank's heads
    dst_first: int  # where they start among the receiving rank's heads


def plan(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadSlice]:
    """Every slice from a group of `src_tp` ranks to one of `dst_tp` (any pair the model
    splits into: `TensorShard.kv_heads`)."""
    src = [TensorShard(r, src_tp).kv_heads(num_kv_heads) for r in range(src_tp)]
    slices: list[HeadSlice] = []
    for d in range(dst_tp):
        mine = TensorShard(d, dst_tp).kv_heads(num_kv_heads)
        head = mine.start
        while head < mine.stop:
            holders = [r for r, heads in enumerate(src) if head in heads]
            s = holders[d % len(holders)]
            stop = min(mine.stop, src[s].stop)
            slices.append(
                HeadSlice(len(slices), s, d, range(head, stop), head - src[s].start,
                          head - mine.start)
            )  # fmt: skip
            head = stop
    return slices


def pack(kv_cache: Tensor, block_ids: list[int], s: HeadSlice) -> Tensor:
    """The slice's heads of these blocks, as one contiguous [n, layers, 2, block, heads,
    head_dim] buffer (a copy: the blocks may change once it is made)."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    heads = slice(s.src_first, s.src_first + len(s.heads))
    return kv_cache.index_select(0, index)[:, :, :, :, heads].contiguous()


def empty_buffer(kv_cache: Tensor, num_blocks: int, s: HeadSlice) -> Tensor:
    """Where the receiving rank takes the slice in."""
    shape = (num_blocks, *kv_cache.shape[1:4], len(s.heads), kv_cache.shape[5])
    return torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)


def unpack(kv_cache: Tensor, block_ids: list[int], s: HeadSlice, buffer: Tensor) -> None:
    """Copy a received slice into its heads of these blocks."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    heads = slice(s.dst_first, s.dst_first + len(s.heads))
    kv_cache[:, :, :, :, heads].index_copy_(0, index, buffer)
