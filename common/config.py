"""Engine configuration: one dataclass, checked once at start-up. Everything that sizes the
engine (KV cache, batch limits) is here. Each field that is a command-line option declares it
(`option`): its help, and so its flag `--<name>` and `PDSERVE_<NAME>` variable, live beside
its type and default, and services/engine_args.py builds the flags from them."""

from __future__ import annotations

import os
import types
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, get_type_hints

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


@dataclass(frozen=True)
class Option:
    """One option of a command: the flag `--<name>` (underscores as dashes), also read from
    the variable `PDSERVE_<NAME>`; a flag on the command line wins. A `bool` option is a
    switch, on when given."""

    name: str
    type: type  # str, int, float or bool
    default: Any
    help: str  # as argparse takes it: %(default)s names the default
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    # The dataclass field it sets (None: an option of a command, not of a config);
    # `inverted`: the switch turns off a field that is on by default (--no-prefix-caching).
    field: str | None = None
    inverted: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "PDSERVE_" + self.name.upper()

    def to_field(self, value: Any) -> Any:
        """The parsed value as the field it sets takes it."""
        return not value if self.inverted else value


def option(
    default: Any,
    help: str,
    *,
    name: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A dataclass field that is also a command-line option (see `options_of`). `name`: the
    option's own name, where it is not the field's: a `bool` field on by default is turned
    off by its switch (`name="no_prefix_caching"`)."""
    spec = {"help": help, "name": name, "metavar": metavar, "choices": choices}
    return field(default=default, metadata={"option": spec})


def options_of(cls: type) -> tuple[Option, ...]:
    """The options the fields of dataclass `cls` declare, in field order; the type is the
    field's (without None), the default the field's."""
    hints = get_type_hints(cls)
    found = []
    for f in fields(cls):
        spec = f.metadata.get("option")
        if spec is None:
            continue
        assert f.default is not MISSING, f"{cls.__name__}.{f.name}: an option needs a default"
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):
            (kind,) = [t for t in kind.__args__ if t is not type(None)]
        inverted = kind is bool and f.default is True
        assert not inverted or spec["name"], f"{f.name}: a switch that turns it off needs a name"
        found.append(
            Option(
                name=spec["name"] or f.name,
                type=kind,
                default=False if inverted else f.default,
                help=spec["help"],
                metavar=spec["metavar"],
                choices=spec["choices"],
                field=f.name,
                inverted=inverted,
            )
        )
    return tuple(found)


@dataclass
class EngineConfig:
    model: str | None = option(
        None,
        "local Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)",
    )
    # "auto": bfloat16 where the device computes it natively, float32 elsewhere.
    dtype: str = option(
        "auto",
        "weights, activations and KV cache dtype; auto is bfloat16 on GPUs and CPUs with "
        "native bf16 (AVX512-BF16, AMX), float32 elsewhere (default: %(default)s)",
        choices=("auto", *DTYPE_NAMES),
    )
    device: str = option("cpu", "cpu or cuda[:N] (default: %(default)s)")
    # torch intra-op threads; None: every core this process may run on.
    threads: int | None = option(None, "torch threads (default: every core this process may use)")
    block_size: int = option(16, "tokens per KV block (default: %(default)s)")
    # KV cache size: kv_cache_gb, or a token count (kv_cache_tokens) which wins if set.
    kv_cache_gb: float = option(2.0, "KV cache size in GiB (default: %(default)s)")
    kv_cache_tokens: int | None = option(None, "KV cache size in tokens (overrides --kv-cache-gb)")
    max_num_seqs: int = option(128, "most requests in one batch (default: %(default)s)")
    max_num_batched_tokens: int = option(
        2048,
        "token budget of one step; longer prompts are prefilled in chunks (default: %(default)s)",
    )
    # A step that carries decodes takes only the prefill tokens that keep it within this
    # many milliseconds, by measured step costs (0: the token budget alone).
    tpot_target_ms: float = option(
        50.0,
        "while streams decode, a step takes only the prompt tokens that keep it within "
        "this time per output token, by measured step costs; 0: the token budget alone "
        "(default: %(default)s)",
    )
    # None: the model's own limit (max_position_embeddings).
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's limit)")
    # MoE models: split the experts over this many rank processes.
    expert_parallel: int = option(
        1,
        "mixture-of-experts models: run N rank processes, each holding num_experts/N "
        "experts and its own share of the requests (default: %(default)s)",
        metavar="N",
    )
    # Dense models: split every layer over this many rank processes (rank 0 schedules).
    tensor_parallel: int = option(
        1,
        "split every layer of a dense model over N rank processes (attention by "
        "heads, the MLP by rows; gloo on CPU, NCCL on GPU); the group is one worker "
        "(default: %(default)s)",
        metavar="N",
    )
    # MoE models under expert parallelism: this many extra expert slots (spread over the
    # ranks) hold copies of the hottest experts, re-placed from the counts seen so far.
    redundant_experts: int = option(
        0,
        "with --expert-parallel: K extra expert slots that hold copies of the hottest "
        "experts, re-placed as the load shifts (default: %(default)s)",
        metavar="K",
    )
    eplb_interval: int = option(
        64,
        "model steps between two re-placements of the redundant experts (default: %(default)s)",
        metavar="STEPS",
    )
    # A local-disk tier below the KV pool: evicted prefix blocks are written here and read
    # back on a hit (None: evicted blocks are dropped). At most kv_offload_gb GiB.
    kv_offload_dir: str | None = option(
        None,
        "a local-disk tier below the KV cache: evicted prefix blocks are written here "
        "and read back when a later prompt shares them (default: off)",
        metavar="DIR",
    )
    kv_offload_gb: float = option(
        4.0,
        "size of the --kv-offload-dir tier in GiB; least recently used blocks go first "
        "(default: %(default)s)",
        metavar="GB",
    )
    # Host memory between the pool and the disk tier (pinned on GPUs), GiB; 0: none.
    kv_host_offload_gb: float = option(
        0.0,
        "host memory (pinned on GPUs) between the KV cache and --kv-offload-dir: evicted "
        "prefix blocks go here first and come back at memory speed (default: 0, none)",
        metavar="GB",
    )
    # A tier shared with other workers of the same layout (e.g. a ReadWriteMany volume):
    # every cached block is written through to it, and any worker can read it back.
    kv_shared_dir: str | None = option(
        None,
        "a KV tier shared by workers of the same model (e.g. a ReadWriteMany volume): "
        "every cached prefix block is written through to it and any worker reads it back, "
        "so a conversation moved to another worker keeps its cache (default: off)",
        metavar="DIR",
    )
    kv_shared_gb: float = option(
        16.0,
        "how much of --kv-shared-dir this worker fills before deleting the least "
        "recently used blocks it knows of (default: %(default)s)",
        metavar="GB",
    )
    enable_prefix_caching: bool = option(
        True, "turn off automatic prefix caching", name="no_prefix_caching"
    )
    # GPUs: run every step eagerly instead of replaying decode steps as CUDA graphs.
    enforce_eager: bool = option(
        False,
        "GPUs: run decode steps eagerly instead of replaying them as CUDA graphs "
        "(captured at start for batch sizes up to --max-num-seqs)",
    )
    # MoE models: count tokens per expert per layer (ModelRunner.expert_token_counts); set
    # by the serving worker, not an option.
    count_expert_tokens: bool = False

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


# The engine's options, in the order `--help` lists them (services/engine_args.py).
ENGINE_OPTIONS = options_of(EngineConfig)

# Every service's connections to the others (coordinator to workers, decode to prefill):
# a peer that stops answering (hung, or the way to it cut) fails its calls UNAVAILABLE
# within twice this, so requests go on elsewhere instead of waiting on it
# (services/grpc_server.py turns it into gRPC's channel and server settings).
GRPC_KEEPALIVE = Option(
    "grpc_keepalive",
    float,
    5.0,
    "seconds between HTTP/2 keepalive pings on the connections between services; a peer "
    "that leaves one unanswered as long again is taken as lost: its calls fail "
    "UNAVAILABLE and go on on other workers, and a KV pull from it ends; 0: off "
    "(default: %(default)s)",
)
