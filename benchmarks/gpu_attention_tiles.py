"""Tile shapes of the Triton paged attention (kernels/triton_paged.py) on a GPU, for an 8B
Llama's heads (32 query heads, 8 kv heads, head dim 128, bf16, 16-token blocks): for each
(TILE_ROWS, KEY_TILE, num_warps) candidate, the time of prefill chunks (TFLOP/s of the causal
attention) and of decode batches (GB/s of the K/V they read), beside torch's
`scaled_dot_product_attention` on the same prompts laid out dense (flash attention: what
the GPU allows without a paged cache) and, with `--baseline FILE`, an older version of the
module loaded from FILE. Each candidate is also checked for the determinism contract:
every row of a 1024-token prompt prefilled whole, and prefilled in chunks, has the bits of
the same row decoded alone. Prints one JSON object (and writes it to
$OUT/gpu_attention_tiles.json when $OUT is set).

    python3 benchmarks/gpu_attention_tiles.py [--quick] [--baseline old_triton_paged.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SCALE = HEAD_DIM**-0.5
PREFILLS = {  # name: (chunk tokens, context before the chunk) per sequence
    "8x1024": [(1024, 0)] * 8,
    "1x8192": [(8192, 0)],
    "chunk 512 after 3584": [(512, 3584)] * 2,
}
DECODES = {"b1 ctx8192": (1, 8192), "b64 ctx1024": (64, 1024), "b256 ctx128": (256, 128)}
CONFIGS = [(16, 64, 4), (32, 64, 4), (64, 32, 4), (64, 64, 4), (64, 128, 4), (64, 64, 8),
           (128, 64, 8), (128, 32, 8), (128, 128, 8)]  # fmt: skip
QUICK = [(64, 64, 4), (128, 64, 8), (32, 64, 4)]


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"attention_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Pool:
    """One layer's paged K/V cache with random contents and random block tables."""

    def __init__(self, blocks: int, device: str) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        shape = (blocks, 1, 2, BLOCK, KV_HEADS, HEAD_DIM)
        self.kv = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
        self.perm = torch.randperm(blocks, generator=gen, device=device).int()
        self.used = 0
        self.device = device

    def table(self, tokens: int) -> torch.Tensor:
        n = -(-tokens // BLOCK)
        if self.used + n > self.perm.numel():  # tables of earlier calls may be reused
            self.used = 0
        table = self.perm[self.used : self.used + n]
        self.used += n
        return table

    def tables(self, lens: list[int]) -> torch.Tensor:
        width = max(-(-n // BLOCK) for n in lens)
        rows = [F.pad(self.table(n), (0, width - (-(-n // BLOCK)))) for n in lens]
        return torch.stack(rows)


def time_us(fn: Any) -> float:
    import triton.testing

    return round(1000 * triton.testing.do_bench(fn, warmup=10, rep=50), 1)


def prefill_call(mod: ModuleType, pool: Pool, chunks: list[tuple[int, int]], gen: Any) -> Any:
    total = sum(c for c, _ in chunks)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen, device=pool.device).bfloat16()
    lens = [c + before for c, before in chunks]
    tables = pool.tables(lens)
    starts = [0]
    for c, _ in chunks:
        starts.append(starts[-1] + c)
    return lambda: mod.prefill_attention(q, None, None, pool.kv, 0, starts, lens, tables, SCALE)


def causal_flops(chunks: list[tuple[int, int]]) -> float:
    # QK^T and PV: 2 x 2 x HEAD_DIM per (query, key) pair a row attends to.
    pairs = sum(c * before + c * (c + 1) / 2 for c, before in chunks)
    return 4 * HEAD_DIM * HEADS * pairs


def contract_holds(mod: ModuleType, pool: Pool, gen: Any) -> bool:
    """Rows of a 1024-token prompt: prefilled whole, in chunks [300, 1, 723], and decoded one
    by one (all 1024 in one batched decode call): the same bits."""
    n = 1024
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen, device=pool.device).bfloat16()
    table = pool.table(n).view(1, -1)
    whole = mod.prefill_attention(q, None, None, pool.kv, 0, [0, n], [n], table, SCALE)
    parts, start = [], 0
    for size in (300, 1, 723):
        end = start + size
        parts.append(mod.prefill_attention(
            q[start:end], None, None, pool.kv, 0, [0, size], [end], table, SCALE
        ))  # fmt: skip
        start = end
    lens = torch.arange(1, n + 1, dtype=torch.int32, device=pool.device)
    decoded = mod.decode_attention(q, pool.kv, 0, table.expand(n, -1), lens, SCALE)
    return torch.equal(whole, decoded) and torch.equal(torch.cat(parts), decoded)


def measure(mod: ModuleType, pool: Pool) -> dict[str, Any]:
    gen = torch.Generator(device=pool.device).manual_seed(1)
    row: dict[str, Any] = {"contract_holds": contract_holds(mod, pool, gen)}
    for name, chunks in PREFILLS.items():
        us = time_us(prefill_call(mod, pool, chunks, gen))
        row[f"prefill {name} us"] = us
        row[f"prefill {name} tflops"] = round(causal_flops(chunks) / us / 1e6, 1)
    for name, (batch, ctx) in DECODES.items():
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=pool.device).bfloat16()
        tables = pool.tables([ctx] * batch)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=pool.device)
        us = time_us(lambda: mod.decode_attention(q, pool.kv, 0, tables, lens, SCALE))  # noqa: B023
        kv_bytes = batch * ctx * 2 * KV_HEADS * HEAD_DIM * 2
        row[f"decode {name} us"] = us
        row[f"decode {name} gb_per_s"] = round(kv_bytes / us / 1e3, 1)
    pool.used = 0
    return row


def flash_reference(device: str) -> dict[str, Any]:
    """torch's scaled_dot_product_attention (flash) on the fresh prompts, laid out dense."""
    gen = torch.Generator(device=device).manual_seed(2)
    row = {}
    for name, chunks in PREFILLS.items():
        if any(before for _, before in chunks):
            continue
        b, t = len(chunks), chunks[0][0]
        q = torch.randn(b, HEADS, t, HEAD_DIM, generator=gen, device=device).bfloat16()
        k = torch.randn(b, KV_HEADS, t, HEAD_DIM, generator=gen, device=device).bfloat16()
        v = torch.randn_like(k)
        us = time_us(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: B023
        )
        row[f"prefill {name} us"] = us
        row[f"prefill {name} tflops"] = round(causal_flops(chunks) / us / 1e6, 1)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"only the candidates {QUICK}")
    p.add_argument("--baseline", type=Path, help="an older triton_paged.py to time beside")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_attention_tiles: needs a CUDA GPU", file=sys.stderr)
        return 2
    from pdserve.kernels import triton_paged

    device = "cuda"
    pool = Pool(8192, device)
    defaults = (triton_paged.TILE_ROWS, triton_paged.KEY_TILE, triton_paged.NUM_WARPS)
    key_bytes = triton_paged.KEY_TILE_BYTES
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "default": defaults}
    result["flash_sdpa"] = flash_reference(device)
    if args.baseline:
        result["baseline"] = measure(load_module(args.baseline), pool)
    configs = {}
    for rows, keys, warps in QUICK if args.quick else CONFIGS:
        triton_paged.TILE_ROWS, triton_paged.KEY_TILE, triton_paged.NUM_WARPS = rows, keys, warps
        triton_paged.KEY_TILE_BYTES = max(key_bytes, keys * HEAD_DIM * 2)  # bf16: no cap
        name = f"rows {rows} keys {keys} warps {warps}"
        configs[name] = measure(triton_paged, pool)
        print(json.dumps({name: configs[name]}), file=sys.stderr)  # progress, in the log
    triton_paged.TILE_ROWS, triton_paged.KEY_TILE, triton_paged.NUM_WARPS = defaults
    triton_paged.KEY_TILE_BYTES = key_bytes
    result["configs"] = configs
    text = json.dumps(result, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_attention_tiles.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
