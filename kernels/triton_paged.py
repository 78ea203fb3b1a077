"""Triton attention over the paged KV cache: the cuda default (batch-invariant).

The model runner calls `decode_attention` and `prefill_attention` (through
`pdserve.kernels.attention`) for every layer of every step; on cuda they land here when
triton is installed (``PDSERVE_ATTENTION_BACKEND=triton`` forces it, e.g. on CPU tensors
under ``TRITON_INTERPRET=1``). One program per (query row, kv head) loads the G query heads
of that kv head once and walks the row's blocks straight from the cache with an online
float32 softmax, so nothing is gathered. A prefill chunk runs as one such query row per
token, each over its own causal context: a token's output is then computed by exactly the
same program whether it is a decode step or a row of any chunk, next to any batch (the
determinism contract, docs/engine.md). `write_kv` is the torch backend's. Checked with the
Triton interpreter (on CPU tensors) and, when one is lent, on a GPU (benchmarks/gpu_check).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdserve.kernels.torch_paged import write_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend is then unavailable; nothing else depends on it
    triton = None

__all__ = ["AVAILABLE", "decode_attention", "prefill_attention", "write_kv"]
AVAILABLE = triton is not None

if triton is not None:

    @triton.jit
    def _decode_kernel(
        q_ptr,
        kv_ptr,
        tables_ptr,
        lens_ptr,
        out_ptr,
        scale,
        q_stride_b,
        q_stride_h,
        kv_stride_block,
        kv_stride_token,
        kv_stride_head,
        value_offset,
        layer_offset,
        table_stride,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(lens_ptr + seq)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, BLOCK_T)
        heads = kv_head * GROUP + g
        qd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q_offsets = seq * q_stride_b + heads[:, None] * q_stride_h + d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=qd_mask, other=0.0).to(tl.float32)

        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for blk in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
            block_id = tl.load(tables_ptr + seq * table_stride + blk).to(tl.int64)
            valid = (t < BLOCK_SIZE) & (blk * BLOCK_SIZE + t < seq_len)
            rows = block_id * kv_stride_block + layer_offset + kv_head * kv_stride_head
            offsets = rows + t[:, None] * kv_stride_token + d[None, :]
            td_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(kv_ptr + offsets, mask=td_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_T]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            v = tl.load(kv_ptr + value_offset + offsets, mask=td_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new

        out = acc / denom[:, None]
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=qd_mask)


def decode_attention(
    query: Tensor,
    kv_cache: Tensor,
    layer: int,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """query [B, H, D] at position seq_lens[b]-1, attending straight from the blocks."""
    if triton is None:
        raise RuntimeError("the triton attention backend needs the triton package")
    batch, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[4]
    block_size = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    query = query.contiguous()
    out = torch.empty_like(query)
    tables = block_tables.to(device=query.device, dtype=torch.int32).contiguous()
    lens = seq_lens.to(device=query.device, dtype=torch.int32).contiguous()
    strides = kv_cache.stride()
    _decode_kernel[(batch, num_kv_heads)](
        query,
        kv_cache,
        tables,
        lens,
        out,
        scale,
        query.stride(0),
        query.stride(1),
        strides[0],
        strides[3],
        strides[4],
        strides[2],
        layer * strides[1],
        tables.stride(0),
        GROUP=group,
        BLOCK_G=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_T=triton.next_power_of_2(block_size),
    )
    return out


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
) -> Tensor:
    """Causal chunks as decode rows: row i of sequence s (the last q_len of seq_lens[s]
    positions, K/V already written) attends over its first seq_lens[s] - q_len + i + 1."""
    del key, value  # read from the cache, like decode
    device = query.device
    starts = torch.tensor(query_start_loc, dtype=torch.long)
    q_lens = starts[1:] - starts[:-1]
    seqs = torch.repeat_interleave(torch.arange(len(seq_lens)), q_lens)
    first = torch.tensor(seq_lens, dtype=torch.long) - q_lens  # each chunk's first position
    rows = torch.arange(int(starts[-1])) - starts[:-1][seqs]
    lens = (first[seqs] + rows + 1).to(device=device, dtype=torch.int32)
    tables = block_tables.to(device=device)[seqs.to(device)]
    return decode_attention(query, kv_cache, layer, tables, lens, scale)
