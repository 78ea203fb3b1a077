"""Qwen3 and Gemma 3 as data and parts: which layers slide and by how much, the config
fields we refuse (the error names the field and its value), and Gemma's norm, GELU MLP and
rotary tables against transformers' own modules, each row's bits independent of the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from invariance import assert_rows_invariant

from pdserve.common.errors import ModelLoadError
from pdserve.common.models import gemma
from pdserve.common.models.families import (
    FAMILIES,
    family_for,
    layer_windows,
    unmasked_window,
    unsupported_architecture_message,
)

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip


DYNAMIC_ROPE = {
    "full_attention": {"rope_type": "dynamic", "factor": 2.0},
    "sliding_attention": {"rope_type": "default"},
}


def _gemma(**overrides):
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**{**SMALL, "sliding_window": 6, **overrides})
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def _qwen3(**overrides):
    from transformers import Qwen3Config

    config = Qwen3Config(**{**SMALL, **overrides})
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def test_layer_windows_follow_the_config():
    g = _gemma(sliding_window_pattern=2)
    assert layer_windows(g, family_for(g)) == [6, 0, 6, 0]
    g = _gemma(layer_types=["full_attention", "sliding_attention"] * 2)
    assert layer_windows(g, family_for(g)) == [0, 6, 0, 6]
    q = _qwen3()
    assert layer_windows(q, family_for(q)) == [0, 0, 0, 0]
    q = _qwen3(use_sliding_window=True, sliding_window=5, max_window_layers=2)
    assert layer_windows(q, family_for(q)) == [0, 0, 5, 5]


def test_only_unmasked_windows_bound_the_context():
    from transformers import MistralConfig, Qwen2Config

    assert unmasked_window(_gemma()) is None
    assert unmasked_window(_qwen3(use_sliding_window=True, sliding_window=5)) is None
    mistral = MistralConfig(**{**SMALL, "sliding_window": 7})
    mistral.architectures = ["MistralForCausalLM"]
    assert unmasked_window(mistral) == 7
    qwen2 = Qwen2Config(**SMALL)  # use_sliding_window is False by default
    qwen2.architectures = ["Qwen2ForCausalLM"]
    assert unmasked_window(qwen2) is None


@pytest.mark.parametrize(
    ("make", "overrides", "message"),
    [
        (_gemma, {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        (_gemma, {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        (_gemma, {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        (_gemma, {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        (_gemma, {"rope_parameters": DYNAMIC_ROPE}, "rope_parameters.rope_type='dynamic'"),
        (_qwen3, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_variants_we_do_not_build_are_refused_by_field(make, overrides, message):
    config = make(**overrides)
    with pytest.raises(ModelLoadError) as err:
        family_for(config)
    assert message in str(err.value)


def test_odd_layer_kinds_and_missing_windows_are_refused():
    config = _gemma()
    config.layer_types = ["sliding_attention", "chunked_attention", "full_attention", "x"]
    with pytest.raises(ModelLoadError, match=r"layer_types=.*'chunked_attention'"):
        family_for(config)
    config = _gemma(sliding_window_pattern=2)
    config.sliding_window = None
    with pytest.raises(ModelLoadError, match="sliding_window >= 1, got None"):
        family_for(config)


def test_the_multimodal_gemma_is_named():
    assert "Gemma3ForConditionalGeneration" in unsupported_architecture_message(
        ["Gemma3ForConditionalGeneration"]
    )
    assert "Gemma3ForCausalLM" in unsupported_architecture_message(
        ["Gemma3ForConditionalGeneration"]
    )
    assert {"Qwen3ForCausalLM", "Gemma3ForCausalLM"} <= set(FAMILIES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_matches_transformers(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = Gemma3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen) * 0.5)
    weight = gemma.norm_weight(norm.weight.detach())
    x = (torch.randn(37, 64, generator=gen) * 3).to(dtype)
    r = torch.randn(37, 64, generator=gen).to(dtype)
    with torch.no_grad():
        want = norm(x)
        want_sum = norm(x + r)
    got = gemma.rms_norm(x, weight, 1e-6)
    got_sum, residual = gemma.add_rms_norm(x, r.clone(), weight, 1e-6)
    if dtype == torch.float32:  # the engine's float32 RMSNorm kernel may differ in the last bit
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(got_sum, want_sum, atol=2e-6, rtol=2e-6)
    else:  # torch's own ops, as transformers runs them
        assert torch.equal(got, want) and torch.equal(got_sum, want_sum)
    assert torch.equal(residual, x + r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_mlp_matches_transformers_and_is_row_invariant(dtype):
    gen = torch.Generator().manual_seed(1)
    inter = 203  # not a multiple of any vector width: every row has a tail
    x = (torch.randn(300, 2 * inter, generator=gen) * 3).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up  # transformers' `gelu_pytorch_tanh` MLP
    got = gemma.gelu_tanh_and_mul(x)
    torch.testing.assert_close(got, want)  # the dtype's default tolerance
    rows = [1, 2, 3, 7, 16, 33, 64, 100]
    assert_rows_invariant(gemma.gelu_tanh_and_mul, x, rows, [[1, 299], [151, 149], [7, 93, 200]])
    wide = (torch.randn(40, 2 * 6912, generator=gen) * 3).to(dtype)  # past one thread's share
    assert_rows_invariant(gemma.gelu_tanh_and_mul, wide, [1, 3, 5, 17], [[1, 39], [21, 19]])


def test_rope_tables_match_transformers():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = _gemma(
        max_position_embeddings=64,
        sliding_window_pattern=2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        },
    )
    tables = gemma.rope_tables(config, torch.device("cpu"))
    rotary = Gemma3RotaryEmbedding(config)
    positions = torch.arange(64)[None]
    x = torch.zeros(1, 64, 8)
    for kind in ("sliding_attention", "full_attention"):
        cos, sin = rotary(x, positions, kind)
        assert torch.equal(tables[kind][:, 0], cos[0]) and torch.equal(tables[kind][:, 1], sin[0])
    assert not torch.equal(tables["sliding_attention"], tables["full_attention"])
