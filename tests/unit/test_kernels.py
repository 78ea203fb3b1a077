"""Attention kernels against naive dense attention, for every backend that runs here.

Each backend (reference, torch, and the C++ extension when it builds) must agree with
`dense_attention` (float64) on random data: GQA ratios 1/3/4, block sizes 1/8/16, ragged
lengths around block boundaries and a few hundred, shuffled block ids, prefill with and
without a cached prefix, mixed decode batches; the C++ head sizes/dtypes; write_kv; the
dispatcher; the optional Triton decode kernel (interpreted). Tolerances (abs and rel):
float32 1e-5; bfloat16 1e-2 and float16 2e-3: the inputs are exact bf16/fp16 values, the
error is the rounding of the output (and of the softmax weights in the C++ bf16 value pass).
Slots a kernel must not read hold NaN, so any stray read shows up. Fixed seeds throughout.
"""

from __future__ import annotations

import importlib
import math
import os
from types import ModuleType

import pytest
import torch

from pdserve.kernels import attention, cpu_extension, reference, torch_paged

# Triton (optional) runs its kernels through its interpreter here; it must be told before it
# is first imported, which no test does at collection time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = ["reference", "torch", "cpp"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
KV_HEADS, HEAD_DIM, LAYERS = 2, 64, 3


def backend(name: str) -> ModuleType:
    if name == "cpp":
        if cpu_extension.load() is None:
            pytest.skip("the C++ extension did not build here (see the logged warning)")
        return cpu_extension
    return {"reference": reference, "torch": torch_paged}[name]


def lengths_around(block_size: int) -> list[int]:
    """1, a block boundary and its neighbours, two blocks + 1, a few hundred."""
    return sorted({1, max(1, block_size - 1), block_size, block_size + 1, 2 * block_size + 1, 301})


class Pool:
    """A NaN-filled cache whose sequences own shuffled, non-contiguous blocks."""

    def __init__(
        self,
        lens: list[int],
        block_size: int,
        dtype: torch.dtype,
        gen: torch.Generator,
        head_dim: int = HEAD_DIM,
    ) -> None:
        self.block_size, self.lens, self.dtype = block_size, lens, dtype
        needed = [-(-n // block_size) for n in lens]
        num_blocks = sum(needed) + 7
        self.kv = torch.full(
            (num_blocks, LAYERS, 2, block_size, KV_HEADS, head_dim), float("nan"), dtype=dtype
        )
        ids = torch.randperm(num_blocks, generator=gen)
        width = max(needed) + 2
        # Padding beyond the used blocks: anything, even ids outside the cache.
        self.tables = torch.randint(-5, 10**6, (len(lens), width), generator=gen, dtype=torch.int32)
        used = 0
        for s, n in enumerate(needed):
            self.tables[s, :n] = ids[used : used + n].int()
            used += n
        self.k = [torch.randn(n, KV_HEADS, head_dim, generator=gen).to(dtype) for n in lens]
        self.v = [torch.randn(n, KV_HEADS, head_dim, generator=gen).to(dtype) for n in lens]
        for layer in range(LAYERS):  # the other layers hold different data
            for seq in range(len(lens)):
                self.store(layer, seq, self.k[seq] * (layer + 2), self.v[seq] - layer - 1)
        self.layer = 1
        for seq in range(len(lens)):
            self.store(self.layer, seq, self.k[seq], self.v[seq])

    def slots(self, seq: int, positions: torch.Tensor) -> torch.Tensor:
        blocks = self.tables[seq, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def store(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self.slots(seq, torch.arange(k.shape[0]))
        blocks, offsets = slots // self.block_size, slots % self.block_size
        self.kv[blocks, layer, 0, offsets] = k
        self.kv[blocks, layer, 1, offsets] = v


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(got).any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_decode_matches_dense(name: str, dtype: torch.dtype, group: int, block_size: int) -> None:
    mod = backend(name)
    gen = torch.Generator().manual_seed(1000 * group + block_size)
    lens = lengths_around(block_size)
    lens = [lens[i] for i in torch.randperm(len(lens), generator=gen)]  # mixed order
    pool = Pool(lens, block_size, dtype, gen)
    heads = group * KV_HEADS
    query = torch.randn(len(lens), heads, HEAD_DIM, generator=gen).to(dtype)
    scale = 1 / math.sqrt(HEAD_DIM)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = mod.decode_attention(query, pool.kv, pool.layer, pool.tables, seq_lens, scale)
    assert got.shape == query.shape and got.dtype == dtype
    for s, n in enumerate(lens):
        want = reference.dense_attention(query[s : s + 1], pool.k[s], pool.v[s], n - 1, scale)
        assert_close(got[s : s + 1], want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("lens", [[3001], [77, 4096]])
def test_cpp_split_decode_matches_dense(
    dtype: torch.dtype, block_size: int, lens: list[int]
) -> None:
    """Long contexts in a small batch: the C++ decode splits them across threads (split-K,
    partial softmax sums merged at the end), next to an unsplit short sequence."""
    mod = backend("cpp")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs more than one thread
    try:
        gen = torch.Generator().manual_seed(5 + block_size + len(lens))
        pool = Pool(lens, block_size, dtype, gen)
        query = torch.randn(len(lens), 3 * KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        scale = 1 / math.sqrt(HEAD_DIM)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        got = mod.decode_attention(query, pool.kv, pool.layer, pool.tables, seq_lens, scale)
    finally:
        torch.set_num_threads(threads)
    for s, n in enumerate(lens):
        want = reference.dense_attention(query[s : s + 1], pool.k[s], pool.v[s], n - 1, scale)
        assert_close(got[s : s + 1], want, dtype)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_prefill_matches_dense(name: str, dtype: torch.dtype, group: int, block_size: int) -> None:
    mod = backend(name)
    gen = torch.Generator().manual_seed(2000 * group + block_size)
    bs = block_size
    # (chunk length, cached prefix): whole prompts and chunks after a cached prefix.
    chunks = [(1, 0), (bs + 1, 0), (37, 0), (5, bs), (bs, bs - 1), (bs + 1, 2 * bs + 1), (40, 260)]
    lens = [q_len + prefix for q_len, prefix in chunks]
    pool = Pool(lens, block_size, dtype, gen)
    heads = group * KV_HEADS
    starts = [0]
    for q_len, _ in chunks:
        starts.append(starts[-1] + q_len)
    query = torch.randn(starts[-1], heads, HEAD_DIM, generator=gen).to(dtype)
    key = torch.cat([pool.k[s][p:] for s, (_, p) in enumerate(chunks)])
    value = torch.cat([pool.v[s][p:] for s, (_, p) in enumerate(chunks)])
    scale = 0.7 / math.sqrt(HEAD_DIM)
    got = mod.prefill_attention(
        query, key, value, pool.kv, pool.layer, starts, lens, pool.tables, scale
    )
    assert got.shape == query.shape and got.dtype == dtype
    for s, (_, prefix) in enumerate(chunks):
        q = query[starts[s] : starts[s + 1]]
        want = reference.dense_attention(q, pool.k[s], pool.v[s], prefix, scale)
        assert_close(got[starts[s] : starts[s + 1]], want, dtype)


@pytest.mark.parametrize("name", ["torch", "cpp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 36, 48, 96, 128, 256])
def test_head_dims_and_dtypes(name: str, dtype: torch.dtype, head_dim: int) -> None:
    """Every vector kernel width of the C++ path (AVX-512 builds: 32, 64, 96, 128, 256, and
    the scalar path for 48; AVX2 builds: any multiple of 8) and the scalar fallback on every
    build (36)."""
    mod = backend(name)
    gen = torch.Generator().manual_seed(head_dim)
    lens = [1, 17, 70]
    pool = Pool(lens, 16, dtype, gen, head_dim=head_dim)
    query = torch.randn(len(lens), 3 * KV_HEADS, head_dim, generator=gen).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    got = mod.decode_attention(
        query, pool.kv, pool.layer, pool.tables, torch.tensor(lens, dtype=torch.int32), scale
    )
    for s, n in enumerate(lens):
        want = reference.dense_attention(query[s : s + 1], pool.k[s], pool.v[s], n - 1, scale)
        assert_close(got[s : s + 1], want, dtype)
    chunk = 20  # prefill: 20-token chunk after a prefix of 50
    q = torch.randn(chunk, 3 * KV_HEADS, head_dim, generator=gen).to(dtype)
    got = mod.prefill_attention(
        q,
        pool.k[2][50:],
        pool.v[2][50:],
        pool.kv,
        pool.layer,
        [0, chunk],
        [70],
        pool.tables[2:],
        scale,
    )
    assert_close(got, reference.dense_attention(q, pool.k[2], pool.v[2], 50, scale), dtype)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_touches_only_its_slots(name: str, dtype: torch.dtype, block_size: int) -> None:
    mod = backend(name)
    gen = torch.Generator().manual_seed(7 + block_size)
    num_blocks, tokens, layer = 40, 37, 2
    cache = torch.randn(num_blocks, LAYERS, 2, block_size, KV_HEADS, HEAD_DIM, generator=gen)
    cache = cache.to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    # key/value as strided views of a fused projection output, as the model runner has them.
    fused = torch.randn(tokens, 3 * KV_HEADS * HEAD_DIM, generator=gen).to(dtype)
    key = fused[:, : KV_HEADS * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    value = fused[:, 2 * KV_HEADS * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
    want = cache.clone()
    for t, slot in enumerate(slots.tolist()):
        want[slot // block_size, layer, 0, slot % block_size] = key[t]
        want[slot // block_size, layer, 1, slot % block_size] = value[t]
    mod.write_kv(cache, layer, key, value, slots)
    assert torch.equal(cache, want)


def test_cpp_rejects_out_of_range_ids() -> None:
    mod = backend("cpp")
    cache = torch.zeros(4, 1, 2, 16, 1, 64)
    with pytest.raises(RuntimeError, match="slot outside"):
        mod.write_kv(cache, 0, torch.ones(1, 1, 64), torch.ones(1, 1, 64), torch.tensor([64]))
    with pytest.raises(RuntimeError, match="block table"):
        mod.decode_attention(
            torch.ones(1, 1, 64),
            cache,
            0,
            torch.tensor([[9]], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            0.125,
        )


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = torch.zeros(2, 1, 2, 16, 1, 64)
    monkeypatch.delenv(attention.BACKEND_ENV, raising=False)
    expected = cpu_extension if cpu_extension.load() is not None else torch_paged
    assert attention.backend_for(cache) is expected
    for name, mod in [("reference", reference), ("torch", torch_paged)]:
        monkeypatch.setenv(attention.BACKEND_ENV, name)
        assert attention.backend_for(cache) is mod
    if importlib.util.find_spec("triton") is not None:
        monkeypatch.setenv(attention.BACKEND_ENV, "triton")
        assert attention.backend_for(cache).__name__ == "pdserve.kernels.triton_paged"
    monkeypatch.setenv(attention.BACKEND_ENV, "fastest")
    with pytest.raises(ValueError, match="expected one of"):
        attention.backend_for(cache)


def test_public_api_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """write_kv then decode through `attention`, default backend, bf16."""
    monkeypatch.delenv(attention.BACKEND_ENV, raising=False)
    gen = torch.Generator().manual_seed(3)
    pool = Pool([9, 33], 8, torch.bfloat16, gen)
    pool.kv.fill_(float("nan"))
    for s in range(2):
        slots = pool.slots(s, torch.arange(pool.lens[s]))
        attention.write_kv(pool.kv, pool.layer, pool.k[s], pool.v[s], slots)
    query = torch.randn(2, 3 * KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    lens = torch.tensor(pool.lens, dtype=torch.int32)
    got = attention.decode_attention(query, pool.kv, pool.layer, pool.tables, lens, 0.125)
    for s, n in enumerate(pool.lens):
        want = reference.dense_attention(query[s : s + 1], pool.k[s], pool.v[s], n - 1, 0.125)
        assert_close(got[s : s + 1], want, torch.bfloat16)


@pytest.fixture
def triton_interpreted() -> ModuleType:
    """The Triton backend running under the interpreter (on CPU tensors)."""
    language = pytest.importorskip("triton.language", reason="triton is not installed")
    if type(language.sum).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run this file alone")
    from pdserve.kernels import triton_paged

    if type(triton_paged._attention_kernel).__name__ != "InterpretedFunction":
        triton_paged = importlib.reload(triton_paged)
    return triton_paged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "block_size", "head_dim"), [(3, 16, 64), (1, 8, 48), (4, 1, 32)])
def test_triton_decode_matches_dense(
    triton_interpreted: ModuleType, dtype: torch.dtype, group: int, block_size: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(group * block_size + head_dim)
    lens = [block_size + 1, 1, 40, block_size]
    pool = Pool(lens, block_size, dtype, gen, head_dim=head_dim)
    query = torch.randn(len(lens), group * KV_HEADS, head_dim, generator=gen).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = triton_interpreted.decode_attention(
        query, pool.kv, pool.layer, pool.tables, seq_lens, scale
    )
    for s, n in enumerate(lens):
        want = reference.dense_attention(query[s : s + 1], pool.k[s], pool.v[s], n - 1, scale)
        assert_close(got[s : s + 1], want, dtype)
