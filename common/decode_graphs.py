"""Decode steps replayed as CUDA graphs: the model runner's fast path for decode-only batches
on a GPU.

A decode step of a large model on a GPU launches a few hundred small kernels (a dozen per
layer), and launching them from Python costs more than running them at small batches. As
in vLLM and SGLang, the forward pass of a decode-only batch is captured once per batch size
(1, 2, 4, 8, then every 16 up to the largest batch the scheduler forms) into a CUDA graph
over static input buffers, and each step copies its inputs into those buffers and replays
the graph of the smallest size that holds the batch.

Padding rows repeat the batch's first row (its token, position, KV slot, block table and
length): every kernel on the serving path is batch-invariant, so a padding row computes the
very bits of the first row, and its K/V written to the same slot are the same bytes. The
real rows' results therefore never depend on the padding, and the graph gives the same ids
as the eager forward (tested). `StaticDecodeInputs` is that padding, over buffers of any
device; `DecodeGraphs` captures and replays on CUDA (`--enforce-eager` turns it off)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from pdserve.common.models.attention import AttentionMetadata
from pdserve.common.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then multiples of 16, the last >= max_batch."""
    sizes = [s for s in SMALL_SIZES if s < max_batch]
    if max_batch <= SMALL_SIZES[-1]:
        return [*sizes, max_batch]
    return sizes + list(range(SIZE_STEP, max_batch + SIZE_STEP - 1, SIZE_STEP))


class StaticDecodeInputs:
    """The decode step's inputs in fixed buffers of as many rows as the largest of `sizes`
    (block tables `max_blocks` wide), filled for a batch padded to one of `sizes`."""

    def __init__(self, max_blocks: int, sizes: Sequence[int], device: torch.device) -> None:
        self.sizes = sorted(sizes)
        self.max_blocks = max_blocks
        rows = self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((rows, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self._no_prefills = torch.zeros((0, max_blocks), dtype=torch.int32, device=device)
        # Host staging (pinned on a GPU, so the copies do not wait for the host): filled
        # through numpy, then one asynchronous copy per buffer. A step's copies are done
        # before the next fill, since sampling waits for the step's results.
        pin = device.type == "cuda"
        self._host_rows = torch.zeros((3, rows), dtype=torch.int64, pin_memory=pin)
        self._host_lens = torch.zeros(rows, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros((rows, max_blocks), dtype=torch.int32, pin_memory=pin)

    def padded_size(self, batch: int) -> int | None:
        """The smallest size holding `batch` rows, or None if none does."""
        return next((s for s in self.sizes if s >= batch), None)

    def fits(self, batch: int, widest_table: int) -> bool:
        return self.padded_size(batch) is not None and widest_table <= self.max_blocks

    def fill(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_ids: Sequence[Sequence[int]],
    ) -> int:
        """Copy one decode batch in (row b: `tokens[b]` at `positions[b]`, K/V to
        `slots[b]`, blocks `block_ids[b]`), padded with copies of row 0 up to its size;
        returns the size."""
        n = len(tokens)
        size = self.padded_size(n)
        if n == 0 or size is None:
            raise ValueError(f"no captured size holds a batch of {n}")
        rows, lens, tables = (
            self._host_rows.numpy(),
            self._host_lens.numpy(),
            self._host_tables.numpy()[:size],
        )
        rows[0, :n], rows[1, :n], rows[2, :n] = tokens, positions, slots
        rows[:, n:size] = rows[:, :1]
        lens[:size] = rows[1, :size] + 1
        tables.fill(0)
        for b, ids in enumerate(block_ids):
            tables[b, : len(ids)] = ids
        tables[n:] = tables[0]
        for buf, host in (
            (self.input_ids, self._host_rows[0]),
            (self.positions, self._host_rows[1]),
            (self.slots, self._host_rows[2]),
            (self.seq_lens, self._host_lens),
            (self.block_tables, self._host_tables),
        ):
            buf[:size].copy_(host[:size], non_blocking=True)
        return size

    def metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decode_tokens=size,
            decode_block_tables=self.block_tables[:size],
            decode_seq_lens=self.seq_lens[:size],
            prefill_query_start_loc=[0],
            prefill_seq_lens=[],
            prefill_block_tables=self._no_prefills,
        )

    def forward(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, size: int) -> torch.Tensor:
        """The eager forward over the first `size` rows: [size, hidden]."""
        return model.forward(
            self.input_ids[:size], self.positions[:size], self.metadata(size), kv_cache
        )


class DecodeGraphs:
    """One CUDA graph per batch size of `StaticDecodeInputs`, sharing one memory pool.

    Captured at start-up, before any request: the warm-up and capture runs write K/V of
    token 0 at slot 0 (block 0), which no request holds yet."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        max_batch: int,
        max_blocks: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.inputs = StaticDecodeInputs(max_blocks, graph_batch_sizes(max_batch), kv_cache.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.steps = 0  # decode steps run over the static inputs
        self.replays = 0  # of which replayed from a graph
        self.capture_s = 0.0

    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its pool)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.kv_cache.device)
        for size in reversed(self.inputs.sizes):
            # Warm up outside the graph (Triton compiles, cuBLAS picks, allocator grows).
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.inputs.forward(self.model, self.kv_cache, size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.inputs.forward(self.model, self.kv_cache, size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.kv_cache.device)
        self.capture_s = time.perf_counter() - start
        logger.info(
            "CUDA graphs: %d decode batch sizes (up to %d) captured in %.1f s",
            len(self.graphs), self.inputs.sizes[-1], self.capture_s,
        )  # fmt: skip

    def fits(self, batch: int, widest_table: int) -> bool:
        return self.inputs.fits(batch, widest_table)

    def run(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Hidden states of the batch's rows, [len(tokens), hidden] (a view of the graph's
        output: read it before the next step)."""
        size = self.inputs.fill(tokens, positions, slots, block_ids)
        self.steps += 1
        graph = self.graphs.get(size)
        if graph is None:  # not captured (a CPU engine in the tests): the same rows eagerly
            return self.inputs.forward(self.model, self.kv_cache, size)[: len(tokens)]
        graph.replay()
        self.replays += 1
        return self.outputs[size][: len(tokens)]
