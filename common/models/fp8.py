"""FP8 checkpoints, between reading the safetensors and building the model (`ModelRunner`).

Two layouts on disk, both with Linear weights in float8_e4m3fn and float32 scales beside them
(weight ≈ fp8 * the scale of its block):

- transformers' `fp8` (`quantization_config.quant_method: "fp8"`, DeepSeek-V3's): one
  `<name>.weight_scale_inv` per `weight_block_size` block, [ceil(N/bn), ceil(K/bk)] (edge
  blocks may be partial); a scalar when `weight_block_size` is null.
- compressed-tensors' float8 (`quant_method: "compressed-tensors"`, `format:
  "float-quantized"`): `<name>.weight_scale` per tensor [1], per output channel [N, 1], per
  group of `group_size` columns [N, K/g], or per `block_structure` block.

`load_weights` turns them into what the model loads. On CPU (and a GPU without FP8 matmuls)
every quantized weight is de-quantized once, in float32, then cast to the engine's dtype: the
model sees an ordinary checkpoint, and in float32 it is the same model as the de-quantized
checkpoint. On CUDA of compute capability 8.9 or more (Ada, Hopper) the weights stay FP8 as
`Fp8Weight`s, which the model's loader slices, concatenates and moves like any weight;
`Linear` then multiplies them with `torch._scaled_mm` (`Fp8Linear`), quantizing activations
as the checkpoint's dynamic scheme does: per token, and per token and block of columns for
block-wise `fp8` weights (DeepSeek-V3's 1x128). A compressed-tensors checkpoint of weights
alone, or with one activation scale per batch, is de-quantized on every device. The kept path
is not batch-invariant on a GPU (the library picks its kernel by the number of rows). A weight
that meets any other op (MoE experts stacked into one tensor) is de-quantized there.

Config fields that would change the math in a way not built here are refused, naming the
field and its value."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pdserve.common.errors import ModelLoadError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_FLOAT8_NAMES = "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu"
FLOAT8_DTYPES = tuple(getattr(torch, n) for n in _FLOAT8_NAMES.split() if hasattr(torch, n))
_ACT_EPS = 1e-12  # the smallest activation scale (an all-zero row)


@dataclass(frozen=True)
class Fp8Scheme:
    """How one checkpoint stores its FP8 weights."""

    scale_name: str  # beside `<module>.weight`: "weight_scale_inv" or "weight_scale"
    strategy: str  # "tensor", "channel", "group" or "block"
    block: tuple[int, int] | None = None  # rows, columns under one scale ("group": 1, g)
    # How the checkpoint quantizes activations on the fly: one scale per token ("token"),
    # per token and group of the weight's block columns ("group"), or None: not at all, or
    # in a way no FP8 matmul here computes (its weights are de-quantized on every device).
    activations: str | None = "token"

    def block_of(self, rows: int, cols: int) -> tuple[int, int]:
        if self.strategy == "tensor":
            return rows, cols
        if self.strategy == "channel":
            return 1, cols
        assert self.block is not None
        return self.block


def _refuse(field: str, value: Any, supported: str) -> ModelLoadError:
    return ModelLoadError(
        f"model: quantization_config.{field}={value!r} is not supported ({supported})"
    )


def scheme_of(quant: Mapping[str, Any] | Any | None) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme from config.json's `quantization_config` (None: not
    quantized); raises ModelLoadError naming the field for any variant not built."""
    if quant is None:
        return None
    if not isinstance(quant, Mapping):  # a transformers QuantizationConfig
        quant = quant.to_dict()
    method = quant.get("quant_method")
    if method == "fp8":
        return _fine_grained(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    raise _refuse("quant_method", method, "'fp8' and 'compressed-tensors' float8 only")


def _block(value: Any, field: str) -> tuple[int, int]:
    ok = isinstance(value, list | tuple) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise _refuse(field, value, "two positive integers: rows, columns")
    return int(value[0]), int(value[1])


def _fine_grained(quant: Mapping[str, Any]) -> Fp8Scheme:
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse("activation_scheme", scheme, "'dynamic' only: static scales are not built")
    for field, built in (("scale_fmt", "float"), ("expert_dtype", "fp8")):
        value = quant.get(field, built)
        if value != built:
            raise _refuse(field, value, f"{built!r} only")
    if quant.get("modules_to_convert"):
        value = quant["modules_to_convert"]
        raise _refuse("modules_to_convert", value, "null only: FP8 embeddings are not built")
    block = quant.get("weight_block_size", [128, 128])  # transformers' default when absent
    if block is None:  # one scale per tensor; activations per token
        return Fp8Scheme("weight_scale_inv", "tensor")
    # Activations per token and block of columns (DeepSeek-V3's 1x128).
    return Fp8Scheme("weight_scale_inv", "block", _block(block, "weight_block_size"), "group")


def _compressed_tensors(quant: Mapping[str, Any]) -> Fp8Scheme:
    fmt = quant.get("format")
    if fmt != "float-quantized":
        raise _refuse("format", fmt, "'float-quantized' only")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if quant.get(field):
            raise _refuse(field, quant[field], "null only")
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse("config_groups", groups, "one or more float8 weight groups")
    schemes = {_ct_group(f"config_groups.{name}", group) for name, group in groups.items()}
    if len(schemes) > 1:
        raise _refuse("config_groups", sorted(groups), "groups of one weight scheme only")
    return schemes.pop()


def _ct_group(path: str, group: Mapping[str, Any]) -> Fp8Scheme:
    fmt = group.get("format")
    if fmt not in (None, "float-quantized"):
        raise _refuse(f"{path}.format", fmt, "'float-quantized' only")
    weights = group.get("weights") or {}
    float8 = (("type", "float"), ("num_bits", 8))
    for field, built in (*float8, ("symmetric", True), ("dynamic", False)):
        value = weights.get(field, built)
        if value != built:
            raise _refuse(f"{path}.weights.{field}", value, f"{built!r} only")
    strategy = weights.get("strategy")
    block = None
    if strategy == "group":
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise _refuse(f"{path}.weights.group_size", size, "a positive integer")
        block = (1, size)
    elif strategy == "block":
        block = _block(weights.get("block_structure"), f"{path}.weights.block_structure")
    elif strategy not in ("tensor", "channel"):
        raise _refuse(f"{path}.weights.strategy", strategy, "tensor, channel, group or block")
    if group.get("output_activations") is not None:
        value = group["output_activations"]
        raise _refuse(f"{path}.output_activations", value, "null only")
    acts = group.get("input_activations")
    return Fp8Scheme("weight_scale", strategy, block, _ct_activations(path, acts, block))


def _ct_activations(
    path: str, acts: Mapping[str, Any] | None, block: tuple[int, int] | None
) -> str | None:
    """The kept path's activation quantization for a compressed-tensors group."""
    if acts is None:  # weights only
        return None
    path = f"{path}.input_activations"
    if acts.get("dynamic") is not True:
        raise _refuse(f"{path}.dynamic", acts.get("dynamic"), "True only: static scales")
    for field, built in (("type", "float"), ("num_bits", 8)):
        if acts.get(field, built) != built:
            raise _refuse(f"{path}.{field}", acts.get(field), f"{built!r} only")
    strategy = acts.get("strategy")
    if strategy == "token":
        return "token"
    if strategy == "group" and block is not None and acts.get("group_size") == block[1]:
        return "group"
    if strategy in ("tensor", "group"):  # one scale for a whole batch; unaligned groups
        return None
    raise _refuse(f"{path}.strategy", strategy, "token, tensor or group")


def computes_fp8(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 matrices (`torch._scaled_mm`, row-wise scales):
    CUDA of compute capability 8.9 or more."""
    return (
        device.type == "cuda"
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


def load_weights(
    state: dict[str, torch.Tensor],
    quantization_config: Mapping[str, Any] | Any | None,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The state dict the model loads: each FP8 weight (with its scale) de-quantized to
    `dtype`, or kept as an `Fp8Weight` where `device` computes FP8. Takes `state` apart."""
    scheme = scheme_of(quantization_config)
    if scheme is None:
        stray = next((n for n, t in state.items() if t.dtype in FLOAT8_DTYPES), None)
        if stray is not None:
            raise ModelLoadError(
                f"model: tensor {stray!r} is {_name(state[stray].dtype)} but config.json has "
                "no quantization_config"
            )
        return state
    keep = computes_fp8(device)
    scale_suffix = "." + scheme.scale_name
    out: dict[str, torch.Tensor] = {}
    for name in list(state):
        if name.endswith(scale_suffix):
            continue  # taken with its weight
        tensor = state.pop(name)
        scale_key = name.removesuffix("weight") + scheme.scale_name
        scale = state.pop(scale_key, None) if name.endswith(".weight") else None
        if scale is None and tensor.dtype not in FLOAT8_DTYPES:
            out[name] = tensor  # not quantized (embeddings, norms, layers left out)
            continue
        if not name.endswith(".weight"):
            raise ModelLoadError(
                f"model: tensor {name!r} of dtype {_name(tensor.dtype)} is not supported "
                "(FP8 Linear weights only)"
            )
        _check_weight(name, tensor, scale, scale_key)
        assert scale is not None
        rows, cols = tensor.shape
        block_rows, block_cols = scheme.block_of(rows, cols)
        row_scales = _row_scales(name, scale, rows, cols, block_rows, block_cols)
        group = min(block_cols, cols)
        if keep and scheme.activations is not None and _servable(rows, cols, group):
            per_group = scheme.activations == "group"
            out[name] = Fp8Weight(tensor, row_scales, group, per_group, dtype)
        else:
            out[name] = dequantize(tensor, row_scales, group).to(dtype)
    stray = [n for n in state if n.endswith(scale_suffix)]  # a scale with no weight
    if stray:
        raise ModelLoadError(f"model: tensor {stray[0]!r} scales no FP8 weight")
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_weight(
    name: str, tensor: torch.Tensor, scale: torch.Tensor | None, scale_key: str
) -> None:
    if tensor.dtype != FP8:
        raise ModelLoadError(
            f"model: tensor {name!r} of dtype {_name(tensor.dtype)} is not supported as a "
            "quantized weight (float8_e4m3fn only)"
        )
    if scale is None:
        raise ModelLoadError(f"model: tensor {name!r} is float8_e4m3fn with no {scale_key!r}")
    if tensor.ndim != 2:
        raise ModelLoadError(
            f"model: tensor {name!r} of shape {list(tensor.shape)} is not supported as an FP8 "
            "weight (2-D Linear weights only)"
        )
    if not scale.dtype.is_floating_point or scale.dtype in FLOAT8_DTYPES:
        raise ModelLoadError(
            f"model: tensor {scale_key!r} of dtype {_name(scale.dtype)} is not supported "
            "(float32, bfloat16 or float16 scales)"
        )


def _row_scales(
    name: str, scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int
) -> torch.Tensor:
    """[rows, groups] float32: each row's scale for every group of `block_cols` columns."""
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    if [s for s in scale.shape if s != 1] != [s for s in grid if s != 1]:
        raise ModelLoadError(
            f"model: tensor {name!r} of shape {[rows, cols]} has scales of shape "
            f"{list(scale.shape)}, not {list(grid)} (blocks of {block_rows}x{block_cols})"
        )
    scale = scale.float().reshape(grid)
    return scale.repeat_interleave(block_rows, dim=0)[:rows].contiguous()


def dequantize(qdata: torch.Tensor, row_scales: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [N, K]: each FP8 value times the float32 scale of its row and column group."""
    weight = qdata.float()
    rows, cols = weight.shape
    if cols % group == 0:
        weight.view(rows, cols // group, group).mul_(row_scales.unsqueeze(-1))
    else:
        weight.mul_(row_scales.repeat_interleave(group, dim=1)[:, :cols])
    return weight


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: [M, K] -> FP8 values and float32 scales [M, 1], each
    row's largest magnitude at the FP8 maximum."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=_ACT_EPS)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _servable(rows: int, cols: int, group: int) -> bool:
    """Whether `_scaled_mm` takes the weight's shapes (multiples of 16, whole groups)."""
    return rows % 16 == 0 and cols % 16 == 0 and cols % group == 0 and group % 16 == 0


class Fp8Weight(torch.Tensor):
    """An [N, K] weight kept in FP8 for the device's FP8 matmul: `qdata` float8_e4m3fn,
    `scale` float32 [N, K / group], one per row and `group` columns; `per_group`: the
    activations take a scale per token and group (else one per token). It poses as a
    tensor of the engine's dtype; moving it, selecting rows (or columns, with one group per
    row) and concatenating rows keep it FP8, any other op sees it de-quantized."""

    qdata: torch.Tensor
    scale: torch.Tensor
    group: int
    per_group: bool

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, group: int, per_group: bool,
                dtype: torch.dtype):  # fmt: skip
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=dtype, device=qdata.device
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, group: int, per_group: bool,
                 dtype: torch.dtype) -> None:  # fmt: skip
        self.qdata, self.scale, self.group, self.per_group = qdata, scale, group, per_group

    def like(self, qdata: torch.Tensor, scale: torch.Tensor, group: int | None = None,
             dtype: torch.dtype | None = None) -> Fp8Weight:  # fmt: skip
        """Another FP8 weight of this one's kind."""
        return Fp8Weight(qdata, scale, group or self.group, self.per_group, dtype or self.dtype)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"Fp8Weight(shape={list(self.shape)}, group={self.group}, dtype={_name(self.dtype)}, "
            f"device={self.device})"
        )

    def dequantize(self) -> torch.Tensor:  # type: ignore[override]
        return dequantize(self.qdata, self.scale, self.group).to(self.dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        handler = _KEPT_OPS.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not None:
                return out
        args, kwargs = pytree.tree_map_only(Fp8Weight, Fp8Weight.dequantize, (args, kwargs))
        return func(*args, **kwargs)


def _to_copy(w: Fp8Weight, dtype: torch.dtype | None = None, device=None, **_: Any) -> Fp8Weight:
    device = w.device if device is None else device
    return w.like(w.qdata.to(device), w.scale.to(device), dtype=dtype)


def _index_select(w: Fp8Weight, dim: int, index: torch.Tensor) -> Fp8Weight | None:
    if dim % 2 == 0:
        return w.like(w.qdata.index_select(0, index), w.scale.index_select(0, index))
    if w.scale.shape[1] == 1:  # one group per row: the columns keep their rows' scales
        return w.like(w.qdata.index_select(1, index), w.scale, group=index.numel())
    return None


def _cat(tensors: list[torch.Tensor], dim: int = 0) -> Fp8Weight | None:
    first = tensors[0]
    if (
        dim % 2 != 0
        or not isinstance(first, Fp8Weight)
        or not all(isinstance(t, Fp8Weight) for t in tensors)
        or len({(t.group, t.per_group, t.scale.shape[1], t.dtype) for t in tensors}) != 1  # type: ignore[attr-defined]
    ):
        return None
    qdata = torch.cat([t.qdata for t in tensors])  # type: ignore[attr-defined]
    return first.like(qdata, torch.cat([t.scale for t in tensors]))  # type: ignore[attr-defined]


def _same(w: Fp8Weight, *_: Any, **__: Any) -> Fp8Weight:
    return w.like(w.qdata, w.scale)


def _clone(w: Fp8Weight, *_: Any, **__: Any) -> Fp8Weight:
    return w.like(w.qdata.clone(), w.scale.clone())


aten = torch.ops.aten
_KEPT_OPS = {
    aten._to_copy.default: _to_copy,
    aten.index_select.default: _index_select,
    aten.cat.default: _cat,
    aten.detach.default: _same,
    aten.alias.default: _same,
    aten.clone.default: _clone,
}


class Fp8Linear:
    """`y = x Wᵀ` for an `Fp8Weight`, by `torch._scaled_mm` per group of columns: each
    token's activations quantized with their own scale (one per group where the checkpoint
    says so), the float32 partial sums added in group order. `Linear` holds one where its
    weight is FP8."""

    def __init__(self, weight: Fp8Weight) -> None:
        self.out_features, self.in_features = weight.shape
        self.group, self.per_group = weight.group, weight.per_group
        groups = range(0, self.in_features, self.group)
        # One contiguous [N, group] FP8 block and its [1, N] scales per column group.
        self.blocks = [weight.qdata[:, g : g + self.group].contiguous() for g in groups]
        self.scales = [s.reshape(1, -1).contiguous() for s in weight.scale.float().unbind(1)]
        # cuda's row-wise kernel writes bfloat16; the CPU one writes float32.
        on_cuda = weight.qdata.device.type == "cuda"
        self.partial_dtype = torch.bfloat16 if on_cuda else torch.float32

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None, float32_out: bool
    ) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:  # an idle rank's empty batch
            out = rows.new_zeros((0, self.out_features), dtype=torch.float32)
        else:
            out = self._matmul(rows)
        if bias is not None:
            out = out + bias.float()
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if float32_out else out.to(x.dtype)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor | None = None
        whole = None if self.per_group else quantize_rows(rows)
        for i, (block, scale) in enumerate(zip(self.blocks, self.scales, strict=True)):
            cols = slice(i * self.group, (i + 1) * self.group)
            if whole is None:
                xq, xs = quantize_rows(rows[:, cols])
            else:
                xq, xs = whole[0][:, cols].contiguous(), whole[1]
            part = torch._scaled_mm(
                xq, block.t(), scale_a=xs, scale_b=scale, out_dtype=self.partial_dtype
            ).float()
            out = part if out is None else out + part
        assert out is not None
        return out
