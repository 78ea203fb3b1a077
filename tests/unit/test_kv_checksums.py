"""KV block checksums (`common/handoff/checksums.py`): equal bytes give equal hashes in any
dtype, one flipped byte anywhere in a block is caught and named, and a sender that sent no
checksums (a GPU cache) is not checked."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.handoff.checksums import CorruptBlock, block_checksums, corrupt, verify


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_flipped_byte_is_caught_and_named(dtype):
    gen = torch.Generator().manual_seed(3)
    sender = torch.randn(8, 2, 2, 16, 2, 8, generator=gen).to(dtype)
    receiver = torch.zeros_like(sender)
    sent, landed = [1, 4, 6], [0, 2, 7]
    receiver[landed] = sender[sent]
    sums = block_checksums(sender, sent)
    assert len(set(sums)) == 3
    verify(receiver, landed, sums)  # equal bytes: no error
    corrupt(receiver, landed[1])
    with pytest.raises(CorruptBlock) as caught:
        verify(receiver, landed, sums)
    assert caught.value.index == 1 and "block 2 here" in str(caught.value)
    verify(receiver, landed, [])  # nothing sent to check against


def test_every_byte_counts():
    cache = torch.zeros(2, 4, 4)
    base = block_checksums(cache, [0])[0]
    flat = cache[0].view(torch.uint8).view(-1)
    for i in range(flat.numel()):
        flat[i] = 1
        assert block_checksums(cache, [0])[0] != base, i
        flat[i] = 0
