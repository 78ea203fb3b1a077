"""Decode steps' layers in one C++ call (kernels/dense_layers.py) against the per-op path.

The loop calls the same kernel functions as the per-op Python path, so a request's tokens
and log-probabilities (the logits' bits) must be equal with it on and off, at every batch
size and with q/k/v biases (qwen2)."""

from __future__ import annotations

import copy

import pytest
import torch

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.models.llama import dense_layer_stack
from pdserve.common.sampling_params import SamplingParams
from pdserve.kernels import attention, dense_layers, fused_ops, invariant_gemm

pytestmark = pytest.mark.skipif(
    dense_layers.load() is None, reason="the C++ extensions did not build"
)


def _served_dtypes() -> list[str]:
    return [d for d in ("float32", "bfloat16") if fused_ops.fast_kernels(getattr(torch, d))]


def _run(model_dir, dtype: str, prompts, params, monkeypatch, loop: bool):
    monkeypatch.setenv(dense_layers.LOOP_ENV, "1" if loop else "0")
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), dtype=dtype, kv_cache_tokens=2048, max_num_seqs=8)
    )
    calls = []
    forward = dense_layers.forward

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])  # the batch's rows
        return forward(*args, **kwargs)

    monkeypatch.setattr(dense_layers, "forward", counted)
    outs = engine.generate(prompts, params)
    monkeypatch.setattr(dense_layers, "forward", forward)
    assert engine.kv_cache.num_free_blocks == engine.runner.num_blocks  # nothing leaked
    return [(o.token_ids, o.logprobs) for o in outs], calls


@pytest.mark.parametrize("dtype", _served_dtypes())
def test_layer_loop_gives_the_per_op_bits(tiny_model_dir, dtype: str, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 33, 17, 2, 40)]
    # Requests finish at different lengths: decode batches of 5, then fewer, down to 1.
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3)
        for n in (14, 3, 9, 6, 11)
    ]
    looped, calls = _run(tiny_model_dir, dtype, prompts, params, monkeypatch, loop=True)
    per_op, none = _run(tiny_model_dir, dtype, prompts, params, monkeypatch, loop=False)
    assert looped == per_op
    assert none == []
    # The loop served the decode-only steps, at several batch sizes.
    assert len(calls) >= 13 and {1, 5} <= set(calls)


def test_an_override_keeps_the_per_op_path(monkeypatch) -> None:
    x = torch.zeros(2, 64)
    monkeypatch.delenv(dense_layers.LOOP_ENV, raising=False)
    monkeypatch.delenv(attention.BACKEND_ENV, raising=False)
    monkeypatch.delenv(fused_ops.FUSED_ENV, raising=False)
    assert dense_layers.switched_on(x)
    for env, value in (
        (dense_layers.LOOP_ENV, "0"),
        (attention.BACKEND_ENV, "torch"),
        (fused_ops.FUSED_ENV, "0"),
        (invariant_gemm.INVARIANT_ENV, "0"),
    ):
        monkeypatch.setenv(env, value)
        assert not dense_layers.switched_on(x), env
        monkeypatch.delenv(env)


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_layers_the_loop_cannot_take_keep_the_per_op_path(tiny_model_dir) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_tokens=512)
    )
    model = engine.runner.model
    hidden = model.embed[:1]
    assert dense_layer_stack(model.layers, hidden) is not None
    # One layer's MLP of another width (the loop takes one width per kind of linear).
    narrow = copy.copy(model.layers[1].mlp.gate_up)
    narrow.out_features -= 32
    layers = [copy.copy(w) for w in model.layers]
    layers[1].mlp = copy.copy(layers[1].mlp)
    layers[1].mlp.gate_up = narrow
    assert dense_layer_stack(layers, hidden) is None
    # A q/k norm between the projection and rotary, or a GPU tensor: not the loop's either.
    layers = [copy.copy(w) for w in model.layers]
    layers[0].q_norm = layers[0].k_norm = torch.ones(model.head_dim)
    assert dense_layer_stack(layers, hidden) is None
    assert dense_layer_stack(model.layers, hidden.to("meta")) is None
