"""Part 'kernels': every kernel the device runs against the naive references of
`pdserve.kernels.reference` (float64), on the shapes of the CPU tests (tests/unit/
test_kernels.py, test_triton_invariant.py, test_attention_invariance.py) and, on a GPU, the
full grids and an 8B model's layer shapes too:

- the Triton paged attention (`triton_paged`): decode and prefill against dense attention
  (GQA 1/3/4, block sizes 1/8/16, ragged lengths, shuffled blocks, NaN in every slot it must
  not read), and its batch/chunk invariance (a row's bits alone, in a batch, in any chunk);
- the Triton dense layer and RMSNorm (`triton_invariant`): values and row invariance;
- the MoE experts (`kernels/moe.py`, on the device's dense layer) and `write_kv`;
- on CPU, the C++ attention extension as well (the CPU's own kernels), and Triton runs in
  its interpreter (TRITON_INTERPRET=1, set by gpu_check.py before anything imports triton).

Each check is a row {name, ok, max_abs_err, tol}; the part is ok when every row is."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from gpu_check_parts.common import Context
from pdserve.kernels import reference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = (torch.float32, torch.bfloat16)
KV_HEADS = 2


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def close(self, name: str, got: Tensor, want: Tensor, tol: float) -> None:
        got, want = got.detach().float().cpu(), want.detach().float().cpu()
        diff = (got - want).abs()
        excess = diff - (tol + tol * want.abs())
        ok = bool(got.shape == want.shape and not torch.isnan(got).any() and excess.max() <= 0)
        self.rows.append({"name": name, "ok": ok, "max_abs_err": float(diff.max()), "tol": tol})

    def equal(self, name: str, mismatches: Sequence[str]) -> None:
        self.rows.append({"name": name, "ok": not mismatches, "mismatches": list(mismatches)[:5]})


class Pool:
    """A NaN-filled paged cache whose sequences own shuffled blocks (layer 1 holds them)."""

    def __init__(
        self,
        lens: list[int],
        bs: int,
        dtype: torch.dtype,
        heads_dim: tuple[int, int],
        gen: torch.Generator,
        device: str,
    ) -> None:
        kv_heads, head_dim = heads_dim
        needed = [-(-n // bs) for n in lens]
        num_blocks = sum(needed) + 7
        kv = torch.full((num_blocks, 3, 2, bs, kv_heads, head_dim), float("nan"), dtype=dtype)
        ids = torch.randperm(num_blocks, generator=gen)
        self.tables = torch.randint(
            -5, 10**6, (len(lens), max(needed) + 2), generator=gen, dtype=torch.int32
        )
        self.k = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
        self.v = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
        used = 0
        for s, n in enumerate(needed):
            self.tables[s, :n] = ids[used : used + n].int()
            used += n
            pos = torch.arange(lens[s])
            blocks = self.tables[s, pos // bs].long()
            kv[blocks, 1, 0, pos % bs] = self.k[s]
            kv[blocks, 1, 1, pos % bs] = self.v[s]
        self.kv = kv.to(device)
        self.tables = self.tables.to(device)


def attention_vs_dense(
    checks: Checks,
    mod: ModuleType,
    label: str,
    device: str,
    configs: Sequence[tuple[int, int, int]],
    full: bool,
) -> None:
    """decode and prefill of `mod` against dense attention, per (group, block, head_dim);
    not `full` (the interpreter): no long contexts, fewer and shorter chunks."""
    for group, bs, head_dim in configs:
        for dtype in DTYPES:
            gen = torch.Generator().manual_seed(1000 * group + bs + head_dim)
            lens = sorted({1, max(1, bs - 1), bs, bs + 1, 2 * bs + 1, *((301,) if full else ())})
            pool = Pool(lens, bs, dtype, (KV_HEADS, head_dim), gen, device)
            q = torch.randn(len(lens), group * KV_HEADS, head_dim, generator=gen).to(dtype)
            scale = 1 / math.sqrt(head_dim)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            got = mod.decode_attention(q.to(device), pool.kv, 1, pool.tables, seq_lens, scale)
            want = torch.cat(
                [
                    reference.dense_attention(q[s : s + 1], pool.k[s], pool.v[s], n - 1, scale)
                    for s, n in enumerate(lens)
                ]
            )
            tag = f"{label} g{group} b{bs} d{head_dim} {str(dtype)[6:]}"
            checks.close(f"{tag} decode", got, want, TOLERANCE[dtype])
            # prefill: whole prompts and chunks after a cached prefix
            chunks = [(1, 0), (5, bs)]
            if full:
                chunks += [(bs + 1, 0), (37, 0), (bs + 1, 2 * bs + 1), (40, 260)]
            plens = [a + b for a, b in chunks]
            pool = Pool(plens, bs, dtype, (KV_HEADS, head_dim), gen, device)
            starts = [0]
            for q_len, _ in chunks:
                starts.append(starts[-1] + q_len)
            q = torch.randn(starts[-1], group * KV_HEADS, head_dim, generator=gen).to(dtype)
            key = torch.cat([pool.k[s][p:] for s, (_, p) in enumerate(chunks)]).to(device)
            value = torch.cat([pool.v[s][p:] for s, (_, p) in enumerate(chunks)]).to(device)
            got = mod.prefill_attention(
                q.to(device), key, value, pool.kv, 1, starts, plens, pool.tables, scale
            )
            want = torch.cat(
                [
                    reference.dense_attention(
                        q[starts[s] : starts[s + 1]], pool.k[s], pool.v[s], p, scale
                    )
                    for s, (_, p) in enumerate(chunks)
                ]
            )
            checks.close(f"{tag} prefill", got, want, TOLERANCE[dtype])


def attention_invariance(
    checks: Checks,
    mod: ModuleType,
    label: str,
    device: str,
    splits: list[list[int]],
    full: bool = True,
) -> None:
    """tests/unit/test_attention_invariance.py's contract: a decode row's bits do not depend
    on the batch; prefill rows of any chunking equal the decode rows. Not `full` (the
    interpreter): fewer rows and neighbours, and the decode rows in one call."""
    heads, kv_heads, head_dim, bs = (9, 3, 64, 16) if full else (3, 1, 64, 16)
    length = 100 if full else 24
    for dtype in DTYPES:
        gen = torch.Generator().manual_seed(0)
        cache = torch.randn(64, 2, 2, bs, kv_heads, head_dim, generator=gen).to(dtype).to(device)
        blocks = torch.randperm(64, generator=gen).int()
        table, other = blocks[:8].view(1, -1).to(device), blocks[8:16].view(1, -1).to(device)
        q = torch.randn(length, heads, head_dim, generator=gen).to(dtype).to(device)
        noise = torch.randn(200, heads, head_dim, generator=gen).to(dtype).to(device)

        def decode(qs: Tensor, tables: Tensor, lens: list[int], cache: Tensor = cache) -> Tensor:
            lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
            return mod.decode_attention(qs, cache, 1, tables, lens_t, 0.125)

        bad = []
        positions = (0, 1, 15, 16, 17, 40, 63, 64, 99) if full else (0, 17, 23)
        neighbours = ([], [50], [90, 3], [1, 128, 7, 64, 33, 2, 100]) if full else ([], [20, 3])
        for p in positions:
            alone = decode(q[p : p + 1], table, [p + 1])
            for others in neighbours:
                batch = torch.cat([noise[: len(others)], q[p : p + 1]])
                tables = torch.cat([other.expand(len(others), -1), table])
                if not torch.equal(decode(batch, tables, [*others, p + 1])[-1:], alone):
                    bad.append(f"decode row {p} beside {others}")
        checks.equal(f"{label} decode batch-invariant {str(dtype)[6:]}", bad)
        if full:
            decoded = torch.cat([decode(q[p : p + 1], table, [p + 1]) for p in range(length)])
        else:  # one call: the rows' batch-invariance is what the loop above checked
            decoded = decode(q, table.expand(length, -1), list(range(1, length + 1)))
        bad = []
        for split in splits:
            start = 0
            for i, size in enumerate(split):
                end, extra, before = start + size, (i % 3) + 5, i % 2 == 0
                rows = [noise[:extra], q[start:end]] if before else [q[start:end], noise[:extra]]
                lens = [extra + 20, end] if before else [end, extra + 20]
                sizes = [extra, size] if before else [size, extra]
                tables = torch.cat([other, table] if before else [table, other])
                out = mod.prefill_attention(
                    torch.cat(rows),
                    None,
                    None,
                    cache,
                    1,
                    [0, sizes[0], sum(sizes)],
                    lens,
                    tables,
                    0.125,
                )
                got = out[extra:] if before else out[:size]
                if not torch.equal(got, decoded[start:end]):
                    bad.append(f"split {split} chunk {i}")
                start = end
        checks.equal(f"{label} prefill rows == decode rows {str(dtype)[6:]}", bad)


def rows_invariant(
    op: Callable[[Tensor], Tensor], x: Tensor, rows: Sequence[int], splits: Sequence[Sequence[int]]
) -> list[str]:
    """tests/invariance.py's check, returning what differs instead of asserting."""
    full, bad = op(x), []
    for m in rows:
        if not torch.equal(op(x[:m]), full[:m]):
            bad.append(f"first {m} rows")
        start = (len(x) - m) // 2
        if not torch.equal(op(x[start : start + m]), full[start : start + m]):
            bad.append(f"{m} rows at {start}")
    for split in splits:
        if not torch.equal(torch.cat([op(c) for c in x.split(list(split))]), full):
            bad.append(f"split {list(split)}")
    return bad


def dense_layers(checks: Checks, device: str, big: bool) -> None:
    """triton_invariant.linear and rms_norm: values against the references, row invariance.
    `big` (a GPU): every row count and split of the tests and an 8B model's layer shapes;
    else (the interpreter) one shape and fewer row counts."""
    from pdserve.kernels import triton_invariant as ti

    rows, splits = [1, 2, 3, 17, 64, 65, 130], [[130], [1, 129], [17, 64, 49], [65, 65]]
    shapes = [(96, 64, 130), (100, 75, 130), (6144, 4096, 256), (4096, 14336, 64)]
    if not big:
        rows, splits, shapes = [1, 17, 33], [[33, 33]], [(100, 75, 66)]
    for n, k, m in shapes:
        for dtype in DTYPES:
            gen = torch.Generator().manual_seed(n * k)
            w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
            b = torch.randn(n, generator=gen).to(dtype)
            x = torch.randn(m, k, generator=gen).to(dtype)
            wd, bd, xd = w.to(device), b.to(device), x.to(device)
            tag = f"linear {n}x{k} M{m} {str(dtype)[6:]}"
            # The tests' row counts and splits are of 130 rows; other Ms get their own.
            r = rows if m == 130 else [c for c in (1, 16, 64) if c < m]
            s = splits if m == 130 else [[1, m - 1], [m // 2, m - m // 2]]

            def op(t: Tensor, wd: Tensor = wd, bd: Tensor = bd) -> Tensor:
                return ti.linear(t, wd, bd)

            checks.equal(f"{tag} row-invariant", rows_invariant(op, xd, r, s))
            tol = (1e-5 if k < 1000 else 1e-4) if dtype == torch.float32 else 2e-2
            checks.close(tag, ti.linear(xd, wd, bd), reference.linear(xd, wd, bd), tol)
            want32 = reference.linear(xd.double(), wd.double(), bd.double())  # on the device: fast
            checks.close(
                f"{tag} float32 out", ti.linear(xd, wd, bd, float32_out=True), want32, 1e-4
            )
    num_rows = 130 if big else 24  # one program per row: the interpreter gets fewer
    if not big:
        rows, splits = [1, 7], [[12, 12]]
    for hidden in (96, 4096) if big else (96,):
        for dtype in DTYPES:
            gen = torch.Generator().manual_seed(7)
            x = torch.randn(num_rows, hidden, generator=gen).to(dtype)
            res = torch.randn(num_rows, hidden, generator=gen).to(dtype)
            w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
            xd, rd, wd = x.to(device), res.to(device), w.to(device)
            tag = f"rms_norm {hidden} {str(dtype)[6:]}"
            both = torch.cat([xd, rd], dim=1)

            def add_norm(t: Tensor, wd: Tensor = wd, hidden: int = hidden) -> Tensor:
                out, r = ti.rms_norm(t[:, :hidden], wd, 1e-5, t[:, hidden:])
                return torch.cat([out, r], dim=1)  # type: ignore[list-item]

            bad = rows_invariant(lambda t, wd=wd: ti.rms_norm(t, wd, 1e-5)[0], xd, rows, splits)
            checks.equal(f"{tag} row-invariant", bad + rows_invariant(add_norm, both, rows, splits))
            summed = (x.float() + res.float()).to(dtype)
            normed = torch.nn.functional.rms_norm(summed.float(), (hidden,), None, 1e-5)
            want = normed * w.float() if dtype == torch.float32 else normed.to(dtype) * w
            out, _ = ti.rms_norm(xd, wd, 1e-5, rd)
            interpreted = device == "cpu" and dtype == torch.bfloat16  # truncating rounding
            tol = 1e-5 if dtype == torch.float32 else (3e-2 if interpreted else 1e-2)
            checks.close(tag, out, want, tol)


def moe_and_write_kv(checks: Checks, device: str) -> None:
    from pdserve.kernels import attention
    from pdserve.kernels.moe import fused_experts

    gen = torch.Generator().manual_seed(100)
    experts, hidden, inter, tokens = 8, 64, 48, 37
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), 2)
    got = fused_experts(
        x.to(device), w13.to(device), w2.to(device), weights.to(device), ids.to(device)
    )
    checks.close(
        "moe fused_experts float32", got, reference.moe_experts(x, w13, w2, weights, ids), 1e-4
    )
    cache = torch.randn(40, 3, 2, 16, KV_HEADS, 64, generator=gen)
    slots = torch.randperm(40 * 16, generator=gen)[:37]
    key = torch.randn(37, KV_HEADS, 64, generator=gen)
    value = torch.randn(37, KV_HEADS, 64, generator=gen)
    want = cache.clone()
    reference.write_kv(want, 2, key, value, slots)
    got = cache.to(device)
    attention.write_kv(got, 2, key.to(device), value.to(device), slots.to(device))
    checks.equal("write_kv", [] if torch.equal(got.cpu(), want) else ["cache differs"])


def run(ctx: Context) -> dict[str, Any]:
    from pdserve.kernels import cpu_extension, triton_paged

    checks = Checks()
    device = ctx.device
    if ctx.cuda:
        grid = [(g, b, 64) for g in (1, 3, 4) for b in (1, 8, 16)]
        grid += [(3, 16, d) for d in (32, 48, 96, 128, 256)]
        attention_vs_dense(checks, triton_paged, "triton", device, grid, full=True)
        splits = [[17, 23, 1, 59], [99, 1], [100], [1, 99], [16, 16, 16, 52], [5, 72, 23]]
        attention_invariance(checks, triton_paged, "triton", device, splits)
    else:  # interpreted (slow): one config of test_triton_decode_matches_dense, one split
        attention_vs_dense(checks, triton_paged, "triton", device, [(3, 16, 64)], full=False)
        attention_invariance(checks, triton_paged, "triton", device, [[9, 14, 1]], False)
        if cpu_extension.load() is None:
            checks.equal("cpp extension builds", ["the C++ attention extension did not build"])
        else:
            grid = [(1, 1, 64), (3, 8, 64), (4, 16, 128)]  # tests/unit covers the full grid
            attention_vs_dense(checks, cpu_extension, "cpp", device, grid, full=True)
            attention_invariance(checks, cpu_extension, "cpp", device, [[17, 23, 1, 59], [100]])
    dense_layers(checks, device, big=ctx.cuda)
    moe_and_write_kv(checks, device)
    failed = [r for r in checks.rows if not r["ok"]]
    return {
        "status": "failed" if failed else "ok",
        "reason": (
            f"{len(failed)} of {len(checks.rows)} checks failed: "
            + "; ".join(r["name"] for r in failed[:8])
        )
        if failed
        else f"{len(checks.rows)} checks passed",
        "triton_interpreted": not ctx.cuda,
        "checks": len(checks.rows),
        "failures": failed,
        "worst": sorted(
            (r for r in checks.rows if "max_abs_err" in r),
            key=lambda r: r["max_abs_err"] / r["tol"],
        )[-3:],
    }
