"""The architecture families the engine runs, and how they differ, as data.

`check_architecture` (at model resolution) asks `SUPPORTED_ARCHITECTURES`; the model loader
asks `family_for(config)` which parts a checkpoint's layers have: a dense gated MLP or a
sparse mixture-of-experts block, where the MoE weights live in the state dict, how the
router normalises its top-k weights, whether there is a shared expert, which q/k norm
the attention uses, and Gemma 3's decoder-layer differences (norms around attention and the
MLP, (1 + weight) RMSNorm, scaled embeddings, the GELU MLP, the query scale, a rotary base
per layer kind). `layer_windows` says which layers attend over a sliding window. One
forward pass (`llama.py`) serves every family from these switches; a config field that
would change the math in a way we do not build is refused naming the field and its value.

No torch import here: the CLI checks a model folder before loading anything heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pdserve.common.errors import ModelLoadError

QkNorm = Literal["none", "full", "per_head"]
SLIDING, FULL = "sliding_attention", "full_attention"  # config `layer_types` entries


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
    # The config field naming the MLP's activation, and the activations we build for it.
    act_attr: str = "hidden_act"
    acts: tuple[str, ...] = ("silu",)
    # Sliding-window layers (config `layer_types` / `sliding_window`) are masked; otherwise a
    # window in effect bounds the context instead (`unmasked_window`).
    sliding_layers: bool = False
    # Gemma: RMSNorm scales by (1 + weight) in float32; a norm after attention and before
    # and after the MLP; embeddings times sqrt(hidden_size); the query scale from
    # `query_pre_attn_scalar`; a rotary table per layer kind (`rope_local_base_freq`).
    gemma: bool = False


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
    "Qwen3ForCausalLM": ModelFamily("qwen3", qk_norm="per_head", sliding_layers=True),
    "Gemma3ForCausalLM": ModelFamily(
        "gemma3",
        qk_norm="per_head",
        act_attr="hidden_activation",
        acts=("gelu_pytorch_tanh",),
        sliding_layers=True,
        gemma=True,
    ),
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


# Architectures whose text decoder we run under another name, for a precise error.
TEXT_ONLY = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


def unsupported_architecture_message(architectures: list[str] | str) -> str:
    names = architectures if isinstance(architectures, list) else [architectures]
    multimodal = [a for a in names if a in TEXT_ONLY]
    if multimodal:
        return (
            f"model: architecture {multimodal[0]!r} (image and text) is not supported; its "
            f"text-only checkpoints ({TEXT_ONLY[multimodal[0]]}) are"
        )
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
    if family.sliding_layers or family.gemma:
        _check_dense_variant(config, family)
    return family


def _check_dense_variant(config: Any, family: ModelFamily) -> None:
    """Qwen3 and Gemma 3: refuse, naming the field and its value, what would change the math
    in a way the forward pass does not build."""
    arch = f"{family.name} model"
    act = getattr(config, family.act_attr, None)
    if act not in family.acts:
        raise ModelLoadError(
            f"model: {arch} with {family.act_attr}={act!r} is not supported "
            f"({', '.join(family.acts)} only)"
        )
    kinds = list(getattr(config, "layer_types", None) or [])
    odd = [k for k in kinds if k not in (SLIDING, FULL)]
    if odd or (kinds and len(kinds) != config.num_hidden_layers):
        raise ModelLoadError(
            f"model: {arch} with layer_types={kinds!r} is not supported (one of "
            f"{SLIDING!r} or {FULL!r} per layer)"
        )
    window = getattr(config, "sliding_window", None)
    if SLIDING in kinds and not (isinstance(window, int) and window >= 1):
        raise ModelLoadError(
            f"model: {arch} with sliding layers needs sliding_window >= 1, got {window!r}"
        )
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise ModelLoadError(
                f"model: {arch} with {name}={getattr(config, name)!r} is not supported "
                "(set it to null)"
            )
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelLoadError(
            f"model: {arch} with use_bidirectional_attention=True is not supported "
            "(causal attention only)"
        )
    params = getattr(config, "rope_parameters", None) or {}
    per_kind = params.values() if family.gemma else [params]
    for rope in per_kind:
        kind = (rope or {}).get("rope_type", "default")
        if kind in ("dynamic", "longrope"):  # rescaled with the sequence length at run time
            raise ModelLoadError(
                f"model: {arch} with rope_parameters.rope_type={kind!r} is not supported"
            )


def layer_windows(config: Any, family: ModelFamily) -> list[int]:
    """Per decoder layer, the sliding window its attention is masked to (0: full causal
    attention); all 0 for a family whose windows we do not mask (`unmasked_window`)."""
    kinds = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None) or 0
    if not family.sliding_layers or not kinds:
        return [0] * config.num_hidden_layers
    return [window if kind == SLIDING else 0 for kind in kinds]


def unmasked_window(config: Any) -> int | None:
    """The sliding window a model's config puts in effect where its family does not mask it:
    we then attend over the whole context, so a prompt and its output must fit in the
    window. None where there is none, or the family masks it (Qwen3, Gemma 3)."""
    names = list(getattr(config, "architectures", None) or [])
    family = next((FAMILIES[a] for a in names if a in FAMILIES), None)
    if family is not None and family.sliding_layers:
        return None
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return int(window)
    return None


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
