"""Every measured figure the README and the docs cite is read from the results file it names.

The convention, in the Markdown source (HTML comments, so neither GitHub nor the docs site
shows them):

    <!-- source: benchmarks/results/avx2-zen3/2026-12-07-targets/serve.json -->
    TPOT p99 37.6 ms<!-- fig: systems/colocated/rates/rate_rps=1.0/tpot_s/p99 x1000 -->

A `source` marker names the JSON file for the `fig` markers after it in the same file. A `fig`
marker gives a key path into that file: keys separated by `/`, a number indexing a list, and
`key=value` picking the list's element whose `key` equals `value`; an optional `xN` scales the
value (seconds shown in ms: `x1000`). The figure is the last number written before the marker
on its line, and the file's value, scaled, must round to it at the decimals it is written with.
Every file under benchmarks/results must belong to a cited run (be cited, or sit in a folder
beside a cited file: a run's log next to its JSON): the folder holds just the runs the docs
cite.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages whose figures must all be cited: they carry the measurements.
MEASURED = [ROOT / "README.md", ROOT / "docs" / "performance.md"]

MARKER = re.compile(r"<!--\s*(source|fig):\s*(.*?)\s*-->")
SPEC = re.compile(r"(?P<path>.+?)(?:\s+x(?P<scale>\d+(?:\.\d+)?))?")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def lookup(data: Any, path: str) -> Any:
    """The value at a `/`-separated key path (see the module docstring)."""
    node = data
    for part in path.split("/"):
        if isinstance(node, list) and re.fullmatch(r"\d+", part):
            node = node[int(part)]
        elif isinstance(node, list) and "=" in part:
            key, want = part.split("=", 1)
            matches = [e for e in node if isinstance(e, dict) and _same(e.get(key), want)]
            if len(matches) != 1:
                raise KeyError(f"{part!r} picks {len(matches)} elements")
            node = matches[0]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(f"no {part!r} in {type(node).__name__}")
    return node


def _same(value: Any, text: str) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return str(value) == text


def citations(text: str) -> list[tuple[int, str | None, str, str]]:
    """(line number, source, key path with its scale, the text before the marker) per fig."""
    out, source = [], None
    for number, line in enumerate(text.splitlines(), 1):
        start = 0
        for m in MARKER.finditer(line):
            if m.group(1) == "source":
                source = m.group(2)
            else:
                before = MARKER.sub("", line[start : m.start()])
                out.append((number, source, m.group(2), before))
            start = m.end()
    return out


def sources(page: Path) -> list[str]:
    return [m.group(2) for m in MARKER.finditer(page.read_text()) if m.group(1) == "source"]


def check(text: str, name: str, root: Path = ROOT) -> list[str]:
    """What is wrong with a page's citations, one line each; sources are relative to root."""
    wrong: list[str] = []
    cache: dict[str, Any] = {}
    for number, source, spec, before in citations(text):
        where = f"{name}:{number}"
        if source is None:
            wrong.append(f"{where}: fig before any source marker")
            continue
        if source not in cache:
            try:
                cache[source] = json.loads((root / source).read_text())
            except (OSError, ValueError) as e:
                wrong.append(f"{where}: {source}: {e}")
                cache[source] = None
        if cache[source] is None:
            continue
        parts = SPEC.fullmatch(spec)
        assert parts is not None
        path, scale = parts["path"], parts["scale"]
        numbers = NUMBER.findall(before)
        if not numbers:
            wrong.append(f"{where}: no figure before the marker {spec!r}")
            continue
        shown_text = numbers[-1].replace(",", "")
        shown = float(shown_text)
        decimals = len(shown_text.split(".")[1]) if "." in shown_text else 0
        try:
            value = lookup(cache[source], path)
        except (KeyError, IndexError) as e:
            wrong.append(f"{where}: {source} {path}: {e}")
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            wrong.append(f"{where}: {source} {path} is {value!r}, not a number")
            continue
        value *= float(scale) if scale else 1.0
        if abs(value - shown) > 0.5 * 10**-decimals + 1e-9:
            wrong.append(f"{where}: written {shown_text}, {source} {path} says {value}")
    return wrong


@pytest.mark.parametrize("page", MEASURED, ids=lambda p: p.name)
def test_measured_pages_cite_their_figures(page: Path) -> None:
    assert len(citations(page.read_text())) >= 10, f"{page.name} cites (almost) no figure"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_cited_figure_equals_its_results_file(page: Path) -> None:
    wrong = check(page.read_text(), page.name)
    assert not wrong, "\n".join(wrong)


def test_every_results_file_belongs_to_a_cited_run() -> None:
    cited = {s for page in PAGES for s in sources(page)}
    # A run's folder: benchmarks/results/<host class>/<run>/ (not the host class's own).
    runs = {(ROOT / s).parent for s in cited if (ROOT / s).parent.parent.parent == RESULTS}
    kept = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert kept, "benchmarks/results is empty"
    stray = [
        p.relative_to(ROOT).as_posix()
        for p in kept
        if p.relative_to(ROOT).as_posix() not in cited and p.parent not in runs
    ]
    assert not stray, f"results no page cites: {sorted(stray)}"


def test_a_wrong_figure_or_missing_file_is_caught(tmp_path: Path) -> None:
    """The check itself: a figure off by its last digit, a key path that leads nowhere, a fig
    before any source and a file that is not there each make a line of its report."""
    (tmp_path / "r.json").write_text(json.dumps({"rates": [{"rps": 1.0, "p99": 0.0376}]}))
    text = (
        "early 1<!-- fig: rates/0/rps -->\n"
        "<!-- source: r.json -->\n"
        "ok 37.6 ms<!-- fig: rates/rps=1.0/p99 x1000 -->, 1<!-- fig: rates/0/rps -->\n"
        "off 37.7 ms<!-- fig: rates/rps=1.0/p99 x1000 -->\n"
        "nowhere 1.0<!-- fig: rates/rps=2.0/p99 -->\n"
        "<!-- source: none.json --> gone 1<!-- fig: a -->\n"
    )
    wrong = check(text, "page.md", tmp_path)
    assert [w.split(":")[1] for w in wrong] == ["1", "4", "5", "6"], wrong
