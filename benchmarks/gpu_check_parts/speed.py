"""Part 'speed': the engine on an 8B-shaped Llama (Llama-3-8B's shapes: 32 layers, hidden
4096, 32 heads / 8 KV heads, MLP 14336, vocabulary 128256) with random bf16 weights made
straight on the device (no checkpoint travels: the runner's state dict is a mapping that
draws each tensor on the device when the loader takes it). Beside the figures, the rates the
device reaches in the same run:

- `copy_gb_per_s`: a device-to-device copy of 4 GiB, bytes read plus bytes written, and the
  HBM floor of a decode step it gives: weight bytes (plus the batch's KV bytes) / that rate;
- `matmul_tflops`: an 8192^3 bf16 `torch.mm` (cuBLAS), and the batch-invariant Triton dense
  layer (what the engine runs) at the MLP's shape, for prefill's MFU;
- decode step time (median of engine steps) at batch 1, 16, 64, 256 with 128-token prompts,
  replayed from CUDA graphs (the engine's default on a GPU) and run eagerly, and the graph
  replayed alone (the device's share of the step); one row through each layer shape, the
  Triton dense layer beside cuBLAS;
- prefill: 8 prompts of 1024 tokens in one 8192-token step, tokens/s, and MFU = FLOPs
  (2 x parameters per token, attention's QK and PV, the LM head for each last token) per
  second over the measured mm rate; one layer's attention and dense layers timed alone at
  that shape, times the layers, as shares of the step.

`--tiny`: a 4-layer, 256-wide model, shorter prompts and smaller rates' operands (the CPU
dry run: the figures mean nothing there, the code path is what it checks)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch

from gpu_check_parts.common import Context, copy_tokenizer, rounded, sync, time_it

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
TINY = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=49152,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


class RandomWeights(Mapping[str, torch.Tensor]):
    """A Llama state dict whose tensors are drawn on the device when taken (normal, std
    0.02; norms 1), so 16 GB of weights never exist anywhere but in the runner."""

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype, device: str) -> None:
        h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
        kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
        self.shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (v, h),
            "lm_head.weight": (v, h),
            "model.norm.weight": (h,),
        }
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            self.shapes.update(
                {
                    p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (h, h),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (inter, h),
                    p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter),
                }
            )
        self.dtype, self.device = dtype, device
        self.gen = torch.Generator(device=device).manual_seed(0)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if len(shape) == 1:
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        w = torch.empty(shape, dtype=self.dtype, device=self.device)
        return w.normal_(0.0, 0.02, generator=self.gen)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def numel(self, prefix: str = "model.layers.") -> int:
        return sum(
            int(torch.Size(s).numel()) for n, s in self.shapes.items() if n.startswith(prefix)
        )


def model_folder(folder: Path, cfg: dict[str, Any], tokenizer_dir: Path) -> Path:
    """config.json, the tokenizer, and a placeholder safetensors file (the model check asks
    for one; the weights come from RandomWeights)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",  # the engine is given its dtype explicitly
        **cfg,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"placeholder": torch.zeros(1)}, str(folder / "model.safetensors"))
    copy_tokenizer(tokenizer_dir, folder)
    return folder


def device_rates(device: str, tiny: bool, dtype: torch.dtype) -> dict[str, float]:
    nbytes = (64 if tiny else 4096) * 2**20
    bufs = [torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device).normal_()]
    bufs.append(torch.empty_like(bufs[0]))
    copy_s = time_it(lambda: bufs[1].copy_(bufs[0]), device, warmup=3, reps=10)
    bufs.clear()
    n = 512 if tiny else 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    mm_s = time_it(lambda: a @ b, device, warmup=3, reps=10)
    out = {
        "copy_gb_per_s": 2 * nbytes / copy_s / 1e9,
        "matmul_tflops": 2 * n**3 / mm_s / 1e12,
        "matmul_n": n,
        "copy_bytes": nbytes,
    }
    if device.startswith("cuda"):  # the engine's own dense layer at the MLP's gate/up shape
        from pdserve.kernels import triton_invariant

        m, k, nn = 8192, 4096, 2 * 14336
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        w = torch.randn(nn, k, device=device).to(torch.bfloat16) * 0.02
        s = time_it(lambda: triton_invariant.linear(x, w), device, warmup=2, reps=5)
        out["invariant_linear_tflops_8192x28672x4096"] = 2 * m * k * nn / s / 1e12
        wide = triton_invariant.prepare(w)["wide"]  # as the engine's layers get it
        if wide:
            s = time_it(lambda: triton_invariant.linear(x, w), device, warmup=2, reps=5)
            out["invariant_linear_wide_tile_tflops_8192x28672x4096"] = 2 * m * k * nn / s / 1e12
        out["invariant_linear_wide_tile_same_bits"] = wide
        s1 = time_it(lambda: triton_invariant.linear(x[:1], w), device, warmup=2, reps=10)
        out["invariant_linear_1_row_weight_gb_per_s"] = nn * k * 2 / s1 / 1e9
        # One row through each layer shape (decode at batch 1), beside cuBLAS.
        for n_out, k_in in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            w = torch.randn(n_out, k_in, device=device).to(torch.bfloat16) * 0.02
            x1 = torch.randn(1, k_in, device=device).to(torch.bfloat16)
            triton_invariant.prepare(w)  # the decode-row tile, as the engine layers get it
            ours = time_it(partial(triton_invariant.linear, x1, w), device, warmup=2, reps=20)
            theirs = time_it(partial(torch.nn.functional.linear, x1, w), device, 2, 20)
            out[f"row_{n_out}x{k_in}_us"] = ours * 1e6
            out[f"row_{n_out}x{k_in}_cublas_us"] = theirs * 1e6
    return out


def decode_steps(
    engine: Any, batches: list[int], prompt_len: int, vocab: int, reps: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median engine step time per batch size, and (with CUDA graphs) the median time of
    the step's graph replayed alone: the device's share of the step."""
    from pdserve.common.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    # A request whose prompt was done first decodes while the others' prompts run (up to a
    # step per prefill chunk): room for 16 such steps, so none finishes in the timed steps.
    params = SamplingParams(max_tokens=reps + 3 + 16, temperature=0.0, ignore_eos=True)
    graphs = engine.runner.decode_graphs
    out, replay = {}, {}
    for batch in batches:
        for _ in range(batch):
            engine.add_request(
                torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(), params
            )
        while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ):
            engine.step()
        engine.step()  # the first decode step (a new batch shape)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            engine.step()  # sampling reads the ids back: the step's device work is done
            times.append(time.perf_counter() - start)
            # Every timed step runs the whole batch (a batch whose KV does not fit would
            # time fewer rows, and finished requests would too): else the figure is void.
            if engine.last_batch_size != batch:
                raise RuntimeError(
                    f"decode batch {batch}: a timed step ran {engine.last_batch_size} rows; "
                    "give the KV cache room for the whole batch"
                )
        out[str(batch)] = statistics.median(times)
        if graphs is not None and graphs.graphs:
            # The inputs still hold the last step's rows: a replay rewrites the same K/V.
            graph = graphs.graphs[graphs.inputs.padded_size(batch)]
            replay[str(batch)] = time_it(graph.replay, engine.runner.device.type, 2, reps)
        while engine.has_unfinished_requests():
            engine.step()
    return out, replay


def prefill(engine: Any, prompts: int, prompt_len: int, vocab: int, device: str) -> float:
    """Seconds for `prompts` prompts of `prompt_len` tokens, prefilled (one output token)."""
    from pdserve.common.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for _ in range(3):  # the first compiles and warms up
        batch = [
            torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(prompts)
        ]
        sync(device)
        start = time.perf_counter()
        engine.generate(batch, params)
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def prefill_parts(engine: Any, prompts: int, prompt_len: int, device: str) -> dict[str, float]:
    """Seconds of one layer's attention and of its dense layers (q/k/v, o, gate/up, down)
    at the prefill step's shape (`prompts` fresh prompts of `prompt_len` tokens in one
    step), each alone on random inputs: times the number of layers, where a prefill step's
    time goes."""
    from pdserve.kernels import attention

    model, kv = engine.runner.model, engine.kv_cache
    tokens, heads, kv_heads, d = (
        prompts * prompt_len, model.num_heads, model.num_kv_heads, model.head_dim
    )  # fmt: skip
    blocks = [kv.pool.get_new_blocks(kv.blocks_needed(prompt_len)) for _ in range(prompts)]
    try:
        ids = torch.tensor([[b.block_id for b in seq] for seq in blocks], dtype=torch.int32)
        bs = kv.block_size
        pos = torch.arange(prompt_len)
        slots = torch.cat([row.long()[pos // bs] * bs + pos % bs for row in ids]).to(device)
        table = ids.to(device)
        q = torch.randn(tokens, heads, d, device=device).to(model.embed.dtype)
        k = torch.randn(tokens, kv_heads, d, device=device).to(model.embed.dtype)
        v = torch.randn_like(k)
        cache = engine.runner.kv_cache
        attention.write_kv(cache, 0, k, v, slots)
        starts = [i * prompt_len for i in range(prompts + 1)]

        def attend() -> Any:
            return attention.prefill_attention(
                q, k, v, cache, 0, starts, [prompt_len] * prompts, table, model.scale
            )

        out = {"attention_s": time_it(attend, device, warmup=1, reps=3)}
    finally:
        for seq in blocks:
            kv.pool.free_blocks(seq)
    w = model.layers[0]  # a dense Llama layer (DenseMlp)

    def rows(width: int) -> torch.Tensor:
        return torch.randn(tokens, width, device=device).to(model.embed.dtype)

    linears = [
        (w.qkv, rows(w.qkv.in_features)),
        (w.o_proj, rows(w.o_proj.in_features)),
        (w.mlp.gate_up, rows(w.mlp.gate_up.in_features)),
        (w.mlp.down, rows(w.mlp.down.in_features)),
    ]
    out["dense_s"] = sum(time_it(partial(layer, x), device, 1, 3) for layer, x in linears)
    return out


def run(ctx: Context) -> dict[str, Any]:
    import pdserve.common.model_runner as model_runner
    from pdserve.common.config import auto_dtype

    cfg = TINY if ctx.tiny else LLAMA_8B

    # bfloat16 on a GPU; the CPU dry run takes the engine's own default (float32 where the
    # CPU has no native bf16: emulated, it would take minutes there).
    dtype_name = "bfloat16" if ctx.cuda else auto_dtype(ctx.device)
    device, dtype = ctx.device, getattr(torch, dtype_name)
    rates = device_rates(device, ctx.tiny, dtype)
    weights = RandomWeights(cfg, dtype, device)
    # The runner loads through this module-level function: hand it the random weights.
    model_runner.load_state_dict = lambda folder: weights  # type: ignore[assignment]
    prompt_len, batches = (16, [1, 16, 64, 256]) if ctx.tiny else (128, [1, 16, 64, 256])
    pre_prompts, pre_len = (4, 128) if ctx.tiny else (8, 1024)
    folder = model_folder(ctx.workdir / "llama-8b-shaped", cfg, ctx.tokenizer_dir)
    from gpu_check_parts.common import make_engine

    t0 = time.perf_counter()
    engine = make_engine(
        folder,
        device,
        dtype_name,
        kv_cache_tokens=(16 if ctx.tiny else 64) * 1024,
        max_num_seqs=256,
        max_num_batched_tokens=pre_prompts * pre_len,
        # Prompts take the whole token budget (no TPOT pacing): a batch's prompts are in
        # within a few steps, so no request decodes long enough to finish before the timing.
        tpot_target_ms=0.0,
        enable_prefix_caching=False,
    )
    sync(device)
    build_s = time.perf_counter() - t0
    vocab, h, layers = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    layer_params = weights.numel()
    params = layer_params + 2 * vocab * h + h  # + embeddings, LM head, final norm
    weight_bytes = (layer_params + vocab * h) * dtype.itemsize  # a step reads these (LM head)
    kv_per_token = layers * 2 * cfg["num_key_value_heads"] * h // cfg["num_attention_heads"] * 2
    reps = 5 if ctx.tiny else 10
    steps, replay = decode_steps(engine, batches, prompt_len, vocab, reps)
    # The same steps eagerly, where they ran from CUDA graphs (on CPU they were eager).
    graphs = engine.runner.decode_graphs
    replays = graphs.replays if graphs is not None else 0
    eager = steps
    if graphs is not None:
        engine.runner.decode_graphs = None
        eager, _ = decode_steps(engine, batches, prompt_len, vocab, reps)
        engine.runner.decode_graphs = graphs
    copy = rates["copy_gb_per_s"] * 1e9
    decode = {}
    for b, s in steps.items():
        kv_bytes = int(b) * (prompt_len + 2) * kv_per_token
        decode[b] = {
            "step_ms": rounded(s * 1e3),
            "eager_step_ms": rounded(eager[b] * 1e3),
            "graph_replay_ms": rounded(replay[b] * 1e3) if b in replay else None,
            "tokens_per_s": rounded(int(b) / s),
            "hbm_floor_ms": rounded((weight_bytes + kv_bytes) / copy * 1e3),
            "over_floor": rounded(s / ((weight_bytes + kv_bytes) / copy)),
            "eager_over_floor": rounded(eager[b] / ((weight_bytes + kv_bytes) / copy)),
        }
    pre_s = prefill(engine, pre_prompts, pre_len, vocab, device)
    parts = prefill_parts(engine, pre_prompts, pre_len, device)
    tokens = pre_prompts * pre_len
    # 2 FLOPs per weight per token; causal attention QK and PV: 2 * 2 * H * (L / 2) per
    # token per layer; the LM head for the last token of each prompt.
    flops = (
        2 * layer_params * tokens + 2 * h * pre_len * layers * tokens + 2 * vocab * h * pre_prompts
    )
    achieved = flops / pre_s / 1e12
    return {
        "status": "ok",
        "reason": f"decode batch 1 {decode['1']['step_ms']} ms ({decode['1']['over_floor']}x "
        f"the HBM floor; eager {decode['1']['eager_step_ms']} ms); "
        f"prefill {rounded(tokens / pre_s)} tok/s, "
        f"MFU {rounded(achieved / rates['matmul_tflops'])}",
        "model": "llama-3-8b shapes" if not ctx.tiny else "tiny llama",
        "dtype": dtype_name,
        "config": cfg,
        "parameters": params,
        "weight_bytes_read_per_step": weight_bytes,
        "build_s": round(build_s, 2),
        "cuda_graphs": {
            "captured_sizes": sorted(graphs.graphs) if graphs is not None else [],
            "capture_s": round(graphs.capture_s, 2) if graphs is not None else None,
            "replays_in_decode_steps": replays,
        },
        "device_rates": {k: rounded(v) for k, v in rates.items()},
        "decode_prompt_tokens": prompt_len,
        "decode": decode,
        "prefill": {
            "prompts": pre_prompts,
            "prompt_tokens": pre_len,
            "seconds": rounded(pre_s),
            "tokens_per_s": rounded(tokens / pre_s),
            "tflops": rounded(achieved),
            "mfu_vs_measured_mm": rounded(achieved / rates["matmul_tflops"]),
            # Each part alone at this step's shape, times the layers, over the step's time.
            "attention_share": rounded(parts["attention_s"] * layers / pre_s),
            "dense_layers_share": rounded(parts["dense_s"] * layers / pre_s),
        },
    }
