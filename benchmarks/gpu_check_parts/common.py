"""What every part of the GPU check shares: the run's context (device, tiny or full size,
where the tokenizer files are), device timing, tiny random-weight model folders built with
transformers (the same configs as tests/conftest.py and tests/integration/test_moe_greedy.py)
and the engine built on them."""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from pdserve.common.engine import LLMEngine

REPO = Path(__file__).resolve().parents[2]
# Where `make gpu-payload` puts the carried files (git-ignored; see payload.py).
PAYLOAD_DIR = REPO / ".gpu-payload"
TOKENIZER_ENV = "PDSERVE_GPU_CHECK_TOKENIZER"
# SmolLM2's tokenizer and chat template: all a model folder needs besides config and weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 49152  # SmolLM2's vocabulary: the tiny models use its tokenizer
TINY_ARCHS = ("llama", "qwen2", "mixtral")


@dataclass
class Context:
    device: str  # "cpu" or "cuda"
    tiny: bool  # small shapes (the CPU dry run) instead of the 8B-shaped model
    tokenizer_dir: Path
    workdir: Path  # a scratch folder of this run

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def find_tokenizer_dir(explicit: str | None = None) -> Path:
    """--tokenizer-dir, else $PDSERVE_GPU_CHECK_TOKENIZER, else the payload's copy, else the
    default model's folder (which a GPU machine does not have)."""
    for candidate in (explicit, os.environ.get(TOKENIZER_ENV)):
        if candidate:
            return Path(candidate)
    if (PAYLOAD_DIR / "tokenizer" / "tokenizer.json").is_file():
        return PAYLOAD_DIR / "tokenizer"
    from pdserve.common.model_files import resolve_model

    return resolve_model(None)


def copy_tokenizer(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dest / name)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_it(fn: Callable[[], Any], device: str, warmup: int = 2, reps: int = 5) -> float:
    """Median seconds of `fn` (device work included), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tiny_config(arch: str) -> Any:
    """The tiny configs of the CPU tests: peaked distributions (no near-ties for greedy)."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        return LlamaConfig(**common, intermediate_size=128)
    if arch == "qwen2":  # q/k/v biases
        return Qwen2Config(**common, intermediate_size=128)
    if arch == "mixtral":
        return MixtralConfig(
            **common, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2
        )
    raise ValueError(f"unknown tiny architecture {arch!r}")


def build_tiny(folder: Path, arch: str, tokenizer_dir: Path) -> Path:
    """A saved Hugging Face folder of a tiny random-weight model (float32, fixed seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    if arch == "qwen2":  # make the biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, folder)
    return folder


class _SharedTokenizer:
    """Stands in for AutoTokenizer in `pdserve.common.engine`: the check's model folders all
    hold the same tokenizer files, so each distinct set is loaded once per part (half a
    second each on a small CPU), not once per engine."""

    _cache: ClassVar[dict[str, Any]] = {}

    @classmethod
    def from_pretrained(cls, folder: Any, *args: Any, **kwargs: Any) -> Any:
        from transformers import AutoTokenizer

        digest = hashlib.sha256()
        for name in TOKENIZER_FILES:
            path = Path(folder) / name
            digest.update(path.read_bytes() if path.is_file() else b"-")
        key = digest.hexdigest()
        if key not in cls._cache:
            cls._cache[key] = AutoTokenizer.from_pretrained(folder, *args, **kwargs)
        return cls._cache[key]


def make_engine(folder: Path, device: str, dtype: str, **overrides: Any) -> LLMEngine:
    import pdserve.common.engine as engine_module
    from pdserve.common.config import EngineConfig
    from pdserve.common.engine import LLMEngine

    engine_module.AutoTokenizer = _SharedTokenizer  # type: ignore[assignment,misc]

    # One thread on CPU: the dry run shares a small machine, and two threads waiting on
    # each other's barriers there cost more than they gain.
    config: dict[str, Any] = dict(
        model=str(folder), device=device, dtype=dtype, threads=1 if device == "cpu" else None
    )
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def random_prompts(lengths: tuple[int, ...], seed: int, vocab: int = VOCAB) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def all_blocks_free(eng: LLMEngine) -> bool:
    return eng.kv_cache.num_free_blocks == eng.runner.num_blocks


def rounded(x: float, digits: int = 3) -> float:
    """`digits` significant digits (integers stay as they are)."""
    return x if isinstance(x, int) else float(f"{x:.{digits}g}")
