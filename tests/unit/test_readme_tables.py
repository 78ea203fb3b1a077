"""The README's generated tables say what their sources say: the supported architectures are
`common/models/families.py`'s, row for row, and the reliability table is the fault matrix's
last run (`docs/snippets/chaos-matrix.md`, written by `make chaos`), copied whole."""

from __future__ import annotations

import re
from pathlib import Path

from pdserve.common.models.families import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_supported_models_are_the_families():
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| ([a-z ]+) \|$", README, re.MULTILINE)
    expected = [
        (arch, family.name, "mixture of experts" if family.moe else "dense")
        for arch, family in FAMILIES.items()
    ]
    assert rows == expected


def test_reliability_table_is_the_last_chaos_run():
    block = re.search(
        r"<!-- chaos-matrix: begin[^>]*-->\n(.*?)<!-- chaos-matrix: end -->", README, re.DOTALL
    )
    assert block is not None, "README.md lost its chaos-matrix block"
    assert block.group(1) == (ROOT / "docs" / "snippets" / "chaos-matrix.md").read_text()
    assert (
        '--8<-- "docs/snippets/chaos-matrix.md"' in (ROOT / "docs" / "reliability.md").read_text()
    )
