"""One attention layer over the paged KV cache, and the per-step metadata it needs.

The model runner builds one `AttentionMetadata` per step; every layer of the model calls
`paged_attention` with it: the new tokens' K/V go into their cache slots, then decode tokens
attend straight from the blocks and prefill chunks over their cached prefix plus themselves.
Tokens of requests advancing by one (decodes) come first in the batch, then prefill chunks.
A sliding-window layer passes its `window`: each query then attends to the last `window`
positions of its context only."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import attention as kernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V goes in the cache
    num_decode_tokens: int  # the first this many tokens are one-token decodes
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, context incl. the new token
    prefill_query_start_loc: list[int]  # [num_prefills + 1], offsets into the prefill part
    prefill_seq_lens: list[int]  # context incl. the chunk, per prefill
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] → attention output [T, H, D]; `window` > 0 masks each
    query to the last `window` positions of its context (0: full causal attention)."""
    kernels.write_kv(kv_cache, layer, k, v, meta.slot_mapping)
    nd = meta.num_decode_tokens
    if nd == q.shape[0]:
        return kernels.decode_attention(
            q, kv_cache, layer, meta.decode_block_tables, meta.decode_seq_lens, scale, window
        )
    prefill = kernels.prefill_attention(
        q[nd:], k[nd:], v[nd:], kv_cache, layer,
        meta.prefill_query_start_loc, meta.prefill_seq_lens, meta.prefill_block_tables, scale,
        window,
    )  # fmt: skip
    if nd == 0:
        return prefill
    decode = kernels.decode_attention(
        q[:nd], kv_cache, layer, meta.decode_block_tables, meta.decode_seq_lens, scale, window
    )
    return torch.cat([decode, prefill])
