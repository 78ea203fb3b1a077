"""Our forward pass for the Llama family (Llama, Mistral, Qwen2 with its q/k/v bias, Qwen3,
Gemma 3) and the mixture-of-experts models built on the same decoder layer (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE): what differs between them is data in `families.py`, the
feed-forward part of each layer (dense MLP or MoE block) comes from `moe.py`, and Gemma's
norms, GELU MLP and per-kind rotary tables from `gemma.py`.

The model runner calls `forward` once per engine step on a flattened batch: every scheduled
token of every request in one [T] vector with its position and its KV slot. Each layer writes
the new tokens' K/V into the paged cache, then attends over the cache (decode tokens straight
from the blocks, prefill chunks over the cached prefix plus themselves). Only the positions
that sample a token go through the LM head (`compute_logits`).

Weights come from the Hugging Face state dict; q/k/v and gate/up are fused into one matmul
each. Families with q/k norms (OLMoE over the whole projection, Qwen3 and Gemma 3 per head)
apply them, and OLMoE's optional clamp, between the qkv matmul and the rotary embedding.
Sliding-window layers (Gemma 3's local layers, Qwen3's where configured) pass their window
to the attention kernels, which mask each query to it; their KV blocks stay allocated.
Arithmetic follows transformers' Llama (RMSNorm in float32, rotate-half RoPE), which
is the oracle the tests compare against."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from pdserve.common.models import gemma
from pdserve.common.models.attention import AttentionMetadata, paged_attention
from pdserve.common.models.expert_parallel import ExpertShard
from pdserve.common.models.expert_stats import ExpertTokenCounter
from pdserve.common.models.families import FULL, family_for, layer_windows
from pdserve.common.models.linear import Linear
from pdserve.common.models.moe import DenseMlp, Mlp, SparseMoeBlock, load_mlp
from pdserve.common.models.tensor_parallel import (
    RowParallel,
    TensorShard,
    check_model,
    gather_vocab,
    head_rows,
    sum_exact,
)
from pdserve.kernels import dense_layers
from pdserve.kernels import fused_ops as fused


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear | RowParallel
    post_norm: torch.Tensor
    mlp: Mlp | gemma.GeluMlp
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # Gemma: post_norm follows attention, these two surround the MLP.
    pre_ff_norm: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None


def dense_layer_stack(
    layers: list[LayerWeights], hidden: torch.Tensor
) -> dense_layers.LayerStack | None:
    """The one-call layer loop's stack for `layers` when they are of its shape (dense MLPs,
    no q/k norms, no tensor-parallel linears) and the kernel serves their weights and
    `hidden` (any rows of the model's activations); None otherwise (the per-op path)."""
    if any(not isinstance(w.mlp, DenseMlp) or w.q_norm is not None for w in layers):
        return None
    dense = [
        dense_layers.DenseLayer(
            w.input_norm, w.qkv, w.o_proj, w.post_norm, w.mlp.gate_up, w.mlp.down
        )
        for w in layers
    ]
    linears = [getattr(layer, kind) for layer in dense for kind in dense_layers.LINEARS]
    if not all(isinstance(lin, Linear) for lin in linears):
        return None
    return dense_layers.stack_for(dense, hidden)


class LlamaForCausalLM:
    def __init__(
        self,
        config: PretrainedConfig,
        state_dict: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        expert_shard: ExpertShard | None = None,
        tensor_shard: TensorShard | None = None,
    ) -> None:
        """`expert_shard`: expert parallelism; each MoE layer loads only this rank's experts.
        `tensor_shard`: tensor parallelism; every layer loads only this rank's heads, MLP
        rows and vocabulary range (`tensor_parallel.py`)."""
        self.family = family_for(config)
        self.num_layers = config.num_hidden_layers
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        tp = tensor_shard if tensor_shard is not None and tensor_shard.world_size > 1 else None
        self.tp = tp
        q_heads = range(config.num_attention_heads)
        kv_heads = range(config.num_key_value_heads)
        if tp is not None:
            check_model(config, self.family.name, self.family.moe is not None,
                        self.family.qk_norm, tp.world_size)  # fmt: skip
            q_heads = tp.q_heads(config.num_attention_heads, config.num_key_value_heads)
            kv_heads = tp.kv_heads(config.num_key_value_heads)
        self.num_heads = len(q_heads)
        self.num_kv_heads = len(kv_heads)
        q_rows = head_rows(q_heads, self.head_dim) if tp is not None else None
        kv_rows = head_rows(kv_heads, self.head_dim) if tp is not None else None
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        gemma_layers = self.family.gemma
        if gemma_layers:
            self.scale = float(config.query_pre_attn_scalar) ** -0.5
        # Per layer: its sliding window (0: full attention).
        self.windows = layer_windows(config, self.family)
        self._norm = gemma.rms_norm if gemma_layers else fused.rms_norm
        self._add_norm = gemma.add_rms_norm if gemma_layers else fused.add_rms_norm
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        clip = getattr(config, "clip_qkv", None) if self.family.clip_qkv else None
        self.clip_qkv: float | None = clip

        def take(
            name: str, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None
        ) -> torch.Tensor:
            tensor = state_dict[name]
            if rows is not None:  # only these rows leave the memory-mapped checkpoint
                tensor = tensor.index_select(0, rows)
            if cols is not None:
                tensor = tensor.index_select(1, cols)
            return tensor.to(device=device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor:  # Gemma's scale by (1 + w) in float32
            return gemma.norm_weight(take(name)) if gemma_layers else take(name)

        self.vocab_size = state_dict["model.embed_tokens.weight"].shape[0]
        vocab = tp.vocab_range(self.vocab_size) if tp is not None else range(self.vocab_size)
        self.vocab_start = vocab.start
        vocab_rows = torch.arange(vocab.start, vocab.stop) if tp is not None else None
        self.embed = take("model.embed_tokens.weight", vocab_rows)
        # Gemma scales the embeddings by sqrt(hidden_size), rounded to the weights' dtype.
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype) if gemma_layers else None
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in state_dict
        head = self.embed if tied else take("lm_head.weight", vocab_rows)
        if tp is not None:  # every rank's range as wide, for the gather
            width = tp.vocab_width(self.vocab_size)
            head = torch.cat([head, head.new_zeros((width - head.shape[0], head.shape[1]))])
        self.lm_head = Linear(head, float32_out=True)
        self.final_norm = norm("model.norm.weight")
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            heads = (("q", q_rows), ("k", kv_rows), ("v", kv_rows))  # this rank's rows
            bias = None
            if p + "self_attn.q_proj.bias" in state_dict:
                bias = torch.cat(
                    [take(p + f"self_attn.{n}_proj.bias", r) for n, r in heads]
                ).contiguous()
            extras = {}  # q/k norms; Gemma's norms around the MLP
            if self.family.qk_norm != "none":
                extras = {n: norm(p + f"self_attn.{n}.weight") for n in ("q_norm", "k_norm")}
            mlp = load_mlp(config, self.family, i, take, state_dict, expert_shard, tp)
            if gemma_layers:
                assert isinstance(mlp, DenseMlp)
                mlp = gemma.GeluMlp.of(mlp)
                extras["pre_ff_norm"] = norm(p + "pre_feedforward_layernorm.weight")
                extras["post_ff_norm"] = norm(p + "post_feedforward_layernorm.weight")
            o_bias = p + "self_attn.o_proj.bias"
            self.layers.append(
                LayerWeights(
                    input_norm=norm(p + "input_layernorm.weight"),
                    qkv=Linear(
                        torch.cat([take(p + f"self_attn.{n}_proj.weight", r) for n, r in heads]),
                        bias,
                    ),
                    o_proj=self._row_parallel(
                        take(p + "self_attn.o_proj.weight", cols=q_rows),
                        take(o_bias) if o_bias in state_dict else None,
                    ),
                    post_norm=norm(p + "post_attention_layernorm.weight"),
                    mlp=mlp,
                    **extras,
                )
            )
        # Per layer, its rotary table: Gemma's local and global layers differ.
        if gemma_layers:
            tables = gemma.rope_tables(config, device)
            self.layer_cos_sin = [tables[kind] for kind in config.layer_types]
            self.cos_sin = tables.get(FULL, self.layer_cos_sin[0])
        else:
            self.cos_sin = self._rope_cache(config, device)
            self.layer_cos_sin = [self.cos_sin] * self.num_layers
        # The decode steps' one-call layer loop (kernels/dense_layers), made at the first
        # decode-only step: False where it does not serve this model.
        self._layer_stack: dense_layers.LayerStack | bool | None = None

    def _row_parallel(
        self, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> Linear | RowParallel:
        if self.tp is None:
            return Linear(weight, bias)
        return RowParallel(weight, bias, self.tp)

    def _rope_cache(self, config: PretrainedConfig, device: torch.device) -> torch.Tensor:
        """cos and sin for every position, [max_pos, 2, head_dim], in float32; the inverse
        frequencies (and any RoPE scaling) come from transformers' own rotary module."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rotary = LlamaRotaryEmbedding(config=config)
        inv_freq = rotary.inv_freq.float()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        cos_sin = torch.stack([emb.cos() * scaling, emb.sin() * scaling], dim=1)
        return cos_sin.to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states after the final norm for every token, [T, hidden]."""
        num_tokens = input_ids.shape[0]
        residual = self._embed(input_ids)
        stack = self._layer_loop(residual, meta)
        if stack is not None:
            shape = (self.num_heads, self.num_kv_heads, self.head_dim)
            return dense_layers.forward(stack, residual, self.final_norm, positions,
                                        self.cos_sin, kv_cache, meta, shape, self.scale,
                                        self.eps)  # fmt: skip
        hidden: torch.Tensor | None = None
        rotated_heads = self.num_heads + self.num_kv_heads
        eps = self.eps
        for layer_idx, w in enumerate(self.layers):
            if hidden is None:
                x = self._norm(residual, w.input_norm, eps)
            else:
                x, residual = self._add_norm(hidden, residual, w.input_norm, eps)
            qkv = w.qkv(x)
            if w.q_norm is not None or self.clip_qkv is not None:
                qkv = self._qk_norm_and_clip(qkv, w)
            cos_sin = self.layer_cos_sin[layer_idx]
            qkv = fused.rotary(qkv, positions, cos_sin, rotated_heads, self.head_dim)
            qkv = qkv.view(num_tokens, -1, self.head_dim)
            q = qkv[:, : self.num_heads]
            k = qkv[:, self.num_heads : rotated_heads]
            v = qkv[:, rotated_heads:]
            attn = paged_attention(
                q, k, v, kv_cache, layer_idx, meta, self.scale, self.windows[layer_idx]
            )
            hidden = w.o_proj(attn.reshape(num_tokens, self.q_size))
            if w.pre_ff_norm is None:
                x, residual = self._add_norm(hidden, residual, w.post_norm, eps)
            else:  # Gemma: norm the attention's output, then the MLP's input
                hidden = self._norm(hidden, w.post_norm, eps)
                x, residual = self._add_norm(hidden, residual, w.pre_ff_norm, eps)
            hidden = w.mlp(x)
            if w.post_ff_norm is not None:
                hidden = self._norm(hidden, w.post_ff_norm, eps)
        assert hidden is not None
        return self._add_norm(hidden, residual, self.final_norm, eps)[0]

    def _layer_loop(
        self, residual: torch.Tensor, meta: AttentionMetadata
    ) -> dense_layers.LayerStack | None:
        """The layer stack when this step's layers run as one C++ call: a decode-only batch
        of a dense model with no q/k/v clamp or tensor parallelism, nothing switched off."""
        if (
            self._layer_stack is False
            or meta.num_decode_tokens != residual.shape[0]
            or residual.shape[0] == 0
            or not dense_layers.switched_on(residual)
        ):
            return None
        if self._layer_stack is None:
            eligible = self.tp is None and self.clip_qkv is None and not any(self.windows)
            stack = dense_layer_stack(self.layers, residual) if eligible else None
            self._layer_stack = False if stack is None else stack
        return self._layer_stack or None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            rows = F.embedding(input_ids, self.embed)
        else:
            local = input_ids - self.vocab_start
            mine = (local >= 0) & (local < self.embed.shape[0])
            rows = F.embedding(local.clamp(0, self.embed.shape[0] - 1), self.embed)
            rows = sum_exact(torch.where(mine[:, None], rows, torch.zeros_like(rows)), self.tp)
        return rows if self.embed_scale is None else rows * self.embed_scale

    def _qk_norm_and_clip(self, qkv: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """RMSNorm of q and k (over the whole projection, or per head), then the clamp of
        q, k and v; returns a new contiguous [T, q + 2 kv] tensor."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        if w.q_norm is not None and w.k_norm is not None:
            if self.family.qk_norm == "per_head":
                d = self.head_dim
                q = self._norm(q.reshape(-1, d), w.q_norm, self.eps).view(q.shape)
                k = self._norm(k.reshape(-1, d), w.k_norm, self.eps).view(k.shape)
            else:
                q = fused.rms_norm(q.contiguous(), w.q_norm, self.eps)
                k = fused.rms_norm(k.contiguous(), w.k_norm, self.eps)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        return torch.cat([q, k, v], dim=1)

    def idle_forward(self) -> None:
        """Expert parallelism: a rank with no tokens this step still joins every MoE layer's
        exchange (with an empty batch) so the other ranks do not wait forever."""
        empty = self.embed.new_empty((0, self.embed.shape[1]))
        for block in self.moe_blocks():
            block(empty)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [w.mlp for w in self.layers if isinstance(w.mlp, SparseMoeBlock)]

    def enable_expert_counting(self) -> ExpertTokenCounter | None:
        """Count tokens per expert per layer from now on; None for a dense model."""
        blocks = self.moe_blocks()
        if not blocks:
            return None
        counter = ExpertTokenCounter(self.num_layers, blocks[0].num_experts, self.embed.device)
        for block in blocks:
            block.counter = counter
        return counter

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab]; under tensor parallelism every rank calls it (the
        ranges are gathered) and every rank gets all of them."""
        logits = self.lm_head(hidden).float()
        if self.tp is None:
            return logits
        return gather_vocab(logits, self.tp, self.vocab_size)
