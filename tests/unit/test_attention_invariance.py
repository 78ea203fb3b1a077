"""Attention is batch- and chunk-invariant: a query row's output is the same bits whether
its token is a decode step (alone or among other sequences of any length) or a row of a
prefill chunk of any size and start, next to other chunks (docs/engine.md, Determinism)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

from pdserve.kernels import cpu_extension

# Triton runs its kernels through its interpreter here; it must be told before it is first
# imported (see test_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The C++ backend serves every CPU step, the Triton one every cuda step. The torch backend
# (a CPU without the extension, cuda without triton) runs scaled_dot_product_attention,
# whose kernels block by shape: it makes no such promise (docs/engine.md, Determinism).
BACKENDS = ["cpp", "triton"]
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 2
LENGTH = 100  # the sequence under test; its K/V are in the cache
SPLITS = [[17, 23, 1, 59], [99, 1], [100], [1, 99], [16, 16, 16, 52], [5, 72, 23], [31, 33, 36]]


def _setup(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(64, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    blocks = torch.randperm(64, generator=gen).int()
    table = blocks[:8].view(1, -1)  # the sequence under test: 7 blocks hold 100 tokens
    other = blocks[8:16].view(1, -1)  # other sequences share these blocks (read only)
    q = torch.randn(LENGTH, HEADS, HEAD_DIM, generator=gen).to(dtype)
    noise = torch.randn(200, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return cache, table, other, q, noise


def _decode(backend, q, cache, tables, lens):
    return backend.decode_attention(
        q, cache, 1, tables, torch.tensor(lens, dtype=torch.int32), 0.125
    )


def _prefill(backend, q, cache, tables, starts, lens):
    return backend.prefill_attention(q, None, None, cache, 1, starts, lens, tables, 0.125)


@pytest.fixture(params=BACKENDS)
def backend(request) -> ModuleType:
    if request.param == "cpp":
        if cpu_extension.load() is None:
            pytest.fail("the C++ attention extension did not build")
        return cpu_extension
    language = pytest.importorskip("triton.language", reason="triton is not installed")
    if not torch.cuda.is_available() and type(language.sum).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run this file alone")
    from pdserve.kernels import triton_paged

    if type(triton_paged._attention_kernel).__name__ != "InterpretedFunction":
        triton_paged = importlib.reload(triton_paged)
    return triton_paged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_row_does_not_depend_on_the_batch(backend, dtype):
    mod = backend
    cache, table, other, q, noise = _setup(dtype)
    for p in (0, 1, 15, 16, 17, 40, 63, 64, 99):
        alone = _decode(mod, q[p : p + 1], cache, table, [p + 1])
        for others in ([], [50], [90, 3], [1, 128, 7, 64, 33, 2, 100]):
            batch = torch.cat([noise[: len(others)], q[p : p + 1]])
            tables = torch.cat([other.expand(len(others), -1), table])
            got = _decode(mod, batch, cache, tables, [*others, p + 1])[-1:]
            assert torch.equal(got, alone), (p, others)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_equal_decode_rows_for_every_chunking(backend, dtype):
    mod = backend
    cache, table, other, q, noise = _setup(dtype)
    decoded = torch.cat([_decode(mod, q[p : p + 1], cache, table, [p + 1]) for p in range(LENGTH)])
    interpreted = mod is not cpu_extension and not torch.cuda.is_available()
    for split in SPLITS[:2] if interpreted else SPLITS:  # the interpreter is slow
        start = 0
        for i, size in enumerate(split):
            end = start + size
            # a neighbour chunk of another sequence in the same call, before or after
            extra = (i % 3) + 5
            before = i % 2 == 0
            rows = [noise[:extra], q[start:end]] if before else [q[start:end], noise[:extra]]
            lens = [extra + 20, end] if before else [end, extra + 20]
            sizes = [extra, size] if before else [size, extra]
            tables = torch.cat([other, table] if before else [table, other])
            out = _prefill(mod, torch.cat(rows), cache, tables, [0, sizes[0], sum(sizes)], lens)
            got = out[extra:] if before else out[:size]
            assert torch.equal(got, decoded[start:end]), (split, i)
            start = end


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_decode_is_never_split_by_the_batch(backend, dtype):
    """A long context alone (where a split of the context across threads would pay off) and
    the same context next to other long ones give the same bits, and equal its prefill."""
    if backend is not cpu_extension and not torch.cuda.is_available():
        pytest.skip("interpreted Triton: the short-context tests cover its code paths")
    gen = torch.Generator().manual_seed(1)
    length, num_blocks = 1100, 300
    cache = torch.randn(num_blocks, 1, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = perm[:70].view(1, -1)
    q = torch.randn(4, HEADS, HEAD_DIM, generator=gen).to(dtype)

    def decode(qs, tables, lens):
        lens_t = torch.tensor(lens, dtype=torch.int32)
        return backend.decode_attention(qs, cache, 0, tables, lens_t, 0.125)

    alone = decode(q[:1], table, [length])
    batch = decode(q, torch.cat([table, perm[70:140].view(1, -1)] * 2), [length, 900, 1050, 3])
    assert torch.equal(batch[:1], alone)
    rows = torch.cat([torch.randn(49, HEADS, HEAD_DIM, generator=gen).to(dtype), q[:1]])
    chunk = backend.prefill_attention(rows, None, None, cache, 0, [0, 50], [length], table, 0.125)
    assert torch.equal(chunk[-1:], alone)


def test_prefill_tiles_cut_each_chunk_into_whole_tokens():
    pytest.importorskip("triton", reason="triton is not installed")
    from pdserve.kernels.triton_paged import prefill_tiles

    # Two chunks: 5 tokens of a fresh prompt, then 25 tokens after 15 cached ones.
    seq, start, tokens, lens = prefill_tiles([0, 5, 30], [5, 40], 4)
    assert seq.tolist() == [0, 0] + [1] * 7
    assert start.tolist() == [0, 4, 5, 9, 13, 17, 21, 25, 29]
    assert tokens.tolist() == [4, 1, 4, 4, 4, 4, 4, 4, 1]
    assert lens.tolist() == [4, 5, 19, 23, 27, 31, 35, 39, 40]  # the last token's context
    assert all(t.dtype == torch.int32 for t in (seq, start, tokens, lens))
