"""Paged attention in plain vectorised torch: the portable backend (cpu and cuda).

The model runner calls `write_kv`, `decode_attention` and `prefill_attention` (through
`pdserve.kernels.attention`) for every layer of every step. This backend serves cuda tensors
and cpu ones when the C++ extension is unavailable: `write_kv` is one `index_put_` per tensor,
decode gathers every sequence's context out of the blocks into a padded batch and runs masked
`scaled_dot_product_attention`, prefill runs it per sequence (causal when the chunk is the
whole context, with a bottom-right-aligned causal mask over the gathered context otherwise).
A sliding-window layer (`window` > 0) masks each query's keys to the last `window` positions
of its context, in decode and prefill alike.
Query heads are grouped by kv head instead of repeating K/V, so GQA costs no extra copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def write_kv(
    kv_cache: Tensor, layer: int, key: Tensor, value: Tensor, slot_mapping: Tensor
) -> None:
    """Store token t's key/value [T, KVH, D] at slot ``slot_mapping[t]`` of `layer`."""
    block_size = kv_cache.shape[3]
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.long)
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    layer_cache = kv_cache[:, layer]  # [num_blocks, 2, block_size, KVH, D], a view
    layer_cache[:, 0].index_put_((blocks, offsets), key)
    layer_cache[:, 1].index_put_((blocks, offsets), value)


def _token_rows(kv_cache: Tensor, layer: int, blocks: Tensor, offsets: Tensor) -> Tensor:
    """Row numbers of (block, offset) positions' keys in ``kv_cache.view(-1, KVH, D)``.

    The row of the matching value is this plus block_size.
    """
    _, num_layers, _, block_size, _, _ = kv_cache.shape
    return (blocks * num_layers + layer) * (2 * block_size) + offsets


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """q [Tq, H, D], k/v [Tk, KVH, D], mask [Tq, Tk] (True = attend) or None for causal
    with Tq == Tk. Returns [Tq, H, D]."""
    tq, num_heads, head_dim = q.shape
    tk, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # Query heads of one kv head share its K/V through a stride-0 expand: no copy.
    qg = q.reshape(tq, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kg = k.transpose(0, 1).unsqueeze(1).expand(num_kv_heads, group, tk, head_dim)
    vg = v.transpose(0, 1).unsqueeze(1).expand(num_kv_heads, group, tk, head_dim)
    out = F.scaled_dot_product_attention(
        qg, kg, vg, attn_mask=mask, is_causal=mask is None, scale=scale
    )
    return out.permute(2, 0, 1, 3).reshape(tq, num_heads, head_dim)


def decode_attention(
    query: Tensor,
    kv_cache: Tensor,
    layer: int,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int = 0,
) -> Tensor:
    """query [B, H, D] at position seq_lens[b]-1 over positions [0, seq_lens[b]) (the last
    `window` of them when `window` > 0); [B, H, D]."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[4], kv_cache.shape[3]
    lens = seq_lens.to(device=query.device, dtype=torch.long)
    max_len = int(lens.max())
    pos = torch.arange(max_len, device=query.device)
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [B, max_len]
    if window > 0:
        valid &= pos.unsqueeze(0) >= lens.unsqueeze(1) - window
    # Padding positions read the sequence's own last token (always written, so finite):
    # stale or never-written slots could hold NaN, which a mask alone would not cancel.
    pos = torch.where(valid, pos.unsqueeze(0), lens.unsqueeze(1) - 1)
    tables = block_tables.to(device=query.device, dtype=torch.long)
    blocks = torch.gather(tables, 1, torch.div(pos, block_size, rounding_mode="floor"))
    rows = _token_rows(kv_cache, layer, blocks, pos % block_size)
    flat = kv_cache.view(-1, num_kv_heads, head_dim)
    k = flat[rows]  # [B, max_len, KVH, D]
    v = flat[rows + block_size]
    # The G query heads of a kv head become G query rows at the same position.
    group = num_heads // num_kv_heads
    qg = query.reshape(batch, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(
        qg,
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=valid.view(batch, 1, 1, max_len),
        scale=scale,
    )
    return out.reshape(batch, num_heads, head_dim)


def gather_context(
    kv_cache: Tensor, layer: int, block_table: Tensor, length: int
) -> tuple[Tensor, Tensor]:
    """Positions [0, length) of one sequence as k, v [length, KVH, D] (whole-block copies)."""
    block_size = kv_cache.shape[3]
    num_blocks = -(-length // block_size)
    blocks = block_table[:num_blocks].to(device=kv_cache.device, dtype=torch.long)
    ctx = kv_cache[blocks, layer]  # [num_blocks, 2, block_size, KVH, D]
    k = ctx[:, 0].reshape(num_blocks * block_size, *ctx.shape[-2:])[:length]
    v = ctx[:, 1].reshape(num_blocks * block_size, *ctx.shape[-2:])[:length]
    return k, v


def prefill_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    layer: int,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: Tensor,
    scale: float,
    window: int = 0,
) -> Tensor:
    """Causal attention of each chunk (the last q_len of seq_lens[s] positions), each query
    over the last `window` positions of its context when `window` > 0; [T, H, D]."""
    out = torch.empty_like(query)
    for s, length in enumerate(seq_lens):
        start, end = query_start_loc[s], query_start_loc[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if length == q_len:
            k, v = key[start:end], value[start:end]
            mask = None
        else:
            k, v = gather_context(kv_cache, layer, block_tables[s], length)
        if length != q_len or window > 0:
            qpos = torch.arange(length - q_len, length, device=query.device).unsqueeze(1)
            kpos = torch.arange(length, device=query.device).unsqueeze(0)
            mask = kpos <= qpos
            if window > 0:
                mask &= kpos > qpos - window
        out[start:end] = _attend(query[start:end], k, v, mask, scale)
    return out
