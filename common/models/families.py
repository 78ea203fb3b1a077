"""The architecture families the engine runs, and how they differ, as data.

`check_architecture` (at model resolution) asks `SUPPORTED_ARCHITECTURES`; the model loader
asks `family_for(config)` which parts a checkpoint's layers have: a dense gated MLP or a
sparse mixture-of-experts block, where the MoE weights live in the state dict, how the
router normalises its top-k weights, whether there is a shared expert, and which q/k norm
the attention uses. One forward pass (`llama.py`) serves every family from these switches.

No torch import here: the CLI checks a model folder before loading anything heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pdserve.common.errors import ModelLoadError

QkNorm = Literal["none", "full", "per_head"]


@dataclass(frozen=True)
class MoeSpec:
    """Where a family keeps its MoE weights and how its router turns logits into weights."""

    block: str  # the layer's MoE module: "mlp" or "block_sparse_moe"
    num_experts_attr: str  # config field holding the number of routed experts
    intermediate_attr: str  # config field holding one expert's intermediate size
    gate_name: str  # per-expert weight names (legacy per-expert checkpoint layout)
    up_name: str
    down_name: str
    # Renormalise the top-k softmax weights to sum to one: always (None: the config's
    # `norm_topk_prob` decides).
    always_renormalize: bool
    # Cast the top-k weights back to the activation dtype before weighting the experts'
    # outputs (otherwise they stay float32 and the product is rounded once).
    cast_weights: bool
    shared_expert: bool = False  # a dense expert every token takes, scaled by sigmoid(gate)
    # Some layers may stay dense (config `decoder_sparse_step`, `mlp_only_layers`).
    sparse_step: bool = False


@dataclass(frozen=True)
class ModelFamily:
    name: str
    qk_norm: QkNorm = "none"
    clip_qkv: bool = False  # config `clip_qkv` clamps q, k, v after the norms
    moe: MoeSpec | None = None


_QWEN_EXPERTS = dict(
    block="mlp",
    num_experts_attr="num_experts",
    gate_name="gate_proj",
    up_name="up_proj",
    down_name="down_proj",
    always_renormalize=False,
    cast_weights=True,
)

FAMILIES: dict[str, ModelFamily] = {
    "LlamaForCausalLM": ModelFamily("llama"),
    "MistralForCausalLM": ModelFamily("mistral"),
    "Qwen2ForCausalLM": ModelFamily("qwen2"),
    "MixtralForCausalLM": ModelFamily(
        "mixtral",
        moe=MoeSpec(
            block="block_sparse_moe",
            num_experts_attr="num_local_experts",
            intermediate_attr="intermediate_size",
            gate_name="w1",
            up_name="w3",
            down_name="w2",
            always_renormalize=True,
            cast_weights=False,
        ),
    ),
    "Qwen2MoeForCausalLM": ModelFamily(
        "qwen2_moe",
        moe=MoeSpec(
            **_QWEN_EXPERTS,  # type: ignore[arg-type]
            intermediate_attr="moe_intermediate_size",
            shared_expert=True,
            sparse_step=True,
        ),
    ),
    "Qwen3MoeForCausalLM": ModelFamily(
        "qwen3_moe",
        qk_norm="per_head",
        moe=MoeSpec(
            **_QWEN_EXPERTS,  # type: ignore[arg-type]
            intermediate_attr="moe_intermediate_size",
            sparse_step=True,
        ),
    ),
    "OlmoeForCausalLM": ModelFamily(
        "olmoe",
        qk_norm="full",
        clip_qkv=True,
        moe=MoeSpec(**_QWEN_EXPERTS, intermediate_attr="intermediate_size"),  # type: ignore[arg-type]
    ),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
MOE_ARCHITECTURES = tuple(a for a, f in FAMILIES.items() if f.moe is not None)
# Mixture-of-experts architectures we recognise but do not run, for a precise error.
KNOWN_UNSUPPORTED_MOE = (
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "PhimoeForCausalLM",
    "JetMoeForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM",
    "DbrxForCausalLM", "Glm4MoeForCausalLM", "HunYuanMoEV1ForCausalLM", "Ernie4_5_MoeForCausalLM",
    "Qwen3NextForCausalLM", "GptOssForCausalLM", "Llama4ForCausalLM",
)  # fmt: skip


def unsupported_architecture_message(architectures: list[str] | str) -> str:
    names = architectures if isinstance(architectures, list) else [architectures]
    moe = [a for a in names if a in KNOWN_UNSUPPORTED_MOE]
    if moe:
        return (
            f"model: mixture-of-experts architecture {moe[0]!r} is not supported "
            f"(supported MoE: {', '.join(MOE_ARCHITECTURES)}; dense: "
            f"{', '.join(a for a in SUPPORTED_ARCHITECTURES if a not in MOE_ARCHITECTURES)})"
        )
    return (
        f"model: architecture {architectures!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    )


def family_for(config: Any) -> ModelFamily:
    """The family of a loaded config; raises ModelLoadError naming the field for an
    architecture or a variant of one that the forward pass does not implement."""
    names = list(getattr(config, "architectures", None) or [])
    family = next((FAMILIES[a] for a in names if a in FAMILIES), None)
    if family is None:
        raise ModelLoadError(unsupported_architecture_message(names or config.model_type))
    if family.moe is not None:
        _check_moe_variant(config, family)
    return family


def _check_moe_variant(config: Any, family: ModelFamily) -> None:
    arch = f"{family.name} model"
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"model: {arch} with hidden_act={act!r} is not supported (silu only)")
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    if "sliding_attention" in layer_types or (
        window and window < getattr(config, "max_position_embeddings", 0)
    ):
        raise ModelLoadError(
            f"model: {arch} with sliding-window attention (sliding_window={window}) is not "
            "supported: set sliding_window to null or use_sliding_window to false"
        )
    spec = family.moe
    assert spec is not None
    experts = getattr(config, spec.num_experts_attr, 0) or 0
    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    if experts < 1 or not 1 <= top_k <= experts:
        raise ModelLoadError(
            f"model: {arch} needs 1 <= num_experts_per_tok <= {spec.num_experts_attr}, "
            f"got {top_k} and {experts}"
        )
    if family.qk_norm == "full" and (
        config.num_attention_heads * _head_dim(config) != config.hidden_size
    ):
        raise ModelLoadError(
            f"model: {arch} with num_attention_heads * head_dim != hidden_size is not supported"
        )


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def is_sparse_layer(config: Any, family: ModelFamily, layer: int) -> bool:
    """Whether decoder layer `layer` has an MoE block (else a dense MLP)."""
    if family.moe is None:
        return False
    if not family.moe.sparse_step:
        return True
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer not in (getattr(config, "mlp_only_layers", None) or []) and (layer + 1) % step == 0
