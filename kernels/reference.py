"""Reference attention over the paged KV cache: slow, plain and obviously correct.

The model runner calls `write_kv`, `decode_attention` and `prefill_attention` (through
`pdserve.kernels.attention`) for every layer of every step; this module implements them the
simplest possible way, one token and one sequence at a time, in float32 with an explicit
causal (and, for a sliding-window layer, window) mask. It is never the default backend: it
is the yardstick the fast backends are tested against (together with `dense_attention`, the
naive dense oracle), and it can be forced with ``PDSERVE_ATTENTION_BACKEND=reference`` to
rule the kernels out when debugging.

`moe_experts` plays the same part for the routed experts of a mixture-of-experts layer
(`pdserve.kernels.moe`): one token and one chosen expert at a time, in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal_offset: int,
    scale: float | None = None,
    window: int = 0,
) -> Tensor:
    """Naive dense GQA attention in float64, returned as float32.

    q [Tq, H, D], k/v [Tk, KVH, D]; query row i sits at position ``p = i + causal_offset`` and
    attends to key positions ``j <= p`` (and ``j > p - window`` when `window` > 0: a
    sliding-window layer). Query head h reads kv head ``h // (H // KVH)``. `scale` defaults
    to ``1 / sqrt(D)``.
    """
    tq, num_heads, head_dim = q.shape
    tk, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    qd = q.double().permute(1, 0, 2)  # [H, Tq, D]
    kd = k.double().repeat_interleave(group, dim=1).permute(1, 0, 2)  # [H, Tk, D]
    vd = v.double().repeat_interleave(group, dim=1).permute(1, 0, 2)
    scores = torch.matmul(qd, kd.transpose(1, 2)) * scale  # [H, Tq, Tk]
    qpos = torch.arange(tq).unsqueeze(1) + causal_offset
    kpos = torch.arange(tk).unsqueeze(0)
    scores = scores.masked_fill(_masked(qpos, kpos, window), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vd).permute(1, 0, 2).float()


def _masked(qpos: Tensor, kpos: Tensor, window: int) -> Tensor:
    """True where key position kpos is out of query position qpos's reach."""
    out = kpos > qpos
    return out | (kpos <= qpos - window) if window > 0 else out


def write_kv(
    kv_cache: Tensor, layer: int, key: Tensor, value: Tensor, slot_mapping: Tensor
) -> None:
    """Store token t's key/value [T, KVH, D] at slot ``slot_mapping[t]``, one token at a time."""
    block_size = kv_cache.shape[3]
    for t, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        kv_cache[block, layer, 0, offset] = key[t]
        kv_cache[block, layer, 1, offset] = value[t]


def gather_kv(
    kv_cache: Tensor, layer: int, block_table: Tensor, length: int
) -> tuple[Tensor, Tensor]:
    """Copy positions [0, length) of one sequence out of the blocks, token by token.

    Returns k, v as float32 [length, KVH, D].
    """
    block_size = kv_cache.shape[3]
    table = block_table.tolist()
    keys, values = [], []
    for pos in range(length):
        block = table[pos // block_size]
        keys.append(kv_cache[block, layer, 0, pos % block_size].float())
        values.append(kv_cache[block, layer, 1, pos % block_size].float())
    return torch.stack(keys), torch.stack(values)


def _attend(
    q: Tensor, k: Tensor, v: Tensor, context_len: int, scale: float, window: int = 0
) -> Tensor:
    """Causal float32 attention of q [Tq, H, D] (the last Tq of context_len positions), over
    the last `window` positions of each query's context when `window` > 0."""
    tq, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    qf = q.float().permute(1, 0, 2)
    kf = k.repeat_interleave(group, dim=1).permute(1, 0, 2)
    vf = v.repeat_interleave(group, dim=1).permute(1, 0, 2)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    qpos = torch.arange(context_len - tq, context_len).unsqueeze(1)
    kpos = torch.arange(context_len).unsqueeze(0)
    scores = scores.masked_fill(_masked(qpos, kpos, window), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vf).permute(1, 0, 2)


def decode_attention(
    query: Tensor,
    kv_cache: Tensor,
    layer: int,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int = 0,
) -> Tensor:
    """One query token per sequence over its first seq_lens[b] cached positions (the last
    `window` of them when `window` > 0)."""
    out = torch.empty_like(query)
    for b, length in enumerate(seq_lens.tolist()):
        k, v = gather_kv(kv_cache, layer, block_tables[b], length)
        out[b] = _attend(query[b : b + 1], k, v, length, scale, window)[0].to(query.dtype)
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
    window: int = 0,
) -> Tensor:
    """Causal attention of each chunk's queries over its cached prefix plus the chunk itself
    (each query over the last `window` positions of its context when `window` > 0)."""
    out = torch.empty_like(query)
    for s, length in enumerate(seq_lens):
        start, end = query_start_loc[s], query_start_loc[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        prefix = length - q_len
        if prefix > 0:
            kp, vp = gather_kv(kv_cache, layer, block_tables[s], prefix)
            k = torch.cat([kp, key[start:end].float()])
            v = torch.cat([vp, value[start:end].float()])
        else:
            k, v = key[start:end].float(), value[start:end].float()
        out[start:end] = _attend(query[start:end], k, v, length, scale, window).to(query.dtype)
    return out


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias) in float64, rounded once to x's dtype."""
    y = x.double() @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def moe_experts(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor
) -> Tensor:
    """Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t]) for every token t, one token
    and one expert at a time, in float64; returned as float32 [T, H].

    An expert is a gated MLP: ``down(silu(gate(x)) * up(x))`` with w13 [E, 2I, H] holding
    gate then up, and w2 [E, H, I]."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double().cpu()
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            h = w13[e].double().cpu() @ xt
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(topk_weights[t, k]) * (w2[e].double().cpu() @ act)
    return out.float().to(x.device)
