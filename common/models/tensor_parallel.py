"""Tensor parallelism (Megatron-style): every layer's weights split over N ranks, all ranks
running every token of every step together.

Per decoder layer, rank r holds:
- attention: a contiguous range of KV heads and the query heads that read them. With at
  least N KV heads they are split as evenly as possible (N need not divide them: SmolLM2's
  3 KV heads over 2 ranks are 2 + 1, with 6 + 3 query heads); with fewer, each KV head is
  replicated on N/KVH ranks and its query heads split over them (as vLLM does). Its
  q/k/v rows (and biases) of those heads, and its KV cache holds only those KV heads;
- `o_proj`: the input columns of its query heads (row-parallel: one reduction);
- the MLP: a contiguous range of the intermediate rows of gate/up (column-parallel) and
  down_proj's columns of the same range (row-parallel: one reduction);
- the embedding and LM head: a contiguous range of the vocabulary. The embedding looks up
  its own rows (zeros elsewhere) and the ranks sum; the LM head's logits for each range are
  gathered. Both are exact: no number differs from one rank's full matrix.

The row-parallel reductions are deterministic and the same on every rank: each rank's
float32 partial sum is gathered and the N parts are added in rank order, then rounded once
to the activation dtype (an all-reduce's order depends on its algorithm and rank, and would
let ranks drift apart or a token depend on the collective's mood). A token's numbers thus
depend on N, not on its batch, its chunk or the host: tensor-parallel runs are compared
against the offline engine at the same N, and against transformers in float32.

The collectives are `torch.distributed`'s (gloo on CPU, NCCL on CUDA), over the group the
rank processes join (`expert_parallel.init_group`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pdserve.common.models.linear import Linear


@dataclass
class CollectiveBytes:
    """Bytes this rank put into the group's collectives (benchmarks read it): an
    all-gather sends its part to N-1 ranks; an all-reduce (ring) 2(N-1)/N of its tensor."""

    sent: int = 0

    def all_gather(self, part: Tensor, world_size: int) -> None:
        self.sent += part.numel() * part.element_size() * (world_size - 1)

    def all_reduce(self, x: Tensor, world_size: int) -> None:
        self.sent += x.numel() * x.element_size() * 2 * (world_size - 1) // world_size


COLLECTIVE_BYTES = CollectiveBytes()


@dataclass(frozen=True)
class TensorShard:
    """This rank's place in its tensor-parallel group."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None  # None: the default group
    # CPU ranks of one host: the shared-memory all-gather (`kernels/shm_collective.py`).
    shm: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"tensor_parallel: must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: must be in [0, {self.world_size}), got {self.rank}")

    def split(self, size: int) -> range:
        """This rank's contiguous part of `size` items split as evenly as possible (the
        first size % N ranks get one more)."""
        base, extra = divmod(size, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def kv_heads(self, num_kv_heads: int) -> range:
        """The KV heads this rank keeps: its part of them, or the one it replicates."""
        n = self.world_size
        if num_kv_heads >= n:
            return self.split(num_kv_heads)
        if n % num_kv_heads:
            raise ValueError(
                f"tensor_parallel: with fewer key/value heads ({num_kv_heads}) than ranks "
                f"({n}), the heads must divide the ranks (each is replicated on N/KVH ranks)"
            )
        head = self.rank * num_kv_heads // n
        return range(head, head + 1)

    def max_kv_heads(self, num_kv_heads: int) -> int:
        """The most KV heads any rank keeps (every rank's pool has as many blocks)."""
        return max(1, -(-num_kv_heads // self.world_size))

    def q_heads(self, num_heads: int, num_kv_heads: int) -> range:
        """The query heads this rank computes: those that read its KV heads (grouped-query
        attention: query head h reads KV head h // (H/KVH)); a replicated KV head's query
        heads are split over its replicas."""
        group = num_heads // num_kv_heads
        kv = self.kv_heads(num_kv_heads)
        if num_kv_heads >= self.world_size:
            return range(kv.start * group, kv.stop * group)
        replicas = self.world_size // num_kv_heads
        if group % replicas:
            raise ValueError(
                f"tensor_parallel: each key/value head's {group} query heads must split "
                f"over its {replicas} replicas"
            )
        per = group // replicas
        start = kv.start * group + (self.rank % replicas) * per
        return range(start, start + per)

    def vocab_width(self, vocab_size: int) -> int:
        """Rows of the vocabulary per rank: ceil(V/N) (the last rank's range may be short;
        its LM head is padded with zero rows to this width)."""
        return -(-vocab_size // self.world_size)

    def vocab_range(self, vocab_size: int) -> range:
        """This rank's rows of the embedding and LM head."""
        per = self.vocab_width(vocab_size)
        start = min(vocab_size, self.rank * per)
        return range(start, min(vocab_size, start + per))


def check_model(config, family_name: str, moe: bool, qk_norm: str, world_size: int) -> None:
    """Raise ValueError, naming the numbers, if `world_size` ranks cannot split this model
    (checked for every rank before any process starts). A mixture of experts splits its
    experts over the ranks too (`moe.SparseMoeBlock`); at least one each."""
    if world_size == 1:
        return
    if qk_norm == "whole":
        raise ValueError(
            f"tensor_parallel: {family_name} normalises q and k over all heads at once; "
            "not supported with tensor parallelism"
        )
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    if moe and experts < world_size:
        raise ValueError(
            f"tensor_parallel: {family_name}'s {experts} experts cannot give each of "
            f"{world_size} ranks one"
        )
    for rank in range(world_size):
        TensorShard(rank, world_size).q_heads(heads, kv_heads)


def head_rows(heads: range, head_dim: int) -> Tensor:
    """The weight rows (or bias entries) of `heads` in a [heads·head_dim, ...] projection."""
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def all_gather(part: Tensor, shard: TensorShard) -> list[Tensor]:
    """Every rank's `part`, in rank order (through shared memory when it fits; use the
    parts before the next collective)."""
    COLLECTIVE_BYTES.all_gather(part, shard.world_size)
    if shard.shm is not None and shard.shm.fits(part):
        return shard.shm.all_gather(part)
    parts = [torch.empty_like(part) for _ in range(shard.world_size)]
    dist.all_gather(parts, part.contiguous(), group=shard.group)
    return parts


def sum_in_rank_order(parts: list[Tensor]) -> Tensor:
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def sum_exact(x: Tensor, shard: TensorShard) -> Tensor:
    """The sum over ranks where at most one rank holds a nonzero at each place (the
    vocabulary-parallel embedding): exact in any order, so one all-reduce (or, through
    shared memory, the gathered parts added)."""
    if shard.shm is not None and shard.shm.fits(x):
        return sum_in_rank_order(all_gather(x, shard))
    dist.all_reduce(x, group=shard.group)
    COLLECTIVE_BYTES.all_reduce(x, shard.world_size)
    return x


def gather_vocab(local: Tensor, shard: TensorShard, vocab_size: int) -> Tensor:
    """Every rank's logits [rows, vocab_width] → [rows, vocab_size], in vocabulary order."""
    return torch.cat(all_gather(local, shard), dim=1)[:, :vocab_size]


class RowParallel:
    """A linear layer whose input features are split over the ranks (`o_proj`, the MLP's
    down projection): each rank multiplies its columns, the float32 partial sums are added
    in rank order, the bias once, then one rounding."""

    def __init__(self, weight: Tensor, bias: Tensor | None, shard: TensorShard) -> None:
        self.linear = Linear(weight, float32_out=True)
        self.bias = None if bias is None else bias.float()
        self.shard = shard
        self.dtype = weight.dtype

    def __call__(self, x: Tensor) -> Tensor:
        partial = self.linear(x).float()
        total = sum_in_rank_order(all_gather(partial, self.shard))
        if self.bias is not None:
            total = total + self.bias
        return total.to(self.dtype)
