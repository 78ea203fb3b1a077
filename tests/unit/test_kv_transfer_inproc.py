"""The KV transport contract on the in-process transport (the UCX one is checked between real
processes in tests/integration/test_kv_transfer_ucx.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch

from pdserve.common.kv_transfer import KvTransferError, create_transport
from pdserve.common.kv_transfer.base import INDEX_BITS
from pdserve.common.kv_transfer.inproc import InprocTransport

NUM_BLOCKS = 32
BLOCK_SHAPE = (2, 2, 4, 8)  # layers, K/V, tokens, head_dim
BLOCK_BYTES = 2 * 2 * 4 * 8 * 2  # bf16
BOUND = 5.0  # seconds a future gets to resolve before the test calls it a hang


class Pair(NamedTuple):
    prefill: InprocTransport
    decode: InprocTransport
    src: torch.Tensor  # prefill's pool: random blocks
    dst: torch.Tensor  # decode's pool: zeros


@pytest.fixture
def pair() -> Iterator[Pair]:
    shape = (NUM_BLOCKS, *BLOCK_SHAPE)
    src = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    p = Pair(InprocTransport(), InprocTransport(), src, torch.zeros(shape, dtype=torch.bfloat16))
    p.prefill.register_pool(p.src)
    p.decode.register_pool(p.dst)
    yield p
    p.prefill.close()
    p.decode.close()


def failure(future) -> str:
    error = future.exception(timeout=BOUND)
    assert isinstance(error, KvTransferError), error
    return str(error)


def test_blocks_land_in_place_with_shuffled_ids(pair: Pair) -> None:
    prefill, decode, src, dst = pair
    rng = random.Random(1)
    src_ids = rng.sample(range(NUM_BLOCKS), 10)
    dst_ids = rng.sample(range(NUM_BLOCKS), 10)
    tag = decode.new_tag()
    received = decode.post_receive(tag, dst_ids, timeout=BOUND)
    sent = prefill.send(decode.address, tag, src_ids, timeout=BOUND)
    for result in (received.result(BOUND), sent.result(BOUND)):
        assert (result.num_blocks, result.num_bytes) == (10, 10 * BLOCK_BYTES)
        assert result.seconds >= 0
    for i, j in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[j], src[i])
    untouched = sorted(set(range(NUM_BLOCKS)) - set(dst_ids))
    assert not dst[untouched].any()


def test_mismatched_block_counts_fail_both_sides(pair: Pair) -> None:
    prefill, decode, _, _ = pair
    tag = decode.new_tag()
    received = decode.post_receive(tag, [1, 2, 3], timeout=BOUND)
    sent = prefill.send(decode.address, tag, [4, 5], timeout=BOUND)
    assert "mismatch" in failure(sent)
    assert "mismatch" in failure(received)
    assert not pair.dst.any()


def test_cancel_fails_the_receive_and_nothing_lands(pair: Pair) -> None:
    prefill, decode, _, _ = pair
    tag = decode.new_tag()
    received = decode.post_receive(tag, [7], timeout=BOUND)
    decode.cancel(tag)
    assert "cancelled" in failure(received)
    assert "no receive" in failure(prefill.send(decode.address, tag, [0], timeout=BOUND))
    assert not pair.dst.any()
    decode.cancel(tag)  # finished or unknown tags are ignored
    decode.cancel(12345 << INDEX_BITS)


def test_timeout_fails_the_receive(pair: Pair) -> None:
    decode = pair.decode
    received = decode.post_receive(decode.new_tag(), [0, 1], timeout=0.05)
    assert "timed out" in failure(received)  # well before BOUND


def test_unknown_peer_fails(pair: Pair) -> None:
    prefill = pair.prefill
    sent = prefill.send(b"inproc:nobody", prefill.new_tag(), [0], timeout=BOUND)
    assert "not reachable" in failure(sent)


def test_closed_peer_is_unreachable_and_its_receives_fail(pair: Pair) -> None:
    prefill, decode, _, _ = pair
    tag = decode.new_tag()
    received = decode.post_receive(tag, [0], timeout=BOUND)
    decode.close()
    assert "closed" in failure(received)
    assert "not reachable" in failure(prefill.send(decode.address, tag, [0], timeout=BOUND))


@pytest.mark.parametrize("bad", [NUM_BLOCKS, -1, 1000])
def test_bad_block_ids_are_named(pair: Pair, bad: int) -> None:
    prefill, decode, _, _ = pair
    with pytest.raises(KvTransferError, match=rf"got {bad}\b"):
        decode.post_receive(decode.new_tag(), [0, bad], timeout=BOUND)
    sent = prefill.send(decode.address, decode.new_tag(), [bad, 1], timeout=BOUND)
    assert f"got {bad}" in failure(sent)


def test_empty_transfer_is_refused(pair: Pair) -> None:
    decode = pair.decode
    with pytest.raises(KvTransferError, match="at least one block"):
        decode.post_receive(decode.new_tag(), [], timeout=BOUND)


def test_transfer_before_register_pool_fails() -> None:
    transport = InprocTransport()
    try:
        with pytest.raises(KvTransferError, match="register_pool"):
            transport.post_receive(transport.new_tag(), [0], timeout=BOUND)
    finally:
        transport.close()


def test_tags_are_distinct_and_leave_the_index_bits_free() -> None:
    transport = create_transport("inproc")
    try:
        tags = [transport.new_tag() for _ in range(1000)]
        assert len(set(tags)) == len(tags)
        assert all(tag & ((1 << INDEX_BITS) - 1) == 0 for tag in tags)
        assert all(0 < tag < 1 << 64 for tag in tags)
        # Drawn afresh per transfer: one tag says nothing about the next.
        assert len({tag >> 40 for tag in tags}) > 900
    finally:
        transport.close()
    with pytest.raises(ValueError, match="kv_transport"):
        create_transport("carrier-pigeon")
