"""Engine flags shared by every command that runs an engine (`generate`, `demo`, `prefill`,
`decode`, `colocated`, `serve`), built from the options EngineConfig's fields declare
(common/config.py), each also read from a `PDSERVE_<NAME>` environment variable (for
containers); a flag on the command line wins. `add_options` builds the flags of any declared
options (the services' own are in service_args.py); `engine_config` and `engine_argv` turn
the parsed flags into the config and back into a command line for a child process."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pdserve.common.config import ENGINE_OPTIONS, EngineConfig, Option
from pdserve.common.errors import ModelLoadError, PdserveError

if TYPE_CHECKING:
    from pdserve.common.engine import LLMEngine

# What the title of a group of flags says when every flag in it is also read from
# PDSERVE_<NAME> (services/option_table.py lists those variables by it).
FROM_ENV = "each also read from PDSERVE_<NAME>"


def env_default(option: Option, default: Any) -> Any:
    """The option's default as its PDSERVE_<NAME> variable sets it; unset: `default`, and
    empty too but for a free-text option, whose empty value is its value (an empty
    PDSERVE_API_KEY is a mistake to refuse, not the absence of a key). A switch is on when
    its variable is set to anything but 0 or false. A value that does not convert stops the
    command with a message naming the variable."""
    value = os.environ.get(option.env)
    if option.type is bool:
        return value not in (None, "0", "", "false")
    if value is None or (not value and (option.type is not str or option.choices)):
        return default
    value = _convert(option.env, option.type, value)
    if option.choices is not None and value not in option.choices:
        raise SystemExit(
            f"pdserve: error: {option.env} must be one of {', '.join(option.choices)}, "
            f"got {value!r}"
        )
    return value


def _convert(variable: str, kind: type, value: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        what = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
        raise SystemExit(f"pdserve: error: {variable} must be {what}, got {value!r}") from None


def add_options(
    g: argparse._ArgumentGroup | argparse.ArgumentParser,
    options: Iterable[Option],
    **defaults: Any,
) -> None:
    """One flag per option; `defaults` overrides an option's declared default by name (a
    command's own, e.g. its port). PDSERVE_<NAME> overrides both."""
    for o in options:
        default = env_default(o, defaults.get(o.name, o.default))
        if o.type is bool:
            g.add_argument(o.flag, action="store_true", default=default, help=o.help)
        else:
            g.add_argument(
                o.flag,
                type=None if o.type is str else o.type,
                default=default,
                metavar=o.metavar,
                choices=o.choices,
                help=o.help,
            )


def add_engine_args(p: argparse.ArgumentParser, tpot_target_ms: float = 50.0) -> None:
    """The engine's flags; `tpot_target_ms` is the command's default TPOT target (offline
    generation has no stream to keep within one: 0)."""
    g = p.add_argument_group(f"engine ({FROM_ENV})")
    add_options(g, ENGINE_OPTIONS, tpot_target_ms=float(tpot_target_ms))


SERVICE_ROLES = ("prefill", "decode", "colocated")
TENSOR_PARALLEL_COMMANDS = ("generate", *SERVICE_ROLES)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{o.field: o.to_field(getattr(args, o.name)) for o in ENGINE_OPTIONS})


def load_engine(args: argparse.Namespace) -> LLMEngine:
    from pdserve.common.engine import LLMEngine

    if args.expert_parallel != 1:
        if getattr(args, "command", "generate") not in ("generate", *SERVICE_ROLES):
            raise PdserveError(
                f"--expert-parallel: runs with generate, {', '.join(SERVICE_ROLES)}, serve"
            )
        from pdserve.services.expert_parallel import join_expert_parallel_group

        engine_config(args).validate()  # bad flags fail here, before any rank starts
        join_expert_parallel_group(args, engine_argv(args))
    elif args.tensor_parallel != 1:
        command = getattr(args, "command", "generate")
        if command not in TENSOR_PARALLEL_COMMANDS:
            raise PdserveError(
                f"--tensor-parallel: runs with {', '.join(TENSOR_PARALLEL_COMMANDS)} "
                "(serve takes --prefill-tensor-parallel / --decode-tensor-parallel)"
            )
        from pdserve.services.rank_group import RANK_ENV, join_rank_group

        engine_config(args).validate()
        if os.environ.get(RANK_ENV) is None:
            check_tensor_parallel(args.model, args.tensor_parallel)
        join_rank_group(args, engine_argv(args), args.tensor_parallel, "tensor")
    try:
        config = engine_config(args)
        # A serving worker exports its MoE routing (one bincount per MoE layer and step).
        config.count_expert_tokens = getattr(args, "command", None) in SERVICE_ROLES
        return LLMEngine(config)
    except (OSError, KeyError) as exc:
        raise ModelLoadError(
            f"model: cannot load {args.model or 'the default model'}: {exc}"
        ) from exc


def check_tensor_parallel(model: str | None, world_size: int) -> None:
    """A clear error before any rank starts: a model N ranks cannot split."""
    from transformers import AutoConfig

    from pdserve.common.model_files import resolve_model
    from pdserve.common.models.families import family_for
    from pdserve.common.models.tensor_parallel import check_model

    config = AutoConfig.from_pretrained(resolve_model(model))
    family = family_for(config)
    try:
        check_model(config, family.name, family.moe is not None, family.qk_norm, world_size)
    except ValueError as exc:
        raise PdserveError(f"--{exc}".replace("tensor_parallel:", "tensor-parallel:")) from None


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` as a command line, to hand to a child process: every
    option that has a value, so that the child's own PDSERVE_* variables cannot differ."""
    argv: list[str] = []
    for o in ENGINE_OPTIONS:
        value = getattr(args, o.name)
        if o.type is bool:
            argv += [o.flag] if value else []
        elif value is not None:
            argv += [o.flag, str(value)]
    return argv
