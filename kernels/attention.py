"""Public attention API of pdserve: the only entry points the model runner calls.

For every layer of every step the model runner stores the new tokens' K/V with `write_kv`,
then calls `prefill_attention` for prefill chunks and `decode_attention` for decoding
sequences. Each call picks the best backend for the tensors' device and dtype:

* cpu: the C++ extension (`cpu_extension`) for all three calls when it built; otherwise the
  vectorised torch backend (`torch_paged`);
* cuda: the Triton backend (`triton_paged`: batch-invariant, decode and prefill by one
  kernel) when triton is installed and `PDSERVE_BATCH_INVARIANT` is not 0; otherwise (and on
  any other device) the torch backend.

A sliding-window layer passes `window` (> 0): each query then attends to the last `window`
positions of its context only; every backend masks it (0, the default, is full causal
attention).

``PDSERVE_ATTENTION_BACKEND=reference|torch|cpp|triton`` forces one backend for every call
(tests, benchmarks, debugging; ``triton``: the Triton decode kernel, torch for the rest); it
is read at each call, so it can be changed at run time.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch
from torch import Tensor

from pdserve.kernels import cpu_extension, invariant_gemm, reference, torch_paged

BACKEND_ENV = "PDSERVE_ATTENTION_BACKEND"
_FORCED = {"reference": reference, "torch": torch_paged, "cpp": cpu_extension, "triton": None}


def backend_for(tensor: Tensor) -> ModuleType:
    """The backend module that serves calls on `tensor` (honouring the override)."""
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        if forced not in _FORCED:
            raise ValueError(f"{BACKEND_ENV}={forced!r}: expected one of {sorted(_FORCED)}")
        module = _FORCED[forced]
        if module is None:  # imported on demand: triton is optional
            module = importlib.import_module("pdserve.kernels.triton_paged")
        if module is cpu_extension and tensor.device.type != "cpu":
            raise ValueError(f"{BACKEND_ENV}=cpp only serves cpu tensors, got {tensor.device}")
        return module
    if tensor.device.type == "cpu" and cpu_extension.load() is not None:
        return cpu_extension
    if tensor.device.type == "cuda" and invariant_gemm.enabled():
        module = importlib.import_module("pdserve.kernels.triton_paged")
        if module.AVAILABLE:
            return module
    return torch_paged


def write_kv(
    kv_cache: Tensor, layer: int, key: Tensor, value: Tensor, slot_mapping: Tensor
) -> None:
    """Store key/value [T, KVH, D] of `layer` at slots ``slot_mapping`` [T] (int64,
    ``block_id * block_size + offset``) of ``kv_cache``
    [num_blocks, num_layers, 2, block_size, KVH, D]."""
    backend_for(kv_cache).write_kv(kv_cache, layer, key, value, slot_mapping)


def decode_attention(
    query: Tensor,
    kv_cache: Tensor,
    layer: int,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int = 0,
) -> Tensor:
    """Attention of one query token per sequence, query [B, H, D] at position
    ``seq_lens[b] - 1`` (its K/V already written), over positions ``[0, seq_lens[b])`` (the
    last `window` of them when `window` > 0) found through ``block_tables`` [B, max_blocks]
    int32. seq_lens [B] int32. Returns [B, H, D]."""
    backend = backend_for(query)
    if window <= 0:
        return backend.decode_attention(query, kv_cache, layer, block_tables, seq_lens, scale)
    if backend is cpu_extension:
        return _cpp(query, kv_cache, layer, block_tables, seq_lens, None, scale, window)
    return backend.decode_attention(
        query, kv_cache, layer, block_tables, seq_lens, scale, window=window
    )


def prefill_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    layer: int,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: Tensor,
    scale: float,
    window: int = 0,
) -> Tensor:
    """Causal attention of S flattened prefill chunks: query [T, H, D], key/value [T, KVH, D]
    (already written to the cache). Sequence s owns rows ``query_start_loc[s]:[s + 1]``, the
    last q_len of its ``seq_lens[s]`` positions; earlier ones come from ``block_tables[s]``.
    With `window` > 0 each row attends to the last `window` positions of its context.
    Returns [T, H, D]."""
    backend = backend_for(query)
    args = (query, key, value, kv_cache, layer, query_start_loc, seq_lens, block_tables, scale)
    if window <= 0:
        return backend.prefill_attention(*args)
    if backend is cpu_extension:
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        starts = torch.tensor(query_start_loc, dtype=torch.int32)
        return _cpp(query, kv_cache, layer, block_tables, lens, starts, scale, window)
    return backend.prefill_attention(*args, window=window)


def _cpp(
    query: Tensor,
    kv_cache: Tensor,
    layer: int,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor | None,
    scale: float,
    window: int,
) -> Tensor:
    """The C++ kernel of a sliding-window layer: decode (`query_start_loc` None) or prefill,
    read straight from the blocks."""
    ext = cpu_extension.load()
    if ext is None:
        raise RuntimeError("the pdserve CPU attention extension could not be built")
    tables = block_tables.to(torch.int32)
    lens = seq_lens.to(torch.int32)
    return ext.paged_attention(query, kv_cache, layer, tables, lens, query_start_loc, scale, window)
