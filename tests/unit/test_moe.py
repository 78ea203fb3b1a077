"""Mixture-of-experts parts without a model: the fused expert path against the per-token
reference on random shapes (skewed routings, idle experts, 16-bit dtypes), each family's
router and whole MoE block against transformers' own modules, the expert token counter and
imbalance figure, and clear errors for variants we do not run."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.errors import ModelLoadError
from pdserve.common.models.expert_stats import ExpertTokenCounter, imbalance, rank_loads
from pdserve.common.models.families import FAMILIES, family_for
from pdserve.common.models.moe import SparseMoeBlock, load_mlp
from pdserve.kernels import moe as moe_kernels
from pdserve.kernels import reference
from pdserve.kernels.invariant_gemm import PackedStack


def _random_experts(num_tokens, hidden, inter, num_experts, top_k, dtype, seed, skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    if skew:  # most tokens pick experts 0 and 1; many experts get nothing
        scores[:, :2] += 4.0
    weights, ids = torch.topk(torch.softmax(scores, dim=-1), top_k, dim=-1)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(
    ("num_tokens", "hidden", "inter", "num_experts", "top_k", "dtype", "skew"),
    [
        (1, 16, 32, 8, 2, torch.float32, False),  # one decode token
        (3, 32, 16, 16, 2, torch.float32, False),  # most experts idle
        (37, 64, 48, 16, 2, torch.float32, False),
        (50, 32, 64, 8, 4, torch.float32, True),  # skewed: two hot experts
        (64, 48, 24, 8, 1, torch.float32, False),  # top-1
        (29, 64, 32, 8, 2, torch.bfloat16, True),
        (17, 32, 32, 16, 2, torch.float16, False),
    ],
)
def test_fused_experts_match_per_token_reference(
    num_tokens, hidden, inter, num_experts, top_k, dtype, skew
):
    x, w13, w2, weights, ids = _random_experts(
        num_tokens, hidden, inter, num_experts, top_k, dtype, seed=num_tokens, skew=skew
    )
    expected = reference.moe_experts(x, w13, w2, weights, ids)
    got = moe_kernels.fused_experts(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    scale = expected.abs().max().item()
    assert (got.float() - expected).abs().max().item() <= tol * max(scale, 1.0)


def test_fused_experts_group_by_expert():
    ids = torch.tensor([[3, 0], [0, 3], [1, 0]])
    order = moe_kernels.sort_by_expert(ids, num_experts=4)
    assert order.counts == [3, 1, 0, 2]
    # Sorted rows: expert 0 (tokens 0, 1, 2 in batch order), expert 1 (token 2), expert 3.
    assert order.tokens.tolist() == [0, 1, 2, 2, 0, 1]
    assert (ids.reshape(-1)[order.order].diff() >= 0).all()


def test_fused_experts_empty_batch():
    x, w13, w2, weights, ids = _random_experts(0, 16, 8, 4, 2, torch.float32, seed=1)
    assert moe_kernels.fused_experts(x, w13, w2, weights, ids).shape == (0, 16)


def test_backend_override_runs_the_reference(monkeypatch):
    x, w13, w2, weights, ids = _random_experts(9, 16, 8, 4, 2, torch.float32, seed=2)
    monkeypatch.setenv(moe_kernels.BACKEND_ENV, "reference")
    forced = moe_kernels.experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(forced, reference.moe_experts(x, w13, w2, weights, ids))


def _tiny_config(family: str, **overrides):
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    cls, extra = {
        "mixtral": (MixtralConfig, dict(intermediate_size=48, num_local_experts=8)),
        "qwen2_moe": (Qwen2MoeConfig, dict(intermediate_size=48, moe_intermediate_size=24,
                                           shared_expert_intermediate_size=40, num_experts=8)),
        "qwen3_moe": (Qwen3MoeConfig, dict(intermediate_size=48, moe_intermediate_size=24,
                                           num_experts=16)),
        "olmoe": (OlmoeConfig, dict(intermediate_size=24, num_experts=8)),
    }[family]  # fmt: skip
    config = cls(**{**common, **extra, **overrides})
    config.architectures = [next(a for a, f in FAMILIES.items() if f.name == family)]
    config._experts_implementation = "eager"
    return config


def _reference_block(config):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls = {
        "mixtral": MixtralSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock,
        "qwen3_moe": Qwen3MoeSparseMoeBlock, "olmoe": OlmoeSparseMoeBlock,
    }[config.model_type]  # fmt: skip
    torch.manual_seed(3)
    block = cls(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("mixtral", {}),
        ("qwen2_moe", {}),  # shared expert with its sigmoid gate; no renormalisation
        ("qwen2_moe", {"norm_topk_prob": True}),
        ("qwen3_moe", {"norm_topk_prob": True}),
        ("olmoe", {}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_matches_transformers(family, overrides, dtype):
    """Our block built from the module's state dict (stacked expert layout) picks the
    module's experts exactly, with its weights and output to rounding."""
    config = _tiny_config(family, **overrides)
    ref = _reference_block(config).to(dtype)
    prefix = "model.layers.0." + FAMILIES[config.architectures[0]].moe.block + "."  # type: ignore[union-attr]
    state = {prefix + k: v for k, v in ref.state_dict().items()}
    ours = load_mlp(config, family_for(config), 0, lambda n: state[n].contiguous(), state)
    assert isinstance(ours, SparseMoeBlock)
    x = torch.randn(1, 23, config.hidden_size, generator=torch.Generator().manual_seed(5))
    x = x.to(dtype)
    with torch.no_grad():
        _, ref_weights, ref_ids = ref.gate(x.view(-1, config.hidden_size))
        expected = ref(x)[0]
    weights, ids = ours.router(x[0])
    assert torch.equal(ids, ref_ids)
    assert weights.dtype == ref_weights.dtype
    # The router's logits come from the batch-invariant GEMM, whose reduction order is its
    # own, not the BLAS's transformers calls (MKL's differs by host: on AMD EPYC by an ulp
    # in float32), so the weights match to rounding; the expert ids match exactly.
    torch.testing.assert_close(weights, ref_weights)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours(x[0]), expected, **tol)


def test_expert_token_counter_and_imbalance():
    counter = ExpertTokenCounter(num_layers=3, num_experts=4, device=torch.device("cpu"))
    counter.add(0, torch.tensor([[0, 1], [0, 3]]))
    counter.add(2, torch.tensor([[2, 1]]))
    counter.add(0, torch.tensor([[0, 2]]))
    counts = counter.snapshot()
    assert counts.tolist() == [[3, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0]]
    assert rank_loads(counts[0], 2).tolist() == [4, 2]
    assert imbalance(counts, 2).tolist() == pytest.approx([4 / 3, 1.0, 1.0])
    assert imbalance(counts[0], 4).item() == pytest.approx(3 / 1.5)
    with pytest.raises(ValueError, match="divide"):
        imbalance(counts, 3)
    counter.reset()
    assert counter.snapshot().sum().item() == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("mixtral", {"sliding_window": 16}, "sliding-window"),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8}, "sliding-window"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3_moe", {"num_experts_per_tok": 17}, "num_experts_per_tok"),
    ],
)
def test_unsupported_moe_variants_fail_clearly(family, overrides, message):
    with pytest.raises(ModelLoadError, match=message):
        family_for(_tiny_config(family, **overrides))


def test_unsupported_moe_architecture_is_named(tmp_path):
    import json

    from pdserve.common.model_files import resolve_model

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ModelLoadError, match=r"mixture-of-experts .*DeepseekV3.*Mixtral"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_an_expert_parallel_rank_loads_only_its_own_experts(layout):
    """Rank 1 of 2 (8 experts, 2 redundant slots): the block holds exactly its slots'
    experts, and no other expert's weights were ever taken from the checkpoint."""
    from pdserve.common.models.expert_parallel import ExpertShard

    config = _tiny_config("mixtral")
    ref = _reference_block(config)
    prefix = "model.layers.0.block_sparse_moe."
    stacked = {prefix + k: v for k, v in ref.state_dict().items()}
    w13_all = stacked[prefix + "experts.gate_up_proj"]
    w2_all = stacked[prefix + "experts.down_proj"]
    state = dict(stacked)
    if layout == "per_expert":  # as Mixtral checkpoints are published: w1 (gate), w3 (up), w2
        inter = config.intermediate_size
        for key in (prefix + "experts.gate_up_proj", prefix + "experts.down_proj"):
            del state[key]
        for e in range(config.num_local_experts):
            state[prefix + f"experts.{e}.w1.weight"] = w13_all[e, :inter]
            state[prefix + f"experts.{e}.w3.weight"] = w13_all[e, inter:]
            state[prefix + f"experts.{e}.w2.weight"] = w2_all[e]
    taken: list[tuple[str, list[int] | None]] = []

    def take(name: str, rows: torch.Tensor | None = None) -> torch.Tensor:
        taken.append((name, None if rows is None else rows.tolist()))
        tensor = state[name]
        return (tensor if rows is None else tensor.index_select(0, rows)).contiguous()

    shard = ExpertShard(rank=1, world_size=2, num_experts=8, redundant=2)
    block = load_mlp(config, family_for(config), 0, take, state, shard)
    assert isinstance(block, SparseMoeBlock) and block.shard is shard
    mine = shard.local_experts(block.slots).tolist()
    assert len(mine) == 5  # (8 + 2) / 2 slots
    w13, w2 = (w.unpacked() if isinstance(w, PackedStack) else w for w in (block.w13, block.w2))
    assert torch.equal(w13, w13_all[mine]) and torch.equal(w2, w2_all[mine])
    expert_keys = [(n, rows) for n, rows in taken if ".experts" in n]
    if layout == "stacked":
        assert all(rows == mine for _, rows in expert_keys), expert_keys
    else:
        loaded = {int(n.split("experts.")[1].split(".")[0]) for n, _ in expert_keys}
        assert loaded == set(mine), f"took experts {sorted(loaded)}, holds {mine}"
