"""Prefix-cache block hashes, shared by every process of a deployment.

A full block's hash chains its parent block's hash with the block's token ids, so equal
hashes mean equal prefixes. The hash is SHA-256 over fixed-width little-endian integers with a
fixed root, never Python's salted `hash()`: the coordinator computes the same hashes from a
tokenized prompt to route it to the worker that already caches its prefix."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

HASH_VERSION = b"pdserve.kv-block-hash.v1"
ROOT_HASH = int.from_bytes(hashlib.sha256(HASH_VERSION).digest()[:8], "little")


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block: 64 bits of SHA-256(parent hash ‖ token ids as int64 LE)."""
    digest = hashlib.sha256(parent_hash.to_bytes(8, "little"))
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return int.from_bytes(digest.digest()[:8], "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, start: int = 0, parent_hash: int = ROOT_HASH
) -> list[int]:
    """Hashes of the full blocks of `token_ids`, beginning at block index `start`, whose
    parent (the block before `start`) hashes to `parent_hash`."""
    return _extend(list(token_ids), block_size, start, parent_hash)


def _extend(token_ids: list[int], block_size: int, start: int, parent: int) -> list[int]:
    hashes = []
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[begin : begin + block_size])
        hashes.append(parent)
    return hashes
