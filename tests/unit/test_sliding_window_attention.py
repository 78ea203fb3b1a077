"""Sliding-window attention (Gemma 3's local layers, Qwen3's sliding layers): every backend
masks each query to the last `window` positions of its context, in decode and in prefill
chunks, and matches the naive dense oracle; the C++ and Triton kernels keep their batch and
chunk invariance for windowed rows; a window of 0 leaves full causal attention unchanged."""

from __future__ import annotations

import importlib
import math
import os
from types import ModuleType

import pytest
import torch
from test_kernels import Pool, assert_close

from pdserve.kernels import attention, cpu_extension, reference, torch_paged

# Triton runs its kernels through its interpreter here; it must be told before it is first
# imported (see test_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64
WINDOWS = [1, 5, 16, 37]


def _backend(name: str) -> ModuleType:
    if name == "cpp":
        if cpu_extension.load() is None:
            pytest.fail("the C++ attention extension did not build")
        return cpu_extension
    if name == "triton":
        language = pytest.importorskip("triton.language", reason="triton is not installed")
        if not torch.cuda.is_available() and type(language.sum).__name__ != "InterpretedFunction":
            pytest.skip(
                "triton was imported before TRITON_INTERPRET=1 was set: run this file alone"
            )
        from pdserve.kernels import triton_paged

        if type(triton_paged._attention_kernel).__name__ != "InterpretedFunction":
            triton_paged = importlib.reload(triton_paged)
        return triton_paged
    return {"reference": reference, "torch": torch_paged}[name]


def _decode(name, query, kv, layer, tables, lens, scale, window):
    """Decode through `name`'s kernel (the C++ one through the public dispatcher, which is
    what carries the window to it)."""
    if name == "cpp":
        return attention.decode_attention(query, kv, layer, tables, lens, scale, window)
    return _backend(name).decode_attention(query, kv, layer, tables, lens, scale, window=window)


def _prefill(name, query, kv, layer, starts, lens, tables, scale, window, key=None, value=None):
    """Prefill chunks through `name`'s kernel; key/value: the chunks' own K/V (also in the
    cache), which the reference and torch backends read for a chunk without a prefix."""
    if name == "cpp":
        return attention.prefill_attention(
            query, key, value, kv, layer, starts, lens, tables, scale, window
        )
    return _backend(name).prefill_attention(
        query, key, value, kv, layer, starts, lens, tables, scale, window=window
    )


@pytest.fixture
def on_cpp(monkeypatch):
    """The dispatcher sends CPU tensors to the C++ kernels (the default where it builds)."""
    monkeypatch.delenv(attention.BACKEND_ENV, raising=False)
    if cpu_extension.load() is None:
        pytest.fail("the C++ attention extension did not build")


@pytest.mark.parametrize("name", ["reference", "torch", "cpp", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_windowed_decode_and_prefill_match_dense(on_cpp, name, dtype, block_size):
    if name == "triton":
        _backend("triton")
    gen = torch.Generator().manual_seed(block_size)
    lens = [1, block_size, 2 * block_size + 3, 45, 70]
    pool = Pool(lens, block_size, dtype, gen, head_dim=HEAD_DIM)
    scale = 1 / math.sqrt(HEAD_DIM)
    windows = WINDOWS[1:3] if name == "triton" else WINDOWS  # the interpreter is slow
    for window in windows:
        query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        got = _decode(name, query, pool.kv, pool.layer, pool.tables, seq_lens, scale, window)
        for s, n in enumerate(lens):
            want = reference.dense_attention(
                query[s : s + 1], pool.k[s], pool.v[s], n - 1, scale, window
            )
            assert_close(got[s : s + 1], want, dtype)
        # Prefill: each sequence's last q_len positions as one chunk (its prefix cached).
        q_lens = [min(n, q) for n, q in zip(lens, [1, 3, block_size + 1, 45, 20], strict=True)]
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        rows = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=gen).to(dtype)
        chunk_k = torch.cat([k[n - q :] for k, n, q in zip(pool.k, lens, q_lens, strict=True)])
        chunk_v = torch.cat([v[n - q :] for v, n, q in zip(pool.v, lens, q_lens, strict=True)])
        out = _prefill(name, rows, pool.kv, pool.layer, starts, lens, pool.tables, scale, window,
                       chunk_k, chunk_v)  # fmt: skip
        for s, (n, q) in enumerate(zip(lens, q_lens, strict=True)):
            want = reference.dense_attention(
                rows[starts[s] : starts[s + 1]], pool.k[s], pool.v[s], n - q, scale, window
            )
            assert_close(out[starts[s] : starts[s + 1]], want, dtype)


def test_a_window_wider_than_the_context_is_full_causal_attention(on_cpp):
    gen = torch.Generator().manual_seed(3)
    lens = [9, 33]
    pool = Pool(lens, 8, torch.float32, gen)
    query = torch.randn(2, HEADS, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    full = _decode("cpp", query, pool.kv, pool.layer, pool.tables, seq_lens, 0.125, 0)
    wide = _decode("cpp", query, pool.kv, pool.layer, pool.tables, seq_lens, 0.125, 33)
    narrow = _decode("cpp", query, pool.kv, pool.layer, pool.tables, seq_lens, 0.125, 32)
    assert torch.equal(full, wide)
    assert torch.equal(full[:1], narrow[:1]) and not torch.equal(full[1:], narrow[1:])


# Batch and chunk invariance of windowed rows (the kernels that promise it).
BLOCK, LENGTH, LAYERS = 16, 100, 2
SPLITS = [[17, 23, 1, 59], [99, 1], [100], [16, 16, 16, 52], [5, 72, 23]]


def _setup(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(64, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    blocks = torch.randperm(64, generator=gen).int()
    table, other = blocks[:8].view(1, -1), blocks[8:16].view(1, -1)
    q = torch.randn(LENGTH, HEADS, HEAD_DIM, generator=gen).to(dtype)
    noise = torch.randn(200, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return cache, table, other, q, noise


@pytest.mark.parametrize("name", ["cpp", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [7, 40])
def test_windowed_rows_do_not_depend_on_batch_or_chunking(on_cpp, name, dtype, window):
    _backend(name)
    cache, table, other, q, noise = _setup(dtype)

    def decode(rows, tables, lens):
        lens_t = torch.tensor(lens, dtype=torch.int32)
        return _decode(name, rows, cache, 1, tables, lens_t, 0.125, window)

    decoded = torch.cat([decode(q[p : p + 1], table, [p + 1]) for p in range(LENGTH)])
    for p in (0, 6, 7, 15, 16, 17, 47, 99):
        for others in ([50], [90, 3], [1, 128, 7, 64]):
            batch = torch.cat([noise[: len(others)], q[p : p + 1]])
            tables = torch.cat([other.expand(len(others), -1), table])
            got = decode(batch, tables, [*others, p + 1])[-1:]
            assert torch.equal(got, decoded[p : p + 1]), (p, others)
    interpreted = name == "triton" and not torch.cuda.is_available()
    for split in SPLITS[:2] if interpreted else SPLITS:
        start = 0
        for i, size in enumerate(split):
            end = start + size
            extra = (i % 3) + 5  # a neighbour chunk of another sequence, before the chunk
            rows = torch.cat([noise[:extra], q[start:end]])
            out = _prefill(name, rows, cache, 1, [0, extra, extra + size], [extra + 20, end],
                           torch.cat([other, table]), 0.125, window)  # fmt: skip
            assert torch.equal(out[extra:], decoded[start:end]), (split, i)
            start = end
