"""The check behind every batch-invariance test: an op applied to any slice of rows gives
exactly the rows it gives inside the whole batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def assert_rows_invariant(
    op: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    rows: Sequence[int],
    splits: Sequence[Sequence[int]],
) -> None:
    """op(x[a:b]) == op(x)[a:b], bit for bit, for every M in `rows` (from the start and
    shifted to the middle) and for every split of x into consecutive chunks."""
    full = op(x)
    for m in rows:
        assert torch.equal(op(x[:m]), full[:m]), f"first {m} rows"
        start = (len(x) - m) // 2
        assert torch.equal(op(x[start : start + m]), full[start : start + m]), f"{m} at {start}"
    for split in splits:
        parts = torch.cat([op(chunk) for chunk in x.split(list(split))])
        assert torch.equal(parts, full), f"split {split}"
