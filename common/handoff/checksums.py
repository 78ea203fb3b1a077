"""KV blocks' checksums across the handoff: the prefill worker hashes each block it sends
(XXH3-64 over the block's bytes in its cache, while the transfer runs), the decode worker
hashes the same blocks where they landed in its own cache, and a block whose hashes differ is
never used (the pull fails, and the request goes on elsewhere). A block is one contiguous
region of the cache (`model_runner.py`'s layout), so a hash reads it in place.

Only caches in host memory are hashed: a GPU's blocks would have to be copied out first, and
its transports (`cuda_ipc`, RDMA) check their own transfers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.common.errors import PdserveError


class CorruptBlock(PdserveError):
    """A block's bytes differ between the sender's cache and where they landed."""

    def __init__(self, index: int, block_id: int) -> None:
        super().__init__(
            f"KV block {index} of the transfer (block {block_id} here) arrived corrupted: its "
            "checksum differs from the sender's"
        )
        self.index = index


def block_checksums(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """XXH3-64 of each block's bytes (empty where the cache is not in host memory)."""
    if kv_cache.device.type != "cpu":
        return []
    import xxhash

    return [xxhash.xxh3_64_intdigest(kv_cache[b].view(torch.uint8).numpy()) for b in block_ids]


def verify(kv_cache: torch.Tensor, block_ids: Sequence[int], expected: Sequence[int]) -> None:
    """Raise `CorruptBlock` for the first landed block whose hash is not the sender's (no
    check where the sender sent none)."""
    if not expected or kv_cache.device.type != "cpu":
        return
    if len(expected) != len(block_ids):
        raise CorruptBlock(min(len(expected), len(block_ids)), -1)
    for i, (got, want) in enumerate(zip(block_checksums(kv_cache, block_ids), expected,
                                        strict=True)):  # fmt: skip
        if got != want:
            raise CorruptBlock(i, block_ids[i])


def corrupt(kv_cache: torch.Tensor, block_id: int) -> None:
    """Flip one byte of a block (a fault test's corruption in transit)."""
    view = kv_cache[block_id].view(torch.uint8).view(-1)
    view[view.numel() // 2] ^= 0xFF
