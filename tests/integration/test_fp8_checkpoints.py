"""FP8 checkpoints: a tiny random-weight Llama quantized here to float8_e4m3fn in the layouts
Hugging Face stores (transformers' `fp8` with block-wise `weight_scale_inv`, full and partial
blocks or one scale per tensor; compressed-tensors' float8 per tensor, per channel and per
group), each written beside the same model de-quantized to float32 from the same FP8 values.
pdserve on the FP8 folder gives transformers' greedy ids and teacher-forced logits on the
de-quantized folder (and transformers' own FP8 loader's, which de-quantizes on CPU), every KV
block free at the end. The path a GPU takes (weights kept FP8, `torch._scaled_mm`) runs here
too, on CPU's `_scaled_mm`. Every variant not built is refused naming its field."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle import engine, engine_logits, load_reference, reference_greedy
from safetensors.torch import load_file, save_file
from tiny_models import tiny_model

from pdserve.common.errors import ModelLoadError
from pdserve.common.models import fp8
from pdserve.common.models.linear import Linear
from pdserve.common.sampling_params import SamplingParams

NEW_TOKENS = 16
LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"
)
_F8 = torch.float8_e4m3fn
_F8_MAX = float(torch.finfo(_F8).max)


def _quantize(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values of `w` and one float32 scale per `rows` x `cols` block (edge blocks
    partial), each block's largest magnitude at the FP8 maximum."""
    n, k = w.shape
    grid = (-(-n // rows), -(-k // cols))
    padded = w.new_zeros(grid[0] * rows, grid[1] * cols)
    padded[:n, :k] = w
    tiles = padded.view(grid[0], rows, grid[1], cols)
    scale = (tiles.abs().amax(dim=(1, 3)) / _F8_MAX).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).clamp(-_F8_MAX, _F8_MAX).to(_F8)
    return q.view(grid[0] * rows, grid[1] * cols)[:n, :k].contiguous(), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    n, k = q.shape
    grid = scale.reshape(-(-n // rows), -(-k // cols))
    return q.float() * grid.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]


def _compressed_tensors(strategy: str, **weights: Any) -> dict[str, Any]:
    float8 = {"type": "float", "num_bits": 8, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**float8, "dynamic": False, "strategy": strategy, **weights},
                "input_activations": {**float8, "dynamic": True, "strategy": "token"},
            }
        },
    }


def _fine_grained(block: list[int] | None) -> dict[str, Any]:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}


# id: (quantization_config, the scale's name, its block for an [n, k] weight, scale shape)
LAYOUTS = {
    "fp8-block32": (_fine_grained([32, 32]), "weight_scale_inv", lambda n, k: (32, 32), None),
    # 48 divides neither 64 nor 128: edge blocks are partial (as DeepSeek-V3's 576-row one).
    "fp8-block48-partial": (
        _fine_grained([48, 48]),
        "weight_scale_inv",
        lambda n, k: (48, 48),
        None,
    ),
    "fp8-per-tensor": (_fine_grained(None), "weight_scale_inv", lambda n, k: (n, k), ()),
    "ct-tensor": (_compressed_tensors("tensor"), "weight_scale", lambda n, k: (n, k), (1,)),
    "ct-channel": (_compressed_tensors("channel"), "weight_scale", lambda n, k: (1, k), None),
    "ct-group32": (
        _compressed_tensors("group", group_size=32),
        "weight_scale",
        lambda n, k: (1, 32),
        None,
    ),
}


def _write(folder: Path, base: Path, state: dict[str, torch.Tensor], quant: dict | None) -> Path:
    shutil.copytree(base, folder)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if quant is not None:
        config["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, default_model_dir) -> Path:
    return tiny_model(tmp_path_factory.mktemp("fp8-base"), default_model_dir, "llama")


def _quantized(base: Path, layout: str) -> tuple[dict, dict]:
    """`base`'s state dict with its Linear weights in FP8 as `layout` stores them, and the
    same FP8 values de-quantized to float32."""
    _, scale_name, block_of, scale_shape = LAYOUTS[layout]
    quantized, dequantized = {}, {}
    for name, tensor in load_file(str(next(base.glob("*.safetensors")))).items():
        if not LINEAR.fullmatch(name):
            quantized[name] = dequantized[name] = tensor
            continue
        rows, cols = block_of(*tensor.shape)
        q, scale = _quantize(tensor.float(), rows, cols)
        quantized[name] = q
        stored = scale if scale_shape is None else scale.reshape(scale_shape)
        quantized[name.removesuffix("weight") + scale_name] = stored.contiguous()
        dequantized[name] = _dequantize(q, scale, rows, cols)
        assert not torch.equal(dequantized[name], tensor), "FP8 should change the weights"
    return quantized, dequantized


@pytest.fixture(scope="module", params=list(LAYOUTS))
def fp8_pair(request, tiny_llama, tmp_path_factory) -> tuple[str, Path, Path]:
    """(layout, the FP8 folder, the same model de-quantized to float32)."""
    tmp = tmp_path_factory.mktemp(request.param)
    quantized, dequantized = _quantized(tiny_llama, request.param)
    fp8_dir = _write(tmp / "fp8", tiny_llama, quantized, LAYOUTS[request.param][0])
    return request.param, fp8_dir, _write(tmp / "dequantized", tiny_llama, dequantized, None)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 23, 61)]


def _greedy(eng, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts, params)
    assert eng.kv_cache.num_free_blocks == eng.runner.num_blocks
    assert not eng.has_unfinished_requests()
    return [o.token_ids for o in outs]


def test_fp8_checkpoint_equals_the_dequantized_model(fp8_pair):
    """float32: the same greedy ids as transformers on the de-quantized folder, and
    teacher-forced logits within 1e-3 (logits are O(10))."""
    _, fp8_dir, dequantized_dir = fp8_pair
    reference = load_reference(dequantized_dir)
    prompts = _prompts()
    expected = [reference_greedy(reference, p, NEW_TOKENS, None) for p in prompts]
    eng = engine(fp8_dir, kv_cache_tokens=1024)
    assert _greedy(eng, prompts) == expected
    seq = prompts[2] + expected[2]
    with torch.inference_mode():
        ref_logits = reference(torch.tensor([seq])).logits[0].float()
    assert (engine_logits(eng, seq) - ref_logits).abs().max().item() < 1e-3
    assert eng.kv_cache.num_free_blocks == eng.runner.num_blocks


@pytest.mark.parametrize("layout", ["fp8-block32", "fp8-per-tensor"])
def test_transformers_fp8_loader_agrees(layout, tiny_llama, tmp_path):
    """transformers loads the `fp8` folder on CPU by de-quantizing it: the same ids. (Its
    loader refuses partial blocks, and compressed-tensors' folders need that package.)"""
    quantized, _ = _quantized(tiny_llama, layout)
    fp8_dir = _write(tmp_path / "fp8", tiny_llama, quantized, LAYOUTS[layout][0])
    reference = load_reference(fp8_dir)
    assert reference.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    prompts = _prompts()
    expected = [reference_greedy(reference, p, NEW_TOKENS, None) for p in prompts]
    assert _greedy(engine(fp8_dir, kv_cache_tokens=1024), prompts) == expected


def _fake_quantized_activations(x: torch.Tensor, width: int | None) -> torch.Tensor:
    """`x` through FP8 and back: per token, per group of `width` columns (None: the row)."""
    out = torch.empty_like(x)
    width = width or x.shape[-1]
    for g in range(0, x.shape[-1], width):
        part = x[..., g : g + width].float()
        scale = (part.abs().amax(-1, keepdim=True) / _F8_MAX).clamp(min=1e-12)
        values = (part / scale).clamp(-_F8_MAX, _F8_MAX).to(_F8).float()
        out[..., g : g + width] = (values * scale).to(x.dtype)
    return out


# Where the kept path quantizes activations per group of columns: the weights' groups.
# transformers' `fp8` quantizes activations per block of columns, compressed-tensors' per token
# here (its `input_activations.strategy`).
ACTIVATION_GROUP = {"fp8-block32": 32}


def test_kept_fp8_path_runs_the_model(fp8_pair, monkeypatch):
    """Where the device computes FP8 the weights stay FP8 and `Linear` multiplies them with
    `torch._scaled_mm`, activations quantized per token (per token and group for grouped
    weights): run here on CPU's `_scaled_mm`, against transformers on the de-quantized
    model with its Linear inputs quantized the same way. Not bit-equal: an activation on
    an FP8 rounding boundary rounds either way after float32 sums of another order, and
    three random layers amplify it. The logits are several times nearer that model than
    the de-quantized one (which differs in a quarter to 40% of the argmaxes), and the
    argmax agrees with it on 90% of positions."""
    layout, fp8_dir, dequantized_dir = fp8_pair
    monkeypatch.setattr(fp8, "computes_fp8", lambda device: True)
    eng = engine(fp8_dir, kv_cache_tokens=1024)
    layers = eng.runner.model.layers
    linears = [lin for w in layers for lin in (w.qkv, w.o_proj, w.mlp.gate_up, w.mlp.down)]
    kept = [lin.fp8 is not None for lin in linears]
    reference = load_reference(dequantized_dir)
    seq = torch.tensor([_prompts()[2]])
    ours = engine_logits(eng, seq[0].tolist())
    _greedy(eng, _prompts())  # every block comes back
    with torch.inference_mode():
        plain = reference(seq).logits[0].float()
    if layout == "fp8-block48-partial":
        # Partial 48-column groups do not suit `_scaled_mm`: de-quantized at load instead.
        assert not any(kept)
        assert (ours - plain).abs().max().item() < 1e-3
        return
    assert all(kept)
    width = ACTIVATION_GROUP.get(layout)
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and LINEAR.fullmatch(name + ".weight"):
            module.register_forward_pre_hook(
                lambda _, args: (_fake_quantized_activations(args[0], width),)
            )
    with torch.inference_mode():
        fake = reference(seq).logits[0].float()
    assert (ours - fake).abs().max().item() < 0.25 * (ours - plain).abs().max().item()
    assert (ours.argmax(-1) == fake.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize(("group", "per_group"), [(None, False), (32, True), (32, False)])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_fp8_linear_is_the_scaled_product(group, per_group, rows):
    """An FP8 weight through the loader's ops (rows selected, concatenated, moved, cast)
    stays FP8; `Linear` gives Σ_groups (x's FP8 values · W's FP8 values) · scales, x
    quantized per token or per token and group."""
    gen = torch.Generator().manual_seed(rows)
    width = group or 64
    parts = []
    for n in (32, 16, 16):  # q, k, v
        q, scale = _quantize(torch.randn(n, 64, generator=gen), 1, width)
        parts.append(fp8.Fp8Weight(q, scale.reshape(n, -1), width, per_group, torch.float32))
    select = torch.arange(0, 16)
    weight = torch.cat([parts[0].index_select(0, select), parts[1], parts[2]])
    weight = weight.to(device="cpu", dtype=torch.bfloat16).contiguous()
    assert isinstance(weight, fp8.Fp8Weight) and weight.dtype == torch.bfloat16
    bias = torch.randn(48, generator=gen)
    layer = Linear(weight, bias, float32_out=True)
    assert layer.fp8 is not None
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    fake_x = _fake_quantized_activations(x.float(), width if per_group else None).double()
    w_values = weight.qdata.double()
    expected = bias.double().expand(rows, 48).clone()
    for g in range(0, 64, width):
        scales = weight.scale[:, g // width].double()
        expected += fake_x[:, g : g + width] @ (w_values[:, g : g + width] * scales[:, None]).T
    got = layer(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # Any other op sees the de-quantized weight.
    plain = weight.t()
    assert type(plain) is torch.Tensor
    assert torch.equal(plain.t(), fp8.dequantize(weight.qdata, weight.scale, width).bfloat16())


def test_weight_only_checkpoints_are_dequantized_everywhere(monkeypatch):
    """compressed-tensors without activation quantization (or with one scale per batch):
    no FP8 matmul here computes that math, so the weights are de-quantized even where the
    device computes FP8."""
    monkeypatch.setattr(fp8, "computes_fp8", lambda device: True)
    name = "model.layers.0.mlp.down_proj.weight"
    q, scale = _quantize(torch.randn(64, 128), 1, 128)
    state = {name: q, name.removesuffix("weight") + "weight_scale": scale}
    for acts in (None, {"type": "float", "num_bits": 8, "dynamic": True, "strategy": "tensor"}):
        config = _ct(f"{_CT_GROUP}.input_activations", acts)
        loaded = fp8.load_weights(dict(state), config, torch.float32, torch.device("cpu"))
        assert type(loaded[name]) is torch.Tensor
        assert torch.equal(loaded[name], _dequantize(q, scale, 1, 128))
    kept = fp8.load_weights(dict(state), _CT, torch.float32, torch.device("cpu"))
    assert isinstance(kept[name], fp8.Fp8Weight) and not kept[name].per_group


_CT = _compressed_tensors("channel")
_CT_GROUP = "config_groups.group_0"


def _ct(path: str, value: Any) -> dict[str, Any]:
    config = json.loads(json.dumps(_CT))
    node = config
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    return config


REFUSED = [
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme='static'"),
    (_fine_grained([128]), "weight_block_size=[128]"),
    (_fine_grained([0, 128]), "weight_block_size=[0, 128]"),
    ({**_fine_grained([128, 128]), "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({**_fine_grained([128, 128]), "expert_dtype": "fp4"}, "expert_dtype='fp4'"),
    ({**_fine_grained([128, 128]), "modules_to_convert": ["embed_tokens"]}, "modules_to_convert"),
    (_ct("format", "pack-quantized"), "format='pack-quantized'"),
    (_ct("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "kv_cache_scheme="),
    (_ct(f"{_CT_GROUP}.weights.num_bits", 4), f"{_CT_GROUP}.weights.num_bits=4"),
    (_ct(f"{_CT_GROUP}.weights.type", "int"), f"{_CT_GROUP}.weights.type='int'"),
    (_ct(f"{_CT_GROUP}.weights.symmetric", False), f"{_CT_GROUP}.weights.symmetric=False"),
    (
        _ct(f"{_CT_GROUP}.weights.strategy", "tensor_group"),
        f"{_CT_GROUP}.weights.strategy='tensor_group'",
    ),
    (
        _ct(f"{_CT_GROUP}.input_activations.dynamic", False),
        f"{_CT_GROUP}.input_activations.dynamic=False",
    ),
    (
        _ct(f"{_CT_GROUP}.input_activations.strategy", "tensor_group"),
        f"{_CT_GROUP}.input_activations.strategy='tensor_group'",
    ),
    (_ct(f"{_CT_GROUP}.output_activations", {"num_bits": 8}), f"{_CT_GROUP}.output_activations"),
]


@pytest.mark.parametrize(("quant", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_variants_not_built_are_refused_naming_the_field(quant, field):
    with pytest.raises(ModelLoadError, match=re.escape(f"quantization_config.{field}")):
        fp8.scheme_of(quant)


def test_weights_not_built_are_refused_naming_the_tensor():
    name = "model.layers.0.mlp.down_proj.weight"
    quant, cpu = _fine_grained([32, 32]), torch.device("cpu")
    q, scale = _quantize(torch.randn(64, 128), 32, 32)
    cases = [
        ({name: q.to(torch.float8_e5m2)}, quant, "of dtype float8_e5m2"),
        ({name: q}, quant, "with no 'model.layers.0.mlp.down_proj.weight_scale_inv'"),
        ({name: q, f"{name}_scale_inv": scale[:1]}, quant, "has scales of shape [1, 4]"),
        ({name: q}, None, "config.json has no quantization_config"),
        ({f"{name}_scale_inv": scale}, quant, "scales no FP8 weight"),
    ]
    for state, config, message in cases:
        with pytest.raises(ModelLoadError, match=re.escape(message)) as err:
            fp8.load_weights(state, config, torch.float32, cpu)
        assert name in str(err.value)
    loaded = fp8.load_weights({name: q, f"{name}_scale_inv": scale}, quant, torch.float32, cpu)
    assert torch.equal(loaded[name], _dequantize(q, scale, 32, 32))


def test_the_engine_refuses_a_static_activation_checkpoint(tiny_llama, tmp_path):
    state = load_file(str(next(tiny_llama.glob("*.safetensors"))))
    static = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [32, 32]}
    folder = _write(tmp_path / "static", tiny_llama, state, static)
    with pytest.raises(
        ModelLoadError, match=re.escape("quantization_config.activation_scheme='static'")
    ):
        engine(folder, kv_cache_tokens=256)
