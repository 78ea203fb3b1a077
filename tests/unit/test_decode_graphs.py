"""Decode steps over CUDA graphs' static, padded inputs (common/decode_graphs.py).

The capture itself needs a GPU (benchmarks/gpu_check.py's engine part compares graph and
eager ids there); here the same padded static buffers run eagerly on the CPU through the
model runner's graph path, which must give exactly the ids of the unpadded eager path."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.config import EngineConfig
from pdserve.common.decode_graphs import DecodeGraphs, StaticDecodeInputs, graph_batch_sizes
from pdserve.common.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("max_batch", "sizes"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (40, [1, 2, 4, 8, 16, 32, 48]),
        (128, [1, 2, 4, 8, *range(16, 129, 16)]),
    ],
)
def test_batch_sizes_cover_every_batch(max_batch: int, sizes: list[int]) -> None:
    assert graph_batch_sizes(max_batch) == sizes
    inputs = StaticDecodeInputs(4, sizes, torch.device("cpu"))
    for batch in range(1, max_batch + 1):
        size = inputs.padded_size(batch)
        assert size is not None and size >= batch
        assert all(s < batch for s in sizes if s < size)  # the smallest that holds it
    assert inputs.padded_size(sizes[-1] + 1) is None


def test_padding_repeats_the_first_row() -> None:
    inputs = StaticDecodeInputs(3, [1, 2, 4, 8], torch.device("cpu"))
    size = inputs.fill([11, 12, 13], [5, 20, 33], [85, 404, 545], [[5], [7, 25], [9, 30, 34]])
    assert size == 4
    assert inputs.input_ids[:4].tolist() == [11, 12, 13, 11]
    assert inputs.positions[:4].tolist() == [5, 20, 33, 5]
    assert inputs.slots[:4].tolist() == [85, 404, 545, 85]
    assert inputs.seq_lens[:4].tolist() == [6, 21, 34, 6]
    assert inputs.block_tables[:4].tolist() == [[5, 0, 0], [7, 25, 0], [9, 30, 34], [5, 0, 0]]
    # A smaller batch afterwards leaves no row of the larger one in its tables.
    assert inputs.fill([1], [40], [99], [[1, 2, 6]]) == 1
    assert inputs.block_tables[:1].tolist() == [[1, 2, 6]]
    with pytest.raises(ValueError, match="no captured size holds a batch of 9"):
        inputs.fill([0] * 9, [0] * 9, [0] * 9, [[0]] * 9)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_graph_path_gives_the_eager_ids(tiny_model_dir, dtype: str) -> None:
    config = dict(model=str(tiny_model_dir), dtype=dtype, kv_cache_tokens=2048, max_num_seqs=8)
    eager = LLMEngine(EngineConfig(**config))
    padded = LLMEngine(EngineConfig(**config))
    runner = padded.runner
    assert runner.decode_graphs is None  # CPU: no capture
    width = -(-padded.max_model_len // runner.block_size)
    runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_cache, 8, width)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (3, 19, 40, 7, 26)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # Batches of 5 (padded to 8), 3 (to 4) and 1, as requests finish at different lengths.
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 4, 9, 2, 12)
    ]
    for batch_params in (params, [greedy]):
        n = len(batch_params)
        want = [o.token_ids for o in eager.generate(prompts[:n], batch_params)]
        got = [o.token_ids for o in padded.generate(prompts[:n], batch_params)]
        assert got == want
    free = padded.kv_cache.num_free_blocks
    assert free == runner.num_blocks  # no block kept by the padded steps
    # Decode-only steps went through the graph path (eagerly here: nothing captured).
    assert runner.decode_graphs.steps >= 11 + 11  # the first token of each comes from prefill
    assert runner.decode_graphs.replays == 0


def test_enforce_eager_from_the_flag_or_the_environment(monkeypatch) -> None:
    import argparse

    from pdserve.services.engine_args import add_engine_args, engine_argv, engine_config

    def parse(*argv: str) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        add_engine_args(p)
        return p.parse_args(list(argv))

    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    assert engine_config(parse()).enforce_eager is False
    args = parse("--enforce-eager")
    assert engine_config(args).enforce_eager is True
    assert "--enforce-eager" in engine_argv(args)  # handed on to a worker's process
    for value, on in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("PDSERVE_ENFORCE_EAGER", value)
        assert engine_config(parse()).enforce_eager is on
