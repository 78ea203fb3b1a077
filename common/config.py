"""Engine configuration: one dataclass, filled from CLI flags or `PDSERVE_*` variables,
checked once at start-up. Everything that sizes the engine (KV cache, batch limits) is here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported only when a dtype is needed: the CLI's clients and the coordinator never do.
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX). Without it bf16
    is emulated and measured 3-4x slower than float32 (AVX2-only hosts)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def auto_dtype(device: str) -> str:
    """bfloat16 on GPUs and on CPUs with native bf16; float32 elsewhere."""
    if device.startswith("cuda") or native_bf16_cpu():
        return "bfloat16"
    return "float32"


@dataclass
class EngineConfig:
    # A local Hugging Face folder; None means the embedded default model.
    model: str | None = None
    # "auto": bfloat16 where the device computes it natively, float32 elsewhere.
    dtype: str = "auto"
    device: str = "cpu"
    # torch intra-op threads; None: every core this process may run on.
    threads: int | None = None
    block_size: int = 16
    # KV cache size: --kv-cache-gb, or a token count (--kv-cache-tokens) which wins if set.
    kv_cache_gb: float = 2.0
    kv_cache_tokens: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # A step that carries decodes takes only the prefill tokens that keep it within this
    # many milliseconds, by measured step costs (0: the token budget alone).
    tpot_target_ms: float = 50.0
    # None: the model's own limit (max_position_embeddings).
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # A local-disk tier below the KV pool: evicted prefix blocks are written here and read
    # back on a hit (None: evicted blocks are dropped). At most kv_offload_gb GiB.
    kv_offload_dir: str | None = None
    kv_offload_gb: float = 4.0
    # Host memory between the pool and the disk tier (pinned on GPUs), GiB; 0: none.
    kv_host_offload_gb: float = 0.0
    # A tier shared with other workers of the same layout (e.g. a ReadWriteMany volume):
    # every cached block is written through to it, and any worker can read it back.
    kv_shared_dir: str | None = None
    kv_shared_gb: float = 16.0
    # MoE models: count tokens per expert per layer (ModelRunner.expert_token_counts).
    count_expert_tokens: bool = False
    # MoE models: split the experts over this many rank processes.
    expert_parallel: int = 1
    # MoE models under expert parallelism: this many extra expert slots (spread over the
    # ranks) hold copies of the hottest experts, re-placed from the counts seen so far.
    redundant_experts: int = 0
    # Model steps between two re-placements of the redundant experts.
    eplb_interval: int = 64
    # Dense models: split every layer over this many rank processes (rank 0 schedules).
    tensor_parallel: int = 1
    # GPUs: run every step eagerly instead of replaying decode steps as CUDA graphs.
    enforce_eager: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, auto_dtype(self.device) if self.dtype == "auto" else self.dtype)

    def validate(self) -> EngineConfig:
        if self.dtype == "auto":
            self.dtype = auto_dtype(self.device)
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"dtype: must be auto or one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}"
            )
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device: must be cpu or cuda[:N], got {self.device!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be at least 1, got {self.threads}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.kv_cache_tokens is None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb: must be > 0, got {self.kv_cache_gb}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens: must be at least one block ({self.block_size}), "
                f"got {self.kv_cache_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens: must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.tpot_target_ms < 0:
            raise ValueError(f"tpot_target_ms: must be >= 0, got {self.tpot_target_ms}")
        if self.expert_parallel < 1:
            raise ValueError(f"expert_parallel: must be at least 1, got {self.expert_parallel}")
        if self.redundant_experts < 0:
            raise ValueError(f"redundant_experts: must be at least 0, got {self.redundant_experts}")
        if self.redundant_experts and self.expert_parallel < 2:
            raise ValueError(
                "redundant_experts: copies of experts need expert_parallel of 2 or more, "
                f"got expert_parallel={self.expert_parallel}"
            )
        if self.redundant_experts % self.expert_parallel:
            raise ValueError(
                f"redundant_experts: must be a multiple of expert_parallel "
                f"({self.expert_parallel}), so that every rank holds as many slots; "
                f"got {self.redundant_experts}"
            )
        if self.eplb_interval < 1:
            raise ValueError(f"eplb_interval: must be at least 1, got {self.eplb_interval}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel: must be at least 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.expert_parallel > 1:
            raise ValueError(
                "tensor_parallel: not combined with expert_parallel yet; use one of them"
            )
        if self.tensor_parallel > 1 and (self.kv_offload_dir or self.kv_host_offload_gb
                                         or self.kv_shared_dir):  # fmt: skip
            raise ValueError(
                "tensor_parallel: the KV offload tiers (kv_offload_dir, kv_host_offload_gb, "
                "kv_shared_dir) are not supported with tensor parallelism yet"
            )
        if self.kv_offload_gb <= 0:
            raise ValueError(f"kv_offload_gb: must be > 0, got {self.kv_offload_gb}")
        if self.kv_host_offload_gb < 0:
            raise ValueError(f"kv_host_offload_gb: must be >= 0, got {self.kv_host_offload_gb}")
        if self.kv_host_offload_gb and not self.enable_prefix_caching:
            raise ValueError(
                "kv_host_offload_gb: the tier holds prefix-cache blocks; it needs prefix "
                "caching (drop --no-prefix-caching)"
            )
        if self.kv_shared_gb <= 0:
            raise ValueError(f"kv_shared_gb: must be > 0, got {self.kv_shared_gb}")
        for name in ("kv_offload_dir", "kv_shared_dir"):
            if getattr(self, name) and not self.enable_prefix_caching:
                raise ValueError(
                    f"{name}: the tier holds prefix-cache blocks; it needs prefix caching "
                    "(drop --no-prefix-caching)"
                )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be at least 2, got {self.max_model_len}")
        return self


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
