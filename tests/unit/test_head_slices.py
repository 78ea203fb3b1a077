"""The KV head-slice mapping between tensor-parallel groups (`kv_transfer/head_slices.py`)
for every pair the model splits into: each decode rank ends up with exactly its KV heads of
every block, from one or several prefill ranks, in the blocks it allocated; it receives
only the bytes of the heads it keeps, and blocks outside the transfer are untouched. Also
the buffer messages of the in-process transport (several senders to one receive)."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.kv_transfer.head_slices import empty_buffer, pack, plan, unpack
from pdserve.common.kv_transfer.inproc import InprocTransport
from pdserve.common.models.tensor_parallel import TensorShard

LAYERS, BLOCK, HEAD_DIM, BLOCKS = 3, 4, 8, 6
# (KV heads, prefill TP, decode TP): SmolLM2's 3 KV heads P 2 -> D 1, P 1 -> D 2, P 2 -> D 2,
# P 2 -> D 3, P 3 -> D 2; 8 heads P 4 -> D 2 and back; replicated heads (2 heads on 4 ranks).
PAIRS = [(3, 2, 1), (3, 1, 2), (3, 2, 2), (3, 2, 3), (3, 3, 2), (8, 4, 2), (8, 2, 4),
         (2, 4, 2), (2, 1, 4), (1, 2, 1), (1, 1, 2), (4, 1, 1)]  # fmt: skip


def rank_cache(full: torch.Tensor, heads: range) -> torch.Tensor:
    return full[:, :, :, :, heads.start : heads.stop].contiguous()


@pytest.mark.parametrize(("kv_heads", "src_tp", "dst_tp"), PAIRS)
def test_every_decode_rank_gets_exactly_its_heads(kv_heads, src_tp, dst_tp) -> None:
    gen = torch.Generator().manual_seed(kv_heads * 100 + src_tp * 10 + dst_tp)
    full = torch.randn(BLOCKS, LAYERS, 2, BLOCK, kv_heads, HEAD_DIM, generator=gen)
    src = [rank_cache(full, TensorShard(r, src_tp).kv_heads(kv_heads)) for r in range(src_tp)]
    dst_heads = [TensorShard(r, dst_tp).kv_heads(kv_heads) for r in range(dst_tp)]
    dst = [torch.zeros(BLOCKS + 2, LAYERS, 2, BLOCK, len(h), HEAD_DIM) for h in dst_heads]
    src_blocks, dst_blocks = [4, 1, 2], [0, 6, 3]  # any blocks on either side
    received = [0] * dst_tp
    slices = plan(kv_heads, src_tp, dst_tp)
    assert [s.index for s in slices] == list(range(len(slices)))
    for s in slices:
        buffer = pack(src[s.src_rank], src_blocks, s)
        assert buffer.shape == (3, LAYERS, 2, BLOCK, len(s.heads), HEAD_DIM)
        received[s.dst_rank] += buffer.numel() * buffer.element_size()
        unpack(dst[s.dst_rank], dst_blocks, s, buffer)
    for rank, heads in enumerate(dst_heads):
        got = dst[rank][dst_blocks]
        assert torch.equal(got, full[src_blocks][:, :, :, :, heads.start : heads.stop])
        others = [b for b in range(BLOCKS + 2) if b not in dst_blocks]
        assert not dst[rank][others].any()  # nothing written outside the transfer
        # Its share and no more: 3 blocks × layers × K,V × tokens × its heads × head_dim.
        assert received[rank] == 3 * LAYERS * 2 * BLOCK * len(heads) * HEAD_DIM * 4
    # Every (decode rank, head) pair is carried once, by a prefill rank that holds it.
    carried = [(s.dst_rank, h) for s in slices for h in s.heads]
    assert sorted(carried) == sorted((r, h) for r, hs in enumerate(dst_heads) for h in hs)
    for s in slices:
        assert set(s.heads) <= set(TensorShard(s.src_rank, src_tp).kv_heads(kv_heads))


def test_one_receive_takes_slices_from_several_senders() -> None:
    """P 2 -> D 1 over the in-process transport: both prefill ranks send into one receive,
    which completes when the last slice came."""
    kv_heads = 3
    full = torch.randn(BLOCKS, LAYERS, 2, BLOCK, kv_heads, HEAD_DIM)
    senders = [InprocTransport() for _ in range(2)]
    receiver = InprocTransport()
    try:
        src = [rank_cache(full, TensorShard(r, 2).kv_heads(kv_heads)) for r in range(2)]
        dst = torch.zeros_like(full)
        slices = plan(kv_heads, 2, 1)
        buffers = [(s.index, empty_buffer(dst, 2, s)) for s in slices]
        tag = receiver.new_tag()
        done = receiver.post_receive_buffers(tag, buffers, timeout=10)
        for s in slices:
            sent = senders[s.src_rank].send_buffers(
                receiver.address, tag, [(s.index, pack(src[s.src_rank], [5, 0], s))], 10
            )
            assert sent.result(5).num_bytes > 0
        assert done.result(5).num_bytes == 2 * LAYERS * 2 * BLOCK * kv_heads * HEAD_DIM * 4
        for s, (_, buffer) in zip(slices, buffers, strict=True):
            unpack(dst, [1, 2], s, buffer)
        assert torch.equal(dst[[1, 2]], full[[5, 0]])
    finally:
        for t in (*senders, receiver):
            t.close()
