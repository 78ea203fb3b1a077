"""Triton attention over the paged KV cache: the cuda default (batch-invariant).

The model runner calls `decode_attention` and `prefill_attention` (through
`pdserve.kernels.attention`) for every layer of every step; on cuda they land here when
triton is installed (``PDSERVE_ATTENTION_BACKEND=triton`` forces it, e.g. on CPU tensors
under ``TRITON_INTERPRET=1``). Both run one kernel, flash-attention style: a program takes a
tile of query rows of one sequence and one kv head (`TILE_ROWS` rows, or the next power of
two above the group: whole tokens, each with the `group` query heads of that kv head), walks
the sequence's keys up to `KEY_TILE` at a time (fewer for wide float32 heads) straight from
the cache blocks (gathered through the block table, so nothing is copied), and keeps an
online float32 softmax; both products are `tl.dot`s (tensor cores for bf16 and fp16 caches,
exact float32 FMAs for float32 ones).

A decode step is a tile holding one token; a prefill chunk is cut into tiles of
consecutive tokens. Each row is masked to its own causal context, and the key tiles a row
does not reach leave its running max, sum and accumulator exactly as they were (a factor
of exactly 1, a sum of exact zeros), so a token's output has the same bits whether it was
decoded or sat at any row of any chunk, next to any batch (the determinism contract,
docs/engine.md). That holds because the tile shape is the same for every call: it depends
on the model's head layout alone, never on the batch or the chunk. It assumes finite K/V: a
row multiplies the V of later tokens in its tile by an exact zero, which an inf or NaN there
(a model that already overflowed) would turn into NaN.

A sliding-window layer (`window` > 0) masks each row to the last `window` positions of its
context and starts the walk at the key tile holding the tile's first row's first key (tiles
sit at multiples of the key tile, so decode and prefill walk the same ones); a key tile a
row does not reach yet leaves its state exactly as it was (the running max stays -inf and
adds nothing), so the same bits hold for windowed rows. `write_kv` is the torch
backend's. Checked with the Triton interpreter (on CPU tensors) and, when one is lent, on a
GPU (benchmarks/gpu_check).
"""

from __future__ import annotations

import functools

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

# The tile: query rows per program and keys per step of the walk. Fixed for every call,
# whatever the batch or chunk: a row's bits depend on them (benchmarks/gpu_attention_tiles.py
# measures the candidates on a GPU).
TILE_ROWS = 64
KEY_TILE = 64
NUM_WARPS = 4  # twice that for heads wider than 128
KEY_TILE_BYTES = 16384  # at most this much of K (and of V) per step: wide float32 heads
# walk fewer keys at a time, so the pipelined K/V buffers fit in shared memory.

if triton is not None:
    from pdserve.kernels.triton_invariant import INTERPRETED, invariant_dot

    # Neither the decode flag nor the block tables' width (it differs between decode, CUDA
    # graphs and prefill) is specialised on: decode and prefill run one compiled kernel.
    @triton.jit(do_not_specialize=["decode", "table_stride", "window"])
    def _attention_kernel(
        q_ptr,
        kv_ptr,
        tables_ptr,
        lens_ptr,
        tile_seq_ptr,
        tile_start_ptr,
        tile_tokens_ptr,
        out_ptr,
        decode,
        scale,
        q_stride_t,
        q_stride_h,
        kv_stride_block,
        kv_stride_token,
        kv_stride_head,
        value_offset,
        layer_offset,
        table_stride,
        window,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        # decode (a runtime flag: one compiled kernel serves both): tile b is sequence b's
        # one token, at row b; else the tile arrays say which sequence, rows and tokens.
        if decode != 0:
            seq = tile
            start = tile
            tokens = tile * 0 + 1
        else:
            seq = tl.load(tile_seq_ptr + tile)
            start = tl.load(tile_start_ptr + tile)
            tokens = tl.load(tile_tokens_ptr + tile)
        last_len = tl.load(lens_ptr + tile)  # context of the tile's last token
        r = tl.arange(0, BLOCK_M)
        token = r // GROUP
        real = token < tokens
        # Padding rows attend to key 0 only: finite, never stored.
        row_len = tl.where(real, last_len - tokens + 1 + token, 1)
        # Sliding window: a row's first key; the walk starts at the first row's key tile.
        row_lo = tl.where(window > 0, row_len - window, 0)
        first_lo = tl.maximum(tl.where(window > 0, last_len - tokens + 1 - window, 0), 0)
        key_begin = (first_lo // BLOCK_N) * BLOCK_N
        d = tl.arange(0, BLOCK_D)
        q_offsets = (start + token).to(tl.int64)[:, None] * q_stride_t
        q_offsets += (kv_head * GROUP + r % GROUP)[:, None] * q_stride_h + d[None, :]
        q_mask = real[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(kv_ptr.dtype.element_ty)

        n = tl.arange(0, BLOCK_N)
        head_offset = layer_offset + kv_head * kv_stride_head
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for key_start in range(key_begin, last_len, BLOCK_N):
            pos = key_start + n
            loaded = pos < last_len
            block = tl.load(tables_ptr + seq * table_stride + pos // BLOCK_SIZE, mask=loaded)
            rows = block.to(tl.int64) * kv_stride_block + (pos % BLOCK_SIZE) * kv_stride_token
            offsets = head_offset + rows[:, None] + d[None, :]
            kd_mask = loaded[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(kv_ptr + offsets, mask=kd_mask, other=0.0)
            s = invariant_dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32),
                              IEEE, INTERPRETED)  # fmt: skip
            reach = (pos[None, :] < row_len[:, None]) & (pos[None, :] >= row_lo[:, None])
            s = tl.where(reach, s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # A row with no key in reach yet: exp(-inf) = 0 keeps its zeros (not a NaN).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            v = tl.load(kv_ptr + value_offset + offsets, mask=kd_mask, other=0.0)
            # p rounded to V's dtype for the tensor cores, as flash attention does.
            acc = invariant_dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, INTERPRETED)
            m = m_new

        # (Padding rows of a windowed tile may reach no key: 0 / 1, never stored.)
        out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _tile_shape(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(group, rows per tile) for the model's head layout; never for a batch or a chunk."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    return group, max(TILE_ROWS, triton.next_power_of_2(group))


def _key_tile(block_d: int, element_size: int) -> int:
    """Keys per step of the walk, for the model's head width and cache dtype."""
    return max(16, min(KEY_TILE, KEY_TILE_BYTES // (block_d * element_size)))


def _launch(
    query: Tensor,
    kv_cache: Tensor,
    layer: int,
    tables: Tensor,
    lens: Tensor,
    tiles: tuple[Tensor, Tensor, Tensor] | None,
    scale: float,
    window: int = 0,
) -> Tensor:
    """Runs the kernel over `lens.numel()` tiles: decode tiles when `tiles` is None, else
    (sequence, first row, tokens) per tile; `lens` is each tile's last token's context."""
    if triton is None:
        raise RuntimeError("the triton attention backend needs the triton package")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[4], kv_cache.shape[3]
    group, block_m = _tile_shape(num_heads, num_kv_heads)
    query = query.contiguous()
    out = torch.empty_like(query)
    if tiles is None:
        seqs = starts = tokens = lens  # unread: the kernel's decode branch
    else:
        seqs, starts, tokens = tiles
    block_d = max(16, triton.next_power_of_2(head_dim))
    strides = kv_cache.stride()
    _attention_kernel[(lens.numel(), num_kv_heads)](
        query,
        kv_cache,
        tables,
        lens,
        seqs,
        starts,
        tokens,
        out,
        1 if tiles is None else 0,
        scale,
        query.stride(0),
        query.stride(1),
        strides[0],
        strides[3],
        strides[4],
        strides[2],
        layer * strides[1],
        tables.stride(0),
        window,
        GROUP=group,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=_key_tile(block_d, kv_cache.element_size()),
        IEEE=kv_cache.dtype == torch.float32,
        INTERPRETED=INTERPRETED,
        num_warps=NUM_WARPS * (2 if head_dim > 128 else 1),
    )
    return out


def decode_attention(
    query: Tensor,
    kv_cache: Tensor,
    layer: int,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int = 0,
) -> Tensor:
    """query [B, H, D] at position seq_lens[b]-1, attending straight from the blocks (to the
    last `window` positions when `window` > 0)."""
    device = query.device
    tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    lens = seq_lens.to(device=device, dtype=torch.int32).contiguous()
    return _launch(query, kv_cache, layer, tables, lens, None, scale, window)


def prefill_tiles(
    query_start_loc: list[int], seq_lens: list[int], tokens_per_tile: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each chunk cut into tiles of `tokens_per_tile` consecutive tokens (the last one
    shorter): per tile its sequence, first row, tokens and last token's context length."""
    starts = torch.tensor(query_start_loc, dtype=torch.int32)
    q_lens = starts[1:] - starts[:-1]
    per_seq = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    seq = torch.repeat_interleave(torch.arange(len(seq_lens), dtype=torch.int32), per_seq)
    first_tile = torch.cumsum(per_seq, 0) - per_seq
    index = torch.arange(seq.numel(), dtype=torch.int32) - first_tile[seq]
    offset = index * tokens_per_tile  # of the tile's first token in its chunk
    tokens = torch.minimum(q_lens[seq] - offset, torch.tensor(tokens_per_tile))
    context_before = torch.tensor(seq_lens, dtype=torch.int32) - q_lens
    lens = context_before[seq] + offset + tokens
    tiles = (seq, starts[:-1][seq] + offset, tokens, lens)
    return tuple(t.to(torch.int32) for t in tiles)  # type: ignore[return-value]


@functools.lru_cache(maxsize=1)
def _device_tiles(
    query_start_loc: tuple[int, ...],
    seq_lens: tuple[int, ...],
    tokens_per_tile: int,
    device: torch.device,
) -> tuple[Tensor, ...]:
    """`prefill_tiles` on the device, built and copied once per step (every layer of a
    step asks for the same tiles)."""
    stacked = torch.stack(prefill_tiles(list(query_start_loc), list(seq_lens), tokens_per_tile))
    return tuple(stacked.to(device).unbind())


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
    """Causal chunks by tiles of the decode program's shape: row i of sequence s (the last
    q_len of seq_lens[s] positions, K/V already written) attends over its first
    seq_lens[s] - q_len + i + 1 (the last `window` of them when `window` > 0)."""
    del key, value  # read from the cache, like decode
    group, block_m = _tile_shape(query.shape[1], kv_cache.shape[4])
    seq, starts, tokens, lens = _device_tiles(
        tuple(query_start_loc), tuple(seq_lens), block_m // group, query.device
    )
    tables = block_tables.to(device=query.device, dtype=torch.int32).contiguous()
    return _launch(query, kv_cache, layer, tables, lens, (seq, starts, tokens), scale, window)
