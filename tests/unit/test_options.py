"""One source for every option: the engine's options are EngineConfig's fields, converted to
flags, PDSERVE_* variables and child command lines and back; the CLI's parser reads exactly the
variables its groups claim; docs/options.md is what `pdserve options` prints; the operator table
in docs/serving.md, every PDSERVE_* name in docs/ and helm/, and the variables and flags the
Helm chart gives each container are real options of that command; and the chart's engine
values reach the engine's fields of the same name."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.common.config import ENGINE_OPTIONS, EngineConfig, Option
from pdserve.services.cli import build_parser
from pdserve.services.engine_args import add_engine_args, engine_argv, engine_config
from pdserve.services.option_table import COMMANDS, WORKERS, markdown, sections, subcommands

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
VALUE_SETS = [None, *sorted((ROOT / "tests" / "integration" / "helm_values").glob("*.yaml"))]
HELM = Path(sys.executable).parent / "helm"
# What downward-API fields stand for when a container's environment is parsed.
FIELD_SAMPLES = {"status.podIP": "10.1.2.3", "metadata.name": "demo-pdserve-prefill-abc12"}
NAME = re.compile(r"PDSERVE_[A-Z0-9_]*[A-Z0-9]")


def clean_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for name in [n for n in os.environ if n.startswith("PDSERVE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def parsers(monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, argparse.ArgumentParser]:
    clean_env(monkeypatch, **env)
    return subcommands(build_parser())


def flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}


# --- the engine's options: EngineConfig's fields, both ways ------------------------------------


def other_value(o: Option) -> Any:
    """A value of `o`'s type that is not its default."""
    if o.type is bool:
        return True
    if o.choices:
        return next(c for c in o.choices if c != o.default)
    if o.type is int:
        return (o.default or 0) + 3
    if o.type is float:
        return (o.default or 0.0) + 1.5
    return f"/probe/{o.name}"


def engine_parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_every_engine_field_is_an_option_but_the_workers_own() -> None:
    set_by = {o.field for o in ENGINE_OPTIONS}
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert fields - set_by == {"count_expert_tokens"}  # load_engine sets it, for workers
    assert len({o.name for o in ENGINE_OPTIONS}) == len(ENGINE_OPTIONS)
    defaults = engine_config(engine_parse())
    assert defaults == EngineConfig()  # the flags' defaults are the fields' own


def test_engine_options_from_flags_from_variables_and_back(monkeypatch) -> None:
    clean_env(monkeypatch)
    want = {o.field: o.to_field(other_value(o)) for o in ENGINE_OPTIONS}
    argv = [
        *(a for o in ENGINE_OPTIONS if o.type is not bool for a in (o.flag, str(other_value(o)))),
        *(o.flag for o in ENGINE_OPTIONS if o.type is bool),
    ]
    from_flags = engine_parse(*argv)
    assert dataclasses.asdict(engine_config(from_flags)) == {
        **dataclasses.asdict(EngineConfig()),
        **want,
    }
    # A child process given engine_argv builds the same config, whatever its own variables.
    own = {o.env: str(o.default) for o in ENGINE_OPTIONS if o.type is not bool and o.default}
    clean_env(monkeypatch, **own)
    assert engine_config(engine_parse(*engine_argv(from_flags))) == engine_config(from_flags)
    # The same values from PDSERVE_* variables alone; a flag wins over its variable.
    clean_env(monkeypatch, **{o.env: "1" if o.type is bool else str(other_value(o))
                              for o in ENGINE_OPTIONS})  # fmt: skip
    from_env = engine_parse()
    assert engine_config(from_env) == engine_config(from_flags)
    assert engine_parse("--block-size", "64").block_size == 64
    for value, on in (("0", False), ("false", False), ("", False), ("yes", True)):
        monkeypatch.setenv("PDSERVE_NO_PREFIX_CACHING", value)
        assert engine_config(engine_parse()).enable_prefix_caching is not on


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("PDSERVE_BLOCK_SIZE", "big", "PDSERVE_BLOCK_SIZE must be an integer, got 'big'"),
        ("PDSERVE_KV_CACHE_GB", "2GB", "PDSERVE_KV_CACHE_GB must be a number, got '2GB'"),
        ("PDSERVE_DTYPE", "fp8", "PDSERVE_DTYPE must be one of auto, float32, bfloat16, float16"),
        ("PDSERVE_POLICY", "fastest", "PDSERVE_POLICY must be one of prefix_aware, least_loaded"),
        ("PDSERVE_PREFIX_WEIGHT", "high", "PDSERVE_PREFIX_WEIGHT must be a number, got 'high'"),
        ("PDSERVE_HEALTH_PORT", "x", "PDSERVE_HEALTH_PORT must be an integer, got 'x'"),
        ("PDSERVE_DISCOVERY", "dns", "PDSERVE_DISCOVERY must be one of static, kubernetes"),
    ],
)
def test_a_bad_variable_stops_the_command_naming_it(monkeypatch, variable, value, message):
    clean_env(monkeypatch, **{variable: value})
    with pytest.raises(SystemExit, match=re.escape(message)):
        build_parser()


# --- the parser reads exactly the variables its groups claim -----------------------------------


def claimed(parser: argparse.ArgumentParser) -> dict[tuple[str, str], str | None]:
    """(command, flag) -> the variable the options page gives it."""
    out = {}
    for rows in sections(parser).values():
        for row in rows.values():
            for command in row.defaults:
                out[command, row.flag.split()[0]] = row.variable
    return out


def probe_values(commands: dict[str, argparse.ArgumentParser]) -> dict[str, tuple[str, Any]]:
    """For every flag's dest: a PDSERVE_<DEST> value and what a flag that reads it parses it
    to, different from the flag's default."""
    out: dict[str, tuple[str, Any]] = {}
    for parser in commands.values():
        for action in parser._actions:
            if not action.option_strings or action.dest in out or action.dest == "help":
                continue
            if isinstance(action, argparse._StoreTrueAction):
                out[action.dest] = ("1", True)
            elif action.choices:
                other = [c for c in action.choices if c != action.default]
                if other:
                    out[action.dest] = (str(other[0]), other[0])
            elif action.type in (int, float):
                value = action.type(7 if action.default != 7 else 8)
                out[action.dest] = (str(value), value)
            else:
                out[action.dest] = ("probe-value", "probe-value")
    return out


def reads(monkeypatch, names: tuple[str, ...]) -> dict[tuple[str, str], str | None]:
    """(command, flag) -> the PDSERVE_* variable it really reads (None: none), found by
    setting every PDSERVE_<DEST> and seeing which defaults follow. A flag whose only choice
    is its default shows nothing and is left out."""
    clean = parsers(monkeypatch)
    values = probe_values(clean)
    probed = parsers(monkeypatch, **{f"PDSERVE_{d.upper()}": v for d, (v, _) in values.items()})
    out = {}
    for command in names:
        before, after = flags(clean[command]), flags(probed[command])
        for flag, action in before.items():
            if action.dest not in values:
                continue
            out[command, flag] = None
            if after[flag].default != action.default:
                assert after[flag].default == values[action.dest][1], (command, flag)
                out[command, flag] = f"PDSERVE_{action.dest.upper()}"
    return out


def test_every_flag_reads_the_variable_its_group_claims(monkeypatch) -> None:
    clean_env(monkeypatch)
    claims = claimed(build_parser())
    real = reads(monkeypatch, COMMANDS)
    assert len(real) > 80
    wrong = {key: (claims.get(key), variable) for key, variable in real.items()
             if key[1] != "--help" and claims.get(key) != variable}  # fmt: skip
    assert not wrong, f"(command, flag): (claimed, read): {wrong}"


# --- the options page --------------------------------------------------------------------------


def test_options_page_is_what_pdserve_options_prints(monkeypatch) -> None:
    clean_env(monkeypatch)
    page = (ROOT / "docs" / "options.md").read_text()
    assert page == markdown(build_parser()), "regenerate: pdserve options > docs/options.md"
    # The page covers every command (but `options` itself), clients included, and every
    # flag of each.
    commands = parsers(monkeypatch)
    assert set(commands) - {"options"} == set(COMMANDS)
    listed = set(claimed(build_parser()))
    for command in COMMANDS:
        for flag in flags(commands[command]):
            if flag != "--help":
                assert (command, flag) in listed, f"{command} {flag} is not in docs/options.md"


def known_variables(monkeypatch) -> set[str]:
    """Every PDSERVE_* variable pdserve reads: the options' and those the code reads itself
    (os.environ)."""
    clean_env(monkeypatch)
    names = {v for v in claimed(build_parser()).values() if v}
    for folder in ("common", "services", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(NAME.findall(path.read_text()))
    return names


def test_every_variable_named_in_docs_and_chart_is_read(monkeypatch) -> None:
    known = known_variables(monkeypatch)
    files = [*(ROOT / "docs").glob("*.md"), *(p for p in CHART.rglob("*") if p.is_file())]
    unknown = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for name in NAME.findall(path.read_text(errors="replace"))
        if name not in known
    }
    assert not unknown


def serving_table() -> list[list[str]]:
    text = (ROOT / "docs" / "serving.md").read_text()
    section = text.split("## Flags and environment", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| flag | on |")
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[2:]]


def test_serving_table_names_real_flags_on_the_commands_it_says(monkeypatch) -> None:
    commands = parsers(monkeypatch)
    serving = ("serve", "coordinator", *WORKERS)
    everywhere = {flag for p in commands.values() for flag in flags(p)}
    known = known_variables(monkeypatch)
    rows = serving_table()
    assert len(rows) > 20
    for flag_cell, on, meaning in rows:
        names = [n.strip() for n in on.split(",")]
        on_commands = {"all": serving, "workers": WORKERS}
        targets = [c for n in names for c in on_commands.get(n, (n,))]
        assert set(targets) <= set(commands), f"{flag_cell}: unknown command in {on!r}"
        for flag in re.findall(r"`(--[a-z0-9*-]+)", flag_cell):
            for command in targets:
                assert fnmatch.filter(flags(commands[command]), flag), f"{command} {flag}"
        for flag in re.findall(r"`(--[a-z0-9-]+)", meaning):
            assert flag in everywhere, f"{flag_cell}: {flag} is no flag of any command"
        for name in NAME.findall(flag_cell + meaning):
            assert name in known, f"{flag_cell}: {name} is read nowhere"


# --- the Helm chart ----------------------------------------------------------------------------


def render(values: Path | None = None, **sets: Any) -> list[dict]:
    """`helm template` of the chart with a value set and values by dotted path."""
    assert HELM.is_file(), f"{HELM} is missing: `make install` (or `make tools`) downloads helm"
    args = [str(HELM), "template", "demo", str(CHART), "--namespace", "llm"]
    args += ["-f", str(values)] if values else []
    for path, value in sets.items():
        args += ["--set-json", f"{path}={json.dumps(value)}"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=120).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def pdserve_containers(docs: list[dict]) -> list[dict]:
    """Containers that run a pdserve command (args[0])."""
    commands = set(COMMANDS)
    return [
        c
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        if c.get("args") and c["args"][0] in commands
    ]


def env_of(c: dict) -> dict[str, str]:
    out = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            out[e["name"]] = FIELD_SAMPLES[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            out[e["name"]] = "<secret>"
    return out


def parse_container(c: dict, monkeypatch) -> argparse.Namespace:
    clean_env(monkeypatch, **{k: v for k, v in env_of(c).items() if k.startswith("PDSERVE_")})
    return build_parser().parse_args([str(a) for a in c["args"]])


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda p: p.stem if p else "default")
def test_chart_sets_only_real_options_of_each_command(values, monkeypatch) -> None:
    clean_env(monkeypatch)
    claims = claimed(build_parser())
    variables = {(c, v) for (c, _), v in claims.items() if v}
    env_only = known_variables(monkeypatch) - {v for v in claims.values() if v}
    commands = parsers(monkeypatch)
    containers = pdserve_containers(render(values))
    assert {c["args"][0] for c in containers} == {"coordinator", "prefill", "decode"}
    for c in containers:
        command = c["args"][0]
        for name in env_of(c):
            if name.startswith("PDSERVE_"):
                real = (command, name) in variables or name in env_only
                assert real, f"{command}: {name} is no option of `pdserve {command}`"
        for arg in c["args"][1:]:
            if str(arg).startswith("--"):
                assert str(arg).split("=")[0] in flags(commands[command]), f"{command}: {arg}"


def snake(key: str) -> str:
    return re.sub(r"([A-Z])", r"_\1", key).lower()


def engine_option_of(key: str) -> Option:
    """The engine option a chart value `engine.<key>` stands for: the field of that name
    (`prefixCaching`: enable_prefix_caching)."""
    by_field = {o.field: o for o in ENGINE_OPTIONS}
    found = by_field.get(snake(key)) or by_field.get(f"enable_{snake(key)}")
    assert found, f"engine.{key} names no EngineConfig option"
    return found


def test_chart_engine_values_are_the_engine_options(monkeypatch) -> None:
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())["$defs"]["engine"]
    kinds = {"integer": int, "number": float, "boolean": bool}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, spec in schema["properties"].items():
        o = engine_option_of(key)
        if "enum" in spec:
            assert tuple(spec["enum"]) == o.choices, f"engine.{key}"
        else:
            assert kinds[spec["type"]] is o.type, f"engine.{key}"
    for pool in ("prefill", "decode"):
        assert set(values[pool]["engine"]) == set(schema["properties"])
        # Every engine value, set to another value, reaches the engine's field of its name.
        samples = {}
        for key, default in values[pool]["engine"].items():
            o = engine_option_of(key)
            samples[key] = (not default) if o.type is bool else other_value(o)
            if o.type is int and default:
                samples[key] = default * 2
        sets = {f"{pool}.engine.{k}": v for k, v in samples.items()}
        (c,) = [c for c in pdserve_containers(render(None, **sets)) if c["args"][0] == pool]
        config = engine_config(parse_container(c, monkeypatch))
        for key, value in samples.items():
            o = engine_option_of(key)
            got = getattr(config, o.field)
            assert got == value, f"{pool}.engine.{key}={value}: {o.field} is {got!r}"


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda p: p.stem if p else "default")
def test_chart_pool_values_named_like_options_reach_them(values, monkeypatch) -> None:
    chart = yaml.safe_load((CHART / "values.yaml").read_text())
    if values:
        for pool, extra in (yaml.safe_load(values.read_text()) or {}).items():
            if isinstance(extra, dict) and pool in chart:
                chart[pool].update(extra)
    containers = {c["args"][0]: c for c in pdserve_containers(render(values))}
    checked = 0
    for command, c in containers.items():
        args = parse_container(c, monkeypatch)
        for key, value in chart[command].items():
            if isinstance(value, dict | list) or not hasattr(args, snake(key)):
                continue
            assert getattr(args, snake(key)) == value, f"{command}.{key}={value!r}"
            checked += 1
    assert checked >= 12
